"""The GPU transfer paths through the public API: a decode process reads a request's blocks
from a prefill process with ``Agent.read``, and kvxfer picks the path per request.

Run:  python examples/gpu_read.py
On GPUs: same host -> CUDA IPC single pass (one kernel reads the peer's cache), other host ->
staged pipeline (the producer packs, large NIXL reads, the consumer unpacks). Without a GPU
the same staged protocol runs on host memory (``transfer_path="staged"``), so this example
runs anywhere; the GPU part is skipped with a message when CUDA or cupy is missing.
The prefill side is HND and the decode side NHD: the pack converts the layout on the way.
"""

import multiprocessing as mp
import os
import sys

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

COMMON = dict(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=64,
              dtype="bfloat16", model="example-model")
PREFILL, DECODE = KVSpec(**COMMON, layout="HND"), KVSpec(**COMMON, layout="NHD")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5730"))
SRC, DST = [40, 3, 17, 18, 9, 60], [0, 1, 2, 30, 31, 5]   # fragmented block ids, token order


def host_cache(spec: KVSpec, seed: int) -> list[np.ndarray]:
    """One [2, blocks, <block>] tensor per layer (int16 stands in for bf16: same itemsize)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-(1 << 15), 1 << 15, size=s, dtype=np.int16) for s in spec.tensor_shapes()]


def to_device(cache, device: str):
    if device == "cpu":
        return cache
    import torch

    return [torch.from_numpy(a).to(device) for a in cache]


def tokens_nhd(spec: KVSpec, cache: list[np.ndarray], ids) -> np.ndarray:
    """[layers, K/V, tokens, heads, head_dim] of ``ids``: what must match after the read."""
    out = []
    for t in cache:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)
        sel = t[:, ids]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def prefill(device: str, path: str, port: int, ready, done) -> None:
    if device != "cpu":
        import torch

        torch.cuda.set_device(int(device.split(":")[1]))
    cache = to_device(host_cache(PREFILL, seed=1), device)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, transfer_path=path,
                         pipeline_slot_bytes=64 << 10, pipeline_slots=4)
    with Agent("prefill", PREFILL, config) as agent:
        agent.register(cache)
        agent.listen()
        agent.hold("req-7", SRC)
        ready.set()
        while "req-7" not in agent.finished().freed:  # sent once the decode side is done (or aborted, expired)
            done.wait(0.01)


def decode(device: str, path: str, port: int) -> None:
    cache = to_device(host_cache(DECODE, seed=2), device)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port + 1, transfer_path=path,
                         pipeline_slot_bytes=64 << 10, pipeline_slots=4)
    with Agent("decode", DECODE, config) as agent:
        agent.register(cache)
        stats = agent.read(("127.0.0.1", port), DST, SRC, "req-7", timeout=60).wait()
        got = [t if device == "cpu" else t.cpu().numpy() for t in cache]
        want = tokens_nhd(PREFILL, host_cache(PREFILL, seed=1), SRC)
        assert np.array_equal(tokens_nhd(DECODE, got, DST), want), "read bytes differ"
        print(f"decode ({device}, transfer_path={path}): path {stats.mode}, {stats.num_bytes} bytes "
              f"in {stats.total_seconds * 1e3:.1f} ms; HND -> NHD, every byte matches")


def run(device: str, path: str, port: int) -> int:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=prefill, args=(device, path, port, ready, done))
    p.start()
    if not ready.wait(120):
        raise SystemExit("prefill did not start")
    decode(device, path, port)
    p.join(30)
    return p.exitcode


def gpu_missing() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install cupy-cuda12x)"
    return ""


if __name__ == "__main__":
    if run("cpu", "staged", PORT):
        sys.exit(1)
    why = gpu_missing()
    if why:
        print(f"GPU part skipped: {why}")
        sys.exit(0)
    sys.exit(run("cuda:0", "auto", PORT + 10))
