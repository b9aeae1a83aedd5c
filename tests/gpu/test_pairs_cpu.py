"""The GPU path's copy tables, executed on host bytes and checked against an element-level oracle.

These run everywhere (no GPU needed): they check the index math the CUDA kernel executes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.gpu.ops import pair_copy_numpy
from kvxfer.layout.pairs import direct_pairs, pack_pairs, unpack_pairs
from kvxfer.layout.spec import CacheGeometry, KVSpec

from .oracle import element_view, expected_move

BASE = dict(num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16", num_blocks=12)

# (name, producer overrides, consumer overrides)
CASES = [
    ("same-nhd", {}, {}),
    ("same-hnd", {"layout": "HND"}, {"layout": "HND"}),
    ("hnd-to-nhd", {"layout": "HND"}, {"layout": "NHD"}),
    ("nhd-to-hnd-packed", {"storage": "packed"}, {"layout": "HND"}),
    ("cross-layer-to-split", {"storage": "cross_layer"}, {}),
    ("head-packed-to-nhd-tp2", {"storage": "head_packed", "layout": "HND"}, {"tp_size": 2, "tp_rank": 1}),
    ("split-to-head-packed", {}, {"storage": "head_packed", "layout": "HND"}),
    ("tp1-to-2-rank1", {"layout": "HND"}, {"tp_size": 2, "tp_rank": 1}),
    ("tp1-to-2-nhd", {}, {"tp_size": 2, "tp_rank": 0}),
    ("tp2-to-1-rank1", {"tp_size": 2, "tp_rank": 1, "layout": "HND"}, {}),
    ("tp4-to-1-rank2", {"tp_size": 4, "tp_rank": 2}, {"layout": "HND"}),
    ("tp8-replicated", {"tp_size": 8, "tp_rank": 5}, {"tp_size": 2, "tp_rank": 1}),
    ("block16-to-32", {"block_size": 4}, {"block_size": 8, "num_blocks": 8}),
    ("block32-to-16-hnd", {"block_size": 8, "layout": "HND", "num_blocks": 8}, {"block_size": 4}),
    ("mla", {"mla": True, "num_kv_heads": 1, "tp_size": 2, "tp_rank": 1}, {"mla": True, "num_kv_heads": 1}),
]


def _spec(over: dict) -> KVSpec:
    kw = dict(BASE, block_size=4)
    kw.update(over)
    return KVSpec(**kw)


def _cache(spec: KVSpec, arena: np.ndarray, offset: int) -> tuple[CacheGeometry, np.ndarray]:
    geom = CacheGeometry.contiguous(spec, int(arena.ctypes.data) + offset)
    return geom, element_view(spec, arena, geom)


@pytest.mark.parametrize("name,p_over,d_over", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("staged", [False, True])
def test_pairs_match_oracle(name, p_over, d_over, staged):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    p, d = _spec(p_over), _spec(d_over)
    n_p = 5 * 8 // p.block_size  # 40 tokens worth of blocks (fragmented, shuffled)
    n_d = 5 * 8 // d.block_size
    p_ids = rng.permutation(p.num_blocks)[:n_p]
    d_ids = rng.permutation(d.num_blocks)[:n_d]
    tokens = 37  # a partial last block: rounded up to whole chunks
    arena = rng.integers(0, 256, size=p.cache_bytes + 2 * d.cache_bytes + 4 * p.cache_bytes,
                         dtype=np.uint8)
    p_geom, p_view = _cache(p, arena, 0)
    d_geom, d_view = _cache(d, arena, p.cache_bytes)
    w_geom, want = _cache(d, arena, p.cache_bytes + d.cache_bytes)
    want[...] = d_view  # untouched parts must stay untouched
    chunked = -(-tokens // np.gcd(p.block_size, d.block_size)) * np.gcd(p.block_size, d.block_size)
    expected_move(p, p_view, p_ids, d, want, d_ids, int(chunked))
    if staged:
        staging = int(arena.ctypes.data) + p.cache_bytes + 2 * d.cache_bytes
        pack = pack_pairs(p, p_geom, p_ids, d, d_ids, staging, num_tokens=tokens)
        unpack = unpack_pairs(p, p_ids, d, d_geom, d_ids, staging, num_tokens=tokens)
        assert pack.nbytes == unpack.nbytes and pack.nbytes <= 4 * p.cache_bytes
        pair_copy_numpy(pack, arena)
        pair_copy_numpy(unpack, arena)
    else:
        pair_copy_numpy(direct_pairs(p, p_geom, p_ids, d, d_geom, d_ids, num_tokens=tokens), arena)
    assert np.array_equal(d_view, want)
    assert not np.array_equal(d_view, _cache(d, arena, p.cache_bytes + d.cache_bytes)[1] * 0)


def test_disjoint_heads_refused():
    p = _spec({"tp_size": 2, "tp_rank": 0})
    d = _spec({"tp_size": 2, "tp_rank": 1})
    geom = CacheGeometry.contiguous(p, 4096)
    with pytest.raises(LayoutError, match="holds no head"):
        direct_pairs(p, geom, [0], d, CacheGeometry.contiguous(d, 1 << 20), [0])


def test_bad_ids_and_tokens_refused():
    p = _spec({})
    geom = CacheGeometry.contiguous(p, 4096)
    with pytest.raises(BlockIdError, match=r"\[0, 12\)"):
        direct_pairs(p, geom, [12], p, geom, [0])
    with pytest.raises(BlockIdError, match="num_tokens"):
        direct_pairs(p, geom, [1], p, geom, [0], num_tokens=5)
    with pytest.raises(LayoutError, match="head_dim differs"):
        direct_pairs(p, geom, [1], _spec({"head_dim": 16}), geom, [0])


def test_pair_tables_use_the_translators_compatibility_rule_model_included():
    # One rule for every path: the GPU tables refuse another model's cache as the plans do.
    a = KVSpec(**BASE, block_size=4, model="llama")
    b = KVSpec(**BASE, block_size=4, model="qwen")
    ga, gb = CacheGeometry.contiguous(a, 1 << 20), CacheGeometry.contiguous(b, 1 << 30)
    with pytest.raises(LayoutError, match="model differs"):
        direct_pairs(a, ga, np.arange(2), b, gb, np.arange(2))


@pytest.mark.parametrize("ids", [[3.7], [1, 1], [1 << 63], [True]])
def test_pair_tables_use_the_one_block_id_validator(ids):
    a = KVSpec(**BASE, block_size=4)
    g = CacheGeometry.contiguous(a, 1 << 20)
    with pytest.raises(BlockIdError):
        direct_pairs(a, g, ids, a, g, [0] * len(ids))
