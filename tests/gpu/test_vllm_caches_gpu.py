"""vLLM 0.32's GPU attention caches, allocated on the GPU with vLLM's shapes and strides, described by
the vLLM adapter's ``describe_cache`` and moved between two processes through ``Agent`` over NIXL,
byte for byte (marked gpu; vLLM itself is not needed: tests/gpu/vllm_layouts.py builds its tensors).

Cases: TP 1->1, 2->1 and 1->2 (``LBHNC``, the connector's default, bf16 and fp8), ``LBNHC``,
cross-layer blocks (``BLHNC``), MLA, and ``LBHNC`` <-> ``LBNHC`` peers (HND <-> NHD converted, TP 1->1,
2->1, 1->2, bf16/fp16/fp8, cross-layer to per-layer). Bytes are compared in vLLM's logical
``[blocks, heads, tokens, K | V]`` order, so a case passes only if every element lands where the
consumer's own layout keeps it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvxfer.testing import ProducerProcess, free_port_block, serve_commands

from .vllm_layouts import layout_views

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
N, BS, H, D, L = 32, 16, 4, 128, 3
SRC, DST = [3, 17, 4, 30], [9, 0, 22, 5]


def _cache_module():
    """adapters/vllm/cache.py (imports torch and kvxfer only), without installing kvxfer_vllm."""
    name = "kvxfer_vllm_cache"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "adapters" / "vllm" / "cache.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.cuda.synchronize()


def _views(case: dict, tp_size: int, seed: int | None, device: str):
    """``device``: ``cuda:N``, or ``cpu`` for a dry run of this module's logic over NIXL in host memory."""
    import torch

    heads = case["heads"] if case["mla"] else case["heads"] // tp_size  # MLA: every rank holds the latent
    views = layout_views(num_layers=L, num_blocks=N, heads=heads, block_size=BS, content=case["content"],
                         dtype=_dtype(case["dtype"]), layout=case["layout"], device=device)
    if seed is not None:
        g = torch.Generator(device=device).manual_seed(seed)
        for v in views:
            raw = v.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, device=raw.device, dtype=torch.uint8))
    _sync(device)
    return views


def _describe(views, case: dict, tp_rank: int, tp_size: int):
    return _cache_module().describe_cache(
        views, num_blocks=N, block_size=BS, num_kv_heads=case["heads"], head_size=case["head_size"],
        tp_rank=tp_rank, tp_size=tp_size, model="vllm-gpu-itest", mla=case["mla"], cpu_kernel=False)


def _producer(cmd, out, case, tp_rank, tp_size, port, device) -> None:
    import torch

    from kvxfer import Agent, AgentConfig

    views = _views(case, tp_size, seed=100 + tp_rank, device=device)
    desc = _describe(views, case, tp_rank, tp_size)
    with Agent(f"vllm-gpu-p{tp_rank}", desc.spec, AgentConfig(side_channel_host="127.0.0.1",
                                                              side_channel_port=port)) as agent:
        agent.register(desc.tensors)
        agent.listen()
        serve_commands(agent, {"req": SRC}, cmd, out,
                       extra={"bytes": lambda a: [v.view(torch.uint8).cpu().numpy() for v in views]})


def _attention(layout: str, dtype: str = "bfloat16") -> dict:
    return dict(layout=layout, dtype=dtype, heads=H, head_size=D, content=2 * D, mla=False)


MLA = dict(layout="LBHNC", dtype="bfloat16", heads=1, head_size=576, content=576, mla=True)
#: name -> (the producer's cache, producer TP, consumer TP[, the consumer's layout when it differs]).
CASES = {
    "tp1-1-lbhnc-bf16": (_attention("LBHNC"), 1, 1),
    "tp2-1-lbhnc-bf16": (_attention("LBHNC"), 2, 1),
    "tp1-2-lbhnc-fp8": (_attention("LBHNC", "float8_e4m3fn"), 1, 2),
    "tp1-1-lbnhc-fp16": (_attention("LBNHC", "float16"), 1, 1),
    "tp1-1-blhnc-cross-layer": (_attention("BLHNC"), 1, 1),
    "tp1-1-mla": (MLA, 1, 1),
    "tp2-1-mla": (MLA, 2, 1),
    "tp1-1-lbhnc-to-lbnhc-bf16": (_attention("LBHNC"), 1, 1, "LBNHC"),
    "tp1-1-lbnhc-to-lbhnc-fp16": (_attention("LBNHC", "float16"), 1, 1, "LBHNC"),
    "tp2-1-lbnhc-to-lbhnc-fp8": (_attention("LBNHC", "float8_e4m3fn"), 2, 1, "LBHNC"),
    "tp1-2-lbhnc-to-lbnhc-bf16": (_attention("LBHNC"), 1, 2, "LBNHC"),
    "tp1-1-blhnc-to-lbnhc-bf16": (_attention("BLHNC"), 1, 1, "LBNHC"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_gpu_cache_moves_byte_exact_between_processes(cuda, name):
    run_case(name, producer_device=f"cuda:{1 if cuda > 1 else 0}", consumer_device="cuda:0")


def run_case(name: str, producer_device: str, consumer_device: str) -> None:
    """Producer ranks in spawned processes hold SRC; consumer ranks here read them into DST."""
    import torch

    from kvxfer import Agent, AgentConfig, ReadRequest

    case, p_tp, d_tp, *other = CASES[name]
    mine = {**case, "layout": other[0]} if other else case   # the consumer's cache
    port = free_port_block(2)
    producers = [ProducerProcess(_producer, case, r, p_tp, port, producer_device, wait=False) for r in range(p_tp)]
    agents = []
    try:
        for p in producers:
            p.ready()
        sent = [p.ask("bytes") for p in producers]            # per rank: per layer uint8 [N, H/p_tp, BS, C]
        for r in range(d_tp):
            views = _views(mine, d_tp, seed=None, device=consumer_device)
            desc = _describe(views, mine, r, d_tp)
            agent = Agent(f"vllm-gpu-d{r}", desc.spec, AgentConfig(side_channel_host="127.0.0.1",
                                                                   side_channel_port=free_port_block(1)))
            agents.append(agent)
            agent.register(desc.tensors)
            request = ReadRequest(("127.0.0.1", port), DST, SRC, "req", same_format=desc.same_format_only)
            agent.read_many([request])[0].wait(60)
            _sync(consumer_device)
            heads_here = 1 if case["mla"] else case["heads"] // d_tp
            for layer, view in enumerate(views):   # logical [blocks, heads, tokens, bytes] on both sides
                got = view.view(torch.uint8).cpu().numpy()
                for i in range(heads_here):
                    if case["mla"]:
                        src_rank, src_head = 0, 0
                    else:
                        g = r * heads_here + i
                        src_rank, src_head = divmod(g, case["heads"] // p_tp)
                    want = sent[src_rank][layer][SRC, src_head]
                    assert (got[DST, i] == want).all(), (name, layer, i)
                untouched = [b for b in range(N) if b not in DST]
                assert not got[untouched].any(), (name, layer)
    finally:
        for a in agents:
            a.close()
        for p in producers:
            p.stop()
