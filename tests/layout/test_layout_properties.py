"""Property tests: random spec pairs and block ids, plans executed over real buffers, checked byte by byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _layout_checks import assert_disjoint, block_mask, check_staged_map, check_tables, rows_mask
from kvxfer.errors import LayoutError
from kvxfer.layout import (
    KVSpec, build_plan, expected_notifications, head_range, notify_ranks, peer_ranks,
)
from kvxfer.layout.oracle import (
    execute, fill_pattern, fill_staging, logical_kv, place_cache, region_views, target_mask,
)
from kvxfer.types import Direction

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TP = st.sampled_from([1, 2, 4, 8])


def _k_dim_chunk(draw, head_dim: int, layout: str, mla: bool, force: bool) -> int:
    """0 (K token-major) or a chunk dividing head_dim (dim-major K; HND only, never MLA)."""
    chunks = [c for c in range(1, head_dim) if head_dim % c == 0]
    if layout != "HND" or mla or not chunks or not (force or draw(st.integers(0, 3)) == 0):
        return 0
    return draw(st.sampled_from(chunks))


@st.composite
def spec_pair(draw, head_slicing_nhd: bool = False, dim_major: bool = False):
    """A (local spec, remote spec, tokens) draw. ``head_slicing_nhd``: the remote is NHD and holds
    more heads than the local rank needs (the case staged plans over-read). Either side may keep
    K dim-major (``k_dim_chunk``); ``dim_major``: at least one side does."""
    mla = not (head_slicing_nhd or dim_major) and draw(st.integers(0, 4)) == 0
    heads = 1 if mla else draw(st.sampled_from([2, 4, 8] if head_slicing_nhd else [1, 2, 4, 8]))
    dtype, head_dim = draw(st.sampled_from([("float16", 2), ("bfloat16", 4), ("float32", 1), ("uint8", 4),
                                            ("float16", 8)]))
    if dim_major and head_dim == 1:
        dtype, head_dim = "float32", 4
    bs_l = draw(st.sampled_from([1, 2, 4, 8]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    bs_r = bs_l * ratio if draw(st.booleans()) or bs_l % ratio else bs_l // ratio
    storages = ["split", "cross_layer"] + ([] if mla else ["packed"])
    layers = draw(st.integers(1, 3))
    unit = max(bs_l, bs_r)
    units = draw(st.integers(1 if head_slicing_nhd else 0, 5))
    common = dict(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype, mla=mla, model="m")

    def one(bs, tp, layouts=("NHD", "HND"), force_dim_major=False):
        need = units * unit // bs
        layout = draw(st.sampled_from(layouts))
        choices = storages + (["head_packed"] if layout == "HND" and not mla else [])
        return KVSpec(block_size=bs, num_blocks=need + draw(st.integers(1, 4)), tp_size=tp,
                      layout=layout, storage=draw(st.sampled_from(choices)),
                      k_dim_chunk=_k_dim_chunk(draw, head_dim, layout, mla, force_dim_major), **common)

    forced = draw(st.sampled_from(["local", "remote"])) if dim_major else ""
    if head_slicing_nhd:
        tp_r = draw(st.sampled_from([t for t in (1, 2, 4) if t < heads]))
        tp_l = draw(st.sampled_from([t for t in (2, 4, 8) if t > tp_r]))
        remote = one(bs_r, tp_r, ("NHD",))
    else:
        tp_l, tp_r = draw(TP), draw(TP)
        remote = one(bs_r, tp_r, ("HND",) if forced == "remote" else ("NHD", "HND"), forced == "remote")
    local = one(bs_l, tp_l, ("HND",) if forced == "local" else ("NHD", "HND"),
                forced == "local").with_rank(draw(st.integers(0, tp_l - 1)))
    return local, remote, units * unit


@st.composite
def block_ids(draw, num_blocks: int, count: int):
    """Distinct ids: consecutive, sorted random or random order."""
    style = draw(st.sampled_from(["run", "sorted", "random"]))
    if style == "run":
        start = draw(st.integers(0, num_blocks - count))
        return np.arange(start, start + count)
    ids = draw(st.permutations(range(num_blocks)))[:count]
    return np.array(sorted(ids) if style == "sorted" else ids, dtype=np.int64)


PLAN_KNOBS = st.sampled_from([("auto", 4096), ("auto", 0), ("auto", 1 << 30), ("direct", 0), ("staged", 0),
                              ("staged", 1 << 30)])


@SETTINGS
@given(data=st.data(), pair=st.one_of(spec_pair(), spec_pair(head_slicing_nhd=True), spec_pair(dim_major=True)),
       knobs=PLAN_KNOBS, gap=st.sampled_from([0, 24]))
def test_read_gathers_exact_logical_kv(data, pair, knobs, gap):
    """A local rank reads from every rank ``peer_ranks`` names; afterwards its target blocks hold
    exactly the remote tokens' KV for all its heads and no other local byte changed."""
    local_spec, remote_spec, tokens = pair
    mode, min_direct = knobs
    lview, larena = place_cache(local_spec, gap=gap)
    fill_pattern(lview, larena, seed=1)
    before = larena.buf.copy()
    lb = data.draw(block_ids(local_spec.num_blocks, tokens // local_spec.block_size))
    rb = data.draw(block_ids(remote_spec.num_blocks, tokens // remote_spec.block_size))
    expected = logical_kv(lview, larena, lb)
    allowed = np.zeros(larena.buf.size, dtype=bool)
    covered = []
    for rank in peer_ranks(local_spec, remote_spec.tp_size):
        rview, rarena = place_cache(remote_spec.with_rank(rank), arena_base=0x4000_0000, gap=gap)
        fill_pattern(rview, rarena, seed=2 + rank)
        plan = build_plan(lview, rview, mode=mode, min_direct_bytes=min_direct)
        req = plan.for_request(lb, rb)
        event(f"read {plan.mode} over_read={plan.over_read} group={plan.group > 1} rows={req.local.shape[0] > 0} "
              f"dim_major_k={local_spec.k_dim_major or remote_spec.k_dim_major}")
        check_tables(req)
        check_staged_map(plan, req)
        assert_disjoint(req.local)
        # the remote side is only read inside the request's remote blocks
        assert not (rows_mask(req.remote, rarena) & ~block_mask(rview, rarena, rb)).any()
        if plan.mode == "direct":
            assert not (rows_mask(req.local, larena) & ~target_mask(lview, larena, lb, plan.heads)).any()
        else:   # the producer-side pack builds the very staging image the descriptors fill
            packed = np.zeros(req.staging_bytes, dtype=np.uint8)
            req.pack_source_numpy(packed, region_views(rview, rarena))
            assert np.array_equal(packed, fill_staging(req, rarena))
        execute(plan, req, larena, rarena)
        h0, h1 = plan.heads
        src = logical_kv(rview, rarena, rb)
        f, g = local_spec.first_head, rview.spec.first_head
        expected[:, :, :, h0 - f:h1 - f] = src[:, :, :, h0 - g:h1 - g]
        allowed |= target_mask(lview, larena, lb, plan.heads)
        covered.append(plan.heads)
    need = head_range(local_spec.num_kv_heads, local_spec.tp_size, local_spec.tp_rank, local_spec.mla)
    covered.sort()
    assert covered[0][0] == need[0] and covered[-1][1] == need[1]
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered
    assert np.array_equal(logical_kv(lview, larena, lb), expected)
    assert np.array_equal(larena.buf[~allowed], before[~allowed])


@SETTINGS
@given(data=st.data(), pair=st.one_of(spec_pair(), spec_pair(head_slicing_nhd=True), spec_pair(dim_major=True)),
       knobs=PLAN_KNOBS)
def test_write_pushes_exact_logical_kv(data, pair, knobs):
    """The producer's plan used in reverse (WRITE) puts its heads into the consumer's blocks."""
    consumer_spec, producer_spec, tokens = pair
    mode, min_direct = knobs
    rank = data.draw(st.sampled_from(peer_ranks(consumer_spec, producer_spec.tp_size)))
    pview, parena = place_cache(producer_spec.with_rank(rank))
    cview, carena = place_cache(consumer_spec, arena_base=0x4000_0000, gap=16)
    fill_pattern(pview, parena, seed=3)
    fill_pattern(cview, carena, seed=4)
    before = carena.buf.copy()
    pb = data.draw(block_ids(producer_spec.num_blocks, tokens // producer_spec.block_size))
    cb = data.draw(block_ids(consumer_spec.num_blocks, tokens // consumer_spec.block_size))
    plan = build_plan(pview, cview, mode=mode, min_direct_bytes=min_direct)
    req = plan.for_request(pb, cb)
    event(f"write {plan.mode} reversible={plan.reversible}")
    check_tables(req)
    assert_disjoint(req.remote)
    if not plan.reversible:
        with pytest.raises(LayoutError, match="not supported"):
            execute(plan, req, parena, carena, Direction.WRITE)
        return
    execute(plan, req, parena, carena, Direction.WRITE)
    h0, h1 = plan.heads
    got = logical_kv(cview, carena, cb)
    want = logical_kv(pview, parena, pb)
    f, g = cview.spec.first_head, pview.spec.first_head
    assert np.array_equal(got[:, :, :, h0 - f:h1 - f], want[:, :, :, h0 - g:h1 - g])
    outside = ~target_mask(cview, carena, cb, plan.heads)
    assert np.array_equal(carena.buf[outside], before[outside])


@settings(max_examples=200, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8, 16]), tp_p=TP, tp_c=TP, mla=st.booleans())
def test_notifications_match_dependencies(heads, tp_p, tp_c, mla):
    """Every producer expects exactly as many notices as consumers list it in ``notify_ranks``;
    each consumer reads disjoint head ranges covering what it needs, one rank per range."""
    heads = 1 if mla else heads
    consumers = [KVSpec(1, heads, 8, 4, 4, tp_size=tp_c, tp_rank=c, mla=mla) for c in range(tp_c)]
    for c in consumers:
        reads, deps = peer_ranks(c, tp_p), notify_ranks(c, tp_p)
        assert set(reads) <= set(deps)
        ranges = sorted(head_range(heads, tp_p, r, mla) for r in reads)
        need = head_range(heads, tp_c, c.tp_rank, mla)
        lo, hi = max(ranges[0][0], need[0]), min(ranges[-1][1], need[1])
        assert (lo, hi) == need
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    for p in range(tp_p):
        producer = KVSpec(1, heads, 8, 4, 4, tp_size=tp_p, tp_rank=p, mla=mla)
        listed = sum(p in notify_ranks(c, tp_p) for c in consumers)
        assert expected_notifications(producer, tp_c) == listed >= 1
