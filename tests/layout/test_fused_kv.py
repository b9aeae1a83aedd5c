"""Fused caches (``KVSpec.kv_fused``: one token's K then V in one vector, vLLM's GPU attention caches)
against the byte oracle: HND <-> NHD, split <-> cross-layer, TP and block-size ratios, partial last
blocks, every plan mode; the spec's refusals name the value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _layout_checks import check_staged_map, check_tables
from kvxfer.errors import LayoutError
from kvxfer.layout import KVSpec, build_plan, peer_ranks
from kvxfer.layout.oracle import execute, fill_pattern, logical_kv, place_cache
from kvxfer.layout.pairs import direct_pairs, pair_copy_why
from kvxfer.types import Direction


def fused(**kw) -> KVSpec:
    base = dict(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=8, dtype="bfloat16",
                layout="HND", storage="split", kv_fused=True, model="m")
    base.update(kw)
    return KVSpec(**base)


def test_a_fused_spec_has_one_region_per_layer_of_real_heads():
    s = fused(tp_size=2, tp_rank=1)
    assert (s.kv_count, s.heads_per_rank, s.first_head) == (1, 2, 2)
    assert s.tensor_shapes() == [(8, 2, 4, 16)] * 2
    assert fused(layout="NHD", storage="cross_layer").tensor_shapes() == [(8, 2, 1, 4, 4, 16)]
    assert s.cache_bytes == 2 * 8 * 2 * 4 * 16 * 2


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts=st.tuples(st.sampled_from(["HND", "NHD"]), st.sampled_from(["HND", "NHD"])),
       storages=st.tuples(st.sampled_from(["split", "cross_layer"]), st.sampled_from(["split", "cross_layer"])),
       bs=st.sampled_from([(4, 4), (4, 8), (8, 2), (16, 4)]), tp=st.sampled_from([(1, 1), (1, 2), (2, 1), (4, 2)]),
       mode=st.sampled_from(["auto", "direct", "host-staged"]), partial=st.booleans(), data=st.data())
def test_fused_caches_convert_to_each_other(layouts, storages, bs, tp, mode, partial, data):
    """A local rank's blocks hold exactly the remote's K | V vectors of the heads they share, in its
    own layout; with ``num_tokens`` only those tokens, nothing past them; a WRITE along the plan too."""
    tokens = 2 * max(bs)
    ls = fused(layout=layouts[0], storage=storages[0], block_size=bs[0], num_blocks=tokens // bs[0] + 2,
               tp_size=tp[0]).with_rank(data.draw(st.integers(0, tp[0] - 1)))
    rs = fused(layout=layouts[1], storage=storages[1], block_size=bs[1], num_blocks=tokens // bs[1] + 1,
               tp_size=tp[1])
    rs = rs.with_rank(data.draw(st.sampled_from(peer_ranks(ls, tp[1]))))
    lview, larena = place_cache(ls, gap=24)
    rview, rarena = place_cache(rs, arena_base=0x4000_0000, gap=8)
    fill_pattern(lview, larena, seed=3)
    fill_pattern(rview, rarena, seed=4)
    num_tokens = data.draw(st.integers(1, tokens)) if partial else None
    moved = num_tokens or tokens
    lb = np.asarray(data.draw(st.permutations(range(ls.num_blocks)))[:-(-moved // bs[0])])
    rb = np.asarray(data.draw(st.permutations(range(rs.num_blocks)))[:-(-moved // bs[1])])
    before = logical_kv(lview, larena, lb).copy()
    plan = build_plan(lview, rview, mode=mode)
    req = plan.for_request(lb, rb, num_tokens=num_tokens) if partial else plan.for_request(lb, rb)
    check_tables(req)
    check_staged_map(plan, req)
    execute(plan, req, larena, rarena)
    h0, h1 = plan.heads
    lh = slice(h0 - ls.first_head, h1 - ls.first_head)
    want = logical_kv(rview, rarena, rb)[:, :, :moved, h0 - rs.first_head:h1 - rs.first_head]
    got = logical_kv(lview, larena, lb)
    assert np.array_equal(got[:, :, :moved, lh], want)
    untouched = before.copy()
    untouched[:, :, :moved, lh] = got[:, :, :moved, lh]
    assert np.array_equal(got, untouched), "bytes past the request's tokens or heads changed"
    if plan.reversible and not partial:
        fill_pattern(rview, rarena, seed=99)
        execute(plan, req, larena, rarena, Direction.WRITE)
        again = logical_kv(rview, rarena, rb)[:, :, :, h0 - rs.first_head:h1 - rs.first_head]
        assert np.array_equal(again, got[:, :, :, lh])


def test_hnd_to_nhd_converts_without_staging_on_pair_copies():
    """The pair copies (CUDA IPC, GPU staging, the host kernel) take a fused HND <-> NHD pair."""
    assert pair_copy_why(fused(), fused(layout="NHD")) is None
    assert pair_copy_why(fused(storage="cross_layer"), fused(layout="NHD", tp_size=2)) is None


@pytest.mark.parametrize("kw,match", [
    (dict(mla=True, num_kv_heads=1), "has a V: mla must be False"),
    (dict(storage="packed"), "storage must be 'split' or 'cross_layer'; got 'packed'"),
    (dict(storage="head_packed"), "storage must be 'split' or 'cross_layer'; got 'head_packed'"),
    (dict(k_dim_chunk=1), "k_dim_chunk must be 0; got 1"),
    (dict(head_dim=15), "must be even; got 15"),
    (dict(kv_fused="yes"), "kv_fused must be True or False; got 'yes'"),
])
def test_fused_spec_validation_names_the_value(kw, match):
    with pytest.raises(LayoutError, match=match):
        fused(**kw)


def test_a_fused_cache_does_not_plan_with_a_split_one():
    """Another kind of cache (separate K and V regions) is refused by name, not moved."""
    a = place_cache(fused(head_dim=16))[0]
    b = place_cache(fused(head_dim=16, kv_fused=False), arena_base=0x4000_0000)[0]
    for x, y in ((a, b), (b, a)):
        with pytest.raises(LayoutError, match="kv_fused differs"):
            build_plan(x, y)
        with pytest.raises(LayoutError, match="kv_fused differs"):
            direct_pairs(x.spec, x.geometry, [0], y.spec, y.geometry, [0])
