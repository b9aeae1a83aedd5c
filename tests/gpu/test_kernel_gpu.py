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




_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""

SMALL = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", num_blocks=128, block_size=16)


def _pairs_of(n_requests: int, per: int, seed: int):
    """``n_requests`` requests of ``per`` blocks: random source ids, disjoint destination ids."""
    rng = np.random.default_rng(seed)
    dst = rng.permutation(SMALL.num_blocks)[: n_requests * per].reshape(n_requests, per)
    return [(rng.permutation(SMALL.num_blocks)[:per].astype(np.int64), d.astype(np.int64)) for d in dst]


def _check(src, dst, requests) -> None:
    import torch

    for s_ids, d_ids in requests:
        s_t, d_t = torch.as_tensor(s_ids, device="cuda:0"), torch.as_tensor(d_ids, device="cuda:0")
        for s, d in zip(src.tensors, dst.tensors):  # each (K/V, blocks, ...): compare as integers
            s2, d2 = s.view(torch.int16).view(2, SMALL.num_blocks, -1), d.view(torch.int16).view(2, SMALL.num_blocks, -1)
            assert torch.equal(s2[:, s_t], d2[:, d_t]), (s_ids, d_ids)


def test_lean_launches_exact_when_the_id_ring_is_full_and_threads_race(cuda):
    """Four threads launch 24 requests each on their own streams, queued behind a kernel that
    spins ~20 ms: the ring's 16 slots are all in use for most launches, so those take the generic
    path while others reuse slots. Every request's blocks must land exactly where they belong."""
    import threading

    import cupy as cp
    import torch

    from kvxfer.bench.caches import fill_random, make_cache
    from kvxfer.gpu import ops

    src, dst = make_cache(SMALL, "cuda:0"), make_cache(SMALL, "cuda:0")
    fill_random(src, 3)
    fill_random(dst, 4)
    kernel = ops.PairKernel(0)
    spin = cp.RawKernel(_SPIN, "spin")
    clock_hz = cp.cuda.Device(0).attributes.get("ClockRate", 1_980_000) * 1000  # kHz; SM clock
    requests = _pairs_of(96, 1, seed=5)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    generic = []
    real_ids = ops.PairKernel._ids

    def counting_ids(self, *a, **k):  # the generic path's id upload: counts its launches
        generic.append(1)
        return real_ids(self, *a, **k)

    ops.PairKernel._ids = counting_ids
    keeps, errors = [], []

    def run(t: int) -> None:
        try:
            with streams[t]:
                spin((1,), (1,), (np.int64(clock_hz // 50),))
            for s_ids, d_ids in requests[t::4]:
                copy = direct_pairs(SMALL, src.geometry, s_ids, SMALL, dst.geometry, d_ids)
                keeps.append(kernel.launch(copy, streams[t].ptr))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        ops.PairKernel._ids = real_ids
    assert not errors, errors
    torch.cuda.synchronize()
    for stream in streams:
        stream.synchronize()
    _check(src, dst, requests)
    assert 0 < len(generic) < len(requests), f"{len(generic)} of {len(requests)} launches took the generic path"


def test_lean_launch_falls_back_when_a_request_outgrows_a_ring_slot(cuda, monkeypatch):
    import torch

    from kvxfer.bench.caches import fill_random, make_cache
    from kvxfer.gpu import ops

    monkeypatch.setattr(ops, "_RING_IDS", 8)  # both sides' ids of a request share one slot
    src, dst = make_cache(SMALL, "cuda:0"), make_cache(SMALL, "cuda:0")
    fill_random(src, 6)
    fill_random(dst, 7)
    kernel = ops.PairKernel(0)
    small, large = _pairs_of(1, 4, seed=8)[0], _pairs_of(1, 40, seed=9)[0]
    for s_ids, d_ids in (small, large, small):
        keep = kernel.launch(direct_pairs(SMALL, src.geometry, s_ids, SMALL, dst.geometry, d_ids))
        torch.cuda.synchronize()
        del keep
        _check(src, dst, [(s_ids, d_ids)])
    assert kernel._ring is not None and kernel._ring._ids == 8


def test_generic_launch_still_exact(cuda):
    """``lean=False`` (kept for comparison) moves the same bytes."""
    import torch

    from kvxfer.bench.caches import fill_random, make_cache
    from kvxfer.gpu.ops import PairKernel

    src, dst = make_cache(SMALL, "cuda:0"), make_cache(SMALL, "cuda:0")
    fill_random(src, 10)
    fill_random(dst, 11)
    requests = _pairs_of(8, 3, seed=12)
    kernel = PairKernel(0, lean=False)
    keeps = [kernel.launch(direct_pairs(SMALL, src.geometry, s, SMALL, dst.geometry, d)) for s, d in requests]
    torch.cuda.synchronize()
    del keeps
    _check(src, dst, requests)
    assert kernel._ring is None
