"""The pair-copy CUDA kernel against the tensor-indexing oracle, on a real GPU (marked gpu)."""

from __future__ import annotations


import numpy as np
import pytest

from kvxfer.layout.pairs import direct_pairs, pack_pairs, unpack_pairs
from kvxfer.layout.spec import KVSpec

from .test_pairs_cpu import CASES

pytestmark = pytest.mark.gpu

BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", num_blocks=96, block_size=16)


def _spec(over: dict) -> KVSpec:
    kw = dict(BIG)
    kw.update({k: v for k, v in over.items() if k not in ("block_size", "num_blocks")})
    if "block_size" in over:
        kw["block_size"] = over["block_size"] * 4
    if kw.get("mla"):
        kw["head_dim"] = 576
    return KVSpec(**kw)


@pytest.mark.parametrize("unroll", [4, 8])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("name,p_over,d_over", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_oracle(cuda, name, p_over, d_over, staged, unroll):
    import torch

    from kvxfer.bench.caches import apply_expected, element_view, fill_random, make_cache
    from kvxfer.gpu.ops import PairKernel

    p, d = _spec(p_over), _spec(d_over)
    dev = "cuda:0"
    rng = np.random.default_rng(abs(hash((name, staged))) % 2**32)
    tokens = 600
    p_ids = rng.permutation(p.num_blocks)[: -(-tokens // p.block_size)]
    d_ids = rng.permutation(d.num_blocks)[: -(-tokens // d.block_size)]
    src, dst, want = make_cache(p, dev), make_cache(d, dev), make_cache(d, dev)
    fill_random(src, 1)
    fill_random(dst, 2)
    for w, t in zip(want.tensors, dst.tensors):
        w.copy_(t)
    g = np.gcd(p.block_size, d.block_size)
    apply_expected(src, p_ids, element_view(want), d, d_ids, -(-tokens // g) * g)
    kernel = PairKernel(0, unroll=unroll)
    if staged:
        pack0 = pack_pairs(p, src.geometry, p_ids, d, d_ids, 0, tokens)
        staging = torch.full((pack0.nbytes,), 0x5A, dtype=torch.uint8, device=dev)
        base = staging.data_ptr()
        k1 = kernel.launch(pack_pairs(p, src.geometry, p_ids, d, d_ids, base, tokens))
        k2 = kernel.launch(unpack_pairs(p, p_ids, d, dst.geometry, d_ids, base, tokens))
    else:
        k1 = kernel.launch(direct_pairs(p, src.geometry, p_ids, d, dst.geometry, d_ids, tokens))
        k2 = None
    torch.cuda.synchronize()
    del k1, k2
    for got, exp in zip(dst.tensors, want.tensors):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))


def test_registry_registers_torch_and_cupy_cuda_tensors(cuda):
    """torch and cupy CUDA tensors register with NIXL as VRAM regions (skips without nixl)."""
    import cupy
    import torch

    pytest.importorskip("nixl_cu13._api" if _has("nixl_cu13") else "nixl._api")
    from kvxfer.backend.nixl import NixlBackend
    from kvxfer.memory.tensors import describe
    from kvxfer.types import MemKind, Region

    t = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    with cupy.cuda.Device(0):
        c = cupy.arange(1 << 18, dtype=cupy.int32)
    with NixlBackend("gpu-reg-test") as backend:
        for obj in (t, c):
            info = describe(obj)
            assert info.kind is MemKind.VRAM and info.addr and info.nbytes == 1 << 20
            handle = backend.register([Region(info.addr, info.nbytes, info.device, info.kind)])
            backend.deregister(handle)


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


