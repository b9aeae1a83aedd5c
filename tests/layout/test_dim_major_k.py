"""A dim-major K (``KVSpec.k_dim_chunk``: vLLM CPU's key cache) in the translator and the pair path.

The caches are real numpy buffers; what a plan moves is compared with the byte oracle
(``logical_kv``), and one cache is also built the way vLLM's CPU kernel writes it (K transposed
per head, V token-major) to check the spec describes those bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _layout_checks import check_staged_map, check_tables
from kvxfer.errors import LayoutError
from kvxfer.layout import CacheGeometry, CacheView, KVSpec, build_plan, peer_ranks
from kvxfer.layout.oracle import Arena, execute, fill_pattern, logical_kv, place_cache
from kvxfer.layout.pairs import DirectTemplate, direct_pairs, pack_pairs, pair_copy_why, unpack_pairs
from kvxfer.types import Direction


def vllm_cpu(**kw) -> KVSpec:
    """vLLM CPU's cache (``vec`` ISA): head_packed HND, K transposed per head (chunk 1)."""
    base = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=8, num_blocks=6, dtype="float32",
                layout="HND", storage="head_packed", k_dim_chunk=1, model="m")
    base.update(kw)
    return KVSpec(**base)


def test_spec_describes_vllm_cpu_bytes():
    """K[t, h, d] written at [block, h, 0, d, t] and V at [block, h, 1, t, d] of a
    [blocks, heads, 2, block_size * head_dim] buffer: what vLLM's CPU kernel does, read back right."""
    spec = vllm_cpu(num_layers=1, num_blocks=2)
    n, heads, bs, d = spec.num_blocks, spec.heads_per_rank, spec.block_size, spec.head_dim
    rng = np.random.default_rng(0)
    k, v = rng.random((2, n * bs, heads, d), dtype=np.float32)
    cache = np.zeros((n, heads, 2, bs * d), dtype=np.float32)
    kb = k.reshape(n, bs, heads, d)
    cache[:, :, 0] = kb.transpose(0, 2, 3, 1).reshape(n, heads, d * bs)     # [head_dim, block_size]
    cache[:, :, 1] = v.reshape(n, bs, heads, d).transpose(0, 2, 1, 3).reshape(n, heads, bs * d)
    arena = Arena.wrap(cache)
    geo = CacheGeometry.contiguous(spec, arena.base)
    got = logical_kv(CacheView(spec, geo), arena, [0, 1]).view(np.float32)[0, :, :, :, :]
    assert np.array_equal(got[0], k) and np.array_equal(got[1], v)


SHAPES = [
    ("vllm-cpu fp32 -> nhd split", vllm_cpu(), dict(layout="NHD", storage="split", k_dim_chunk=0)),
    ("nhd split -> vllm-cpu fp32", dict(layout="NHD", storage="split", k_dim_chunk=0), vllm_cpu()),
    ("vllm-cpu -> hnd cross_layer bs4", vllm_cpu(), dict(storage="cross_layer", k_dim_chunk=0, block_size=4,
                                                         num_blocks=12)),
    ("classic bf16 x8 -> vllm-cpu bf16", dict(dtype="bfloat16", head_dim=16, k_dim_chunk=8, storage="split"),
     vllm_cpu(dtype="bfloat16", head_dim=16)),
    ("vllm-cpu tp2 -> nhd tp1", vllm_cpu(tp_size=2), dict(layout="NHD", storage="packed", k_dim_chunk=0)),
    ("nhd tp1 -> vllm-cpu tp4 bs16", dict(layout="NHD", storage="split", k_dim_chunk=0, block_size=4,
                                          num_blocks=24),
     vllm_cpu(tp_size=4, block_size=16, num_blocks=3)),
]


def _spec(x) -> KVSpec:
    return x if isinstance(x, KVSpec) else vllm_cpu(**x)


@pytest.mark.parametrize("name,remote,local", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("mode", ["auto", "direct", "host-staged"])
def test_read_converts_every_rank(name, remote, local, mode):
    """A local rank reads its heads from every remote rank ``peer_ranks`` names; READ and the
    plan reversed as a WRITE both leave exactly the logical KV of the other side."""
    remote, local = _spec(remote), _spec(local)
    for lrank in range(local.tp_size):
        ls = local.with_rank(lrank)
        lview, larena = place_cache(ls, gap=40)
        fill_pattern(lview, larena, seed=1)
        tokens = 2 * max(ls.block_size, remote.block_size)
        lb = np.arange(tokens // ls.block_size)[::-1].copy()
        rb = np.arange(1, 1 + tokens // remote.block_size)
        for rrank in peer_ranks(ls, remote.tp_size):
            rview, rarena = place_cache(remote.with_rank(rrank), arena_base=0x4000_0000)
            fill_pattern(rview, rarena, seed=7 + rrank)
            plan = build_plan(lview, rview, mode=mode)
            req = plan.for_request(lb, rb)
            check_tables(req)
            check_staged_map(plan, req)
            execute(plan, req, larena, rarena)
            h0, h1 = plan.heads
            want = logical_kv(rview, rarena, rb)[:, :, :, h0 - rview.spec.first_head:h1 - rview.spec.first_head]
            got = logical_kv(lview, larena, lb)[:, :, :, h0 - ls.first_head:h1 - ls.first_head]
            assert np.array_equal(got, want), (name, plan)
            if plan.reversible:   # WRITE: the other way along the same plan
                fill_pattern(rview, rarena, seed=99)
                execute(plan, req, larena, rarena, Direction.WRITE)
                again = logical_kv(rview, rarena, rb)[:, :, :, h0 - rview.spec.first_head:h1 - rview.spec.first_head]
                assert np.array_equal(again, got)


def test_nhd_peer_needs_staging_and_refuses_without_conversion():
    """vLLM CPU -> NHD cuts K into single elements: auto stages, and without conversion the
    LayoutError names both layouts."""
    lview = place_cache(vllm_cpu(layout="NHD", storage="split", k_dim_chunk=0))[0]
    rview = place_cache(vllm_cpu(), arena_base=0x4000_0000)[0]
    assert build_plan(lview, rview).mode == "host-staged"
    with pytest.raises(LayoutError, match="NHD/split.*HND/head_packed/K-dim-major1"):
        build_plan(lview, rview, allow_conversion=False)


def test_same_vllm_cpu_caches_move_whole_rows():
    """Two vLLM CPU caches of one format: one descriptor per layer and run of blocks."""
    a, b = place_cache(vllm_cpu())[0], place_cache(vllm_cpu(), arena_base=0x4000_0000)[0]
    plan = build_plan(a, b)
    assert plan.mode == "direct"
    assert plan.for_request([0, 1, 2], [3, 4, 5]).local.shape[0] == 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_l=st.sampled_from([0, 1, 2, 4, 8]), chunk_r=st.sampled_from([0, 1, 2, 4, 8]),
       storage_l=st.sampled_from(["split", "packed", "cross_layer", "head_packed"]),
       storage_r=st.sampled_from(["split", "packed", "cross_layer", "head_packed"]),
       bs=st.sampled_from([(4, 4), (4, 8), (8, 2), (16, 4)]), tp=st.sampled_from([(1, 1), (1, 2), (2, 1), (4, 2)]),
       mode=st.sampled_from(["auto", "direct", "host-staged"]), data=st.data())
def test_dim_major_chunks_convert_to_each_other(chunk_l, chunk_r, storage_l, storage_r, bs, tp, mode, data):
    """Every pair of K chunkings (bf16, head_dim 8: chunk 8 is token-major), storages, block and TP ratios."""
    common = dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="bfloat16", layout="HND", model="m")
    tokens = 2 * max(bs)
    ls = KVSpec(block_size=bs[0], num_blocks=tokens // bs[0] + 2, storage=storage_l, k_dim_chunk=chunk_l,
                tp_size=tp[0], **common).with_rank(data.draw(st.integers(0, tp[0] - 1)))
    rs = KVSpec(block_size=bs[1], num_blocks=tokens // bs[1] + 1, storage=storage_r, k_dim_chunk=chunk_r,
                tp_size=tp[1], **common)
    rs = rs.with_rank(data.draw(st.sampled_from(peer_ranks(ls, tp[1]))))
    lview, larena = place_cache(ls)
    rview, rarena = place_cache(rs, arena_base=0x4000_0000, gap=8)
    fill_pattern(lview, larena, seed=3)
    fill_pattern(rview, rarena, seed=4)
    lb = np.asarray(data.draw(st.permutations(range(ls.num_blocks)))[:tokens // bs[0]])
    rb = np.asarray(data.draw(st.permutations(range(rs.num_blocks)))[:tokens // bs[1]])
    plan = build_plan(lview, rview, mode=mode)
    req = plan.for_request(lb, rb)
    check_tables(req)
    execute(plan, req, larena, rarena)
    h0, h1 = plan.heads
    want = logical_kv(rview, rarena, rb)[:, :, :, h0 - rs.first_head:h1 - rs.first_head]
    assert np.array_equal(logical_kv(lview, larena, lb)[:, :, :, h0 - ls.first_head:h1 - ls.first_head], want)


@pytest.mark.parametrize("src,dst", [(vllm_cpu(), vllm_cpu(k_dim_chunk=0, layout="NHD", storage="split")),
                                     (vllm_cpu(k_dim_chunk=0), vllm_cpu()), (vllm_cpu(), vllm_cpu())])
def test_pair_copies_refuse_a_dim_major_k_naming_both(src, dst):
    """The pair path (IPC, GPU staging, the host kernel) cannot express it: every builder says so."""
    sgeo = CacheGeometry.contiguous(src, 0x1000)
    dgeo = CacheGeometry.contiguous(dst, 0x9000_0000)
    ids = np.arange(2)
    why = pair_copy_why(src, dst)
    assert why is not None and "dim-major" in why and src.storage.value in why and dst.storage.value in why
    for build in (lambda: direct_pairs(src, sgeo, ids, dst, dgeo, ids),
                  lambda: DirectTemplate(src, sgeo, dst, dgeo),
                  lambda: pack_pairs(src, sgeo, ids, dst, ids),
                  lambda: unpack_pairs(src, ids, dst, dgeo, ids)):
        with pytest.raises(LayoutError, match="cannot express a dim-major K"):
            build()
    assert pair_copy_why(vllm_cpu(k_dim_chunk=0), vllm_cpu(k_dim_chunk=0)) is None


@pytest.mark.parametrize("kw,match", [
    (dict(k_dim_chunk=3), r"k_dim_chunk \(3\) must divide head_dim \(8\)"),
    (dict(k_dim_chunk=-1), "k_dim_chunk must be a non-negative integer"),
    (dict(k_dim_chunk=True), "k_dim_chunk must be a non-negative integer"),
    (dict(k_dim_chunk=1, layout="NHD", storage="split"), "layout must be 'HND'; got 'NHD'"),
    (dict(k_dim_chunk=1, mla=True, num_kv_heads=1, storage="split"), "MLA cache is token-major"),
])
def test_spec_validation_names_the_value(kw, match):
    with pytest.raises(LayoutError, match=match):
        vllm_cpu(**kw)


def test_chunk_of_head_dim_is_token_major():
    assert vllm_cpu(k_dim_chunk=8) == vllm_cpu(k_dim_chunk=0)
    assert vllm_cpu(k_dim_chunk=np.int64(2)).k_dim_chunk == 2
    assert not vllm_cpu(k_dim_chunk=8).k_dim_major and vllm_cpu().grain(0) == 1 and vllm_cpu().grain(1) == 8
