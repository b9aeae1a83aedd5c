"""transformers prefill -> transformers decode between two processes on cuda:0, through kvxfer (marked gpu).

The producer is a spawned process running ``HFEngine.prefill`` on cuda:0 (pool registered with
its Agent); the consumer is this process on cuda:0, reading the blocks (same host, both caches on
a GPU: the CUDA IPC single pass) and decoding with ``HFEngine.decode``. Every answer must equal
this process's ``model.generate`` token for token, and a decoder given prompt A's KV under prompt
B must answer like A. The tiny Qwen3 of REFERENCE §5 is built locally (no download), run in float32.

    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transformers_gpu.py
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
BLOCK = 16


def _importable() -> None:
    """Make ``kvxfer_transformers`` (adapters/transformers) and the vLLM test harness importable
    when kvxfer is used from a source tree rather than installed (the GPU host)."""
    if importlib.util.find_spec("kvxfer_transformers") is None:
        shim = Path(tempfile.gettempdir()) / f"kvxfer_hf_path_{os.getuid()}"
        shim.mkdir(exist_ok=True)
        link = shim / "kvxfer_transformers"
        if not link.exists():
            link.symlink_to(ROOT / "adapters" / "transformers", target_is_directory=True)
        sys.path.insert(0, str(shim))
    harness = str(ROOT / "tests" / "vllm")
    if harness not in sys.path:
        sys.path.insert(0, harness)


def _engine(model_dir: str, side_port: int):
    """An HFEngine on cuda:0 whose side channel listens at 127.0.0.1:side_port (the environment is
    restored afterwards, so other tests' agents do not inherit the port)."""
    from kvxfer_transformers.engine import HFEngine
    from kvxfer_transformers.settings import ServeSettings

    wanted = {"KVXFER_SIDE_CHANNEL_HOST": "127.0.0.1", "KVXFER_SIDE_CHANNEL_PORT": str(side_port)}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        settings = ServeSettings.parse(json.dumps({"kv_role": "kv_both", "kv_load_failure_policy": "fail"}),
                                       device="cuda:0", environ={})
        return HFEngine.start(model_dir, settings=settings, dtype="float32", device="cuda:0", block_size=BLOCK,
                              num_blocks=256)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _producer(model_dir: str, side_port: int, inbox, outbox) -> None:
    """Child process: prefill each prompt it is sent, answer the params, until it gets None."""
    _importable()
    engine = _engine(model_dir, side_port)
    outbox.put("ready")
    try:
        for prompt in iter(inbox.get, None):
            outbox.put(engine.prefill(prompt, 1).kv_transfer_params)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cuda):
    _importable()
    from vllm_harness import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("gpu-tiny-qwen3"))


@pytest.fixture(scope="module")
def producer(tiny):
    from kvxfer.testing import free_port_block

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(str(tiny), free_port_block(4), inbox, outbox), daemon=True)
    proc.start()
    try:
        assert outbox.get(timeout=180) == "ready"
        yield lambda prompt: (inbox.put(list(prompt)), outbox.get(timeout=120))[1]
    finally:
        inbox.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def consumer(tiny):
    from kvxfer.testing import free_port_block

    engine = _engine(str(tiny), free_port_block(4))
    yield engine
    engine.close()


def _generate(engine, prompt: list[int]) -> list[int]:
    import torch

    x = torch.tensor([prompt], device="cuda:0")
    out = engine.model.generate(x, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _decode(consumer, prompt, params):
    from kvxfer_transformers.params import RemotePrefill

    return consumer.decode(prompt, MAX_TOKENS, RemotePrefill.parse(params))


@pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                    layout="NHD split, block 16 -> same", path="ipc (same-host CUDA IPC)", device="GPU (one host)")
@pytest.mark.parametrize("length", [9, 16, 17, 600])
def test_prefill_then_decode_equals_generate(producer, consumer, length):
    from vllm_harness import prompt_of

    prompt = prompt_of(length, seed=length)
    got = _decode(consumer, prompt, producer(prompt))
    assert got.token_ids == _generate(consumer, prompt)
    assert got.loaded_tokens == length - 1
    assert got.notes["transfer_mode"] == "ipc", got.notes  # same host, both caches on a GPU
    print(f"\n{length} tokens: {got.notes['transfer_bytes']} bytes in {got.notes['transfer_seconds'] * 1e3:.3f} ms "
          f"({got.notes['transfer_mode']})")


def test_decoder_uses_the_transferred_kv(producer, consumer):
    from vllm_harness import prompt_of

    a, b = prompt_of(71, seed=1, last=5), prompt_of(71, seed=2, last=5)
    ref_a, ref_b = _generate(consumer, a), _generate(consumer, b)
    assert ref_a != ref_b
    assert _decode(consumer, b, producer(a)).token_ids == ref_a
