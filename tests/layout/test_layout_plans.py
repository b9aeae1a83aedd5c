"""Table-driven plan tests: exact descriptors and modes for the cases users meet, each executed over real buffers."""

from __future__ import annotations

import numpy as np
import pytest

from _layout_checks import assert_disjoint, check_staged_map, check_tables
from kvxfer.layout import KVSpec, build_plan, expected_notifications, notify_ranks, peer_ranks
from kvxfer.layout.oracle import execute, fill_pattern, logical_kv, place_cache, target_mask
from kvxfer.types import Direction


def spec(**kw) -> KVSpec:
    """A small Llama-like spec: 3 layers, 8 KV heads, head dim 16, fp16, block size 4."""
    base = dict(num_layers=3, num_kv_heads=8, head_dim=16, block_size=4, num_blocks=16,
                dtype="float16", model="tiny")
    base.update(kw)
    return KVSpec(**base)


def run(local_spec, remote_spec, lb, rb, direction=Direction.READ, gap=0, **kw):
    """Build, execute and byte-check a plan; return (plan, request)."""
    lview, larena = place_cache(local_spec, gap=gap)
    rview, rarena = place_cache(remote_spec, arena_base=0x4000_0000, gap=gap)
    fill_pattern(lview, larena, 1)
    fill_pattern(rview, rarena, 2)
    plan = build_plan(lview, rview, **kw)
    req = plan.for_request(lb, rb)
    check_tables(req)
    check_staged_map(plan, req)
    dst_view, dst, dst_ids, src_view, src, src_ids = (
        (lview, larena, lb, rview, rarena, rb) if direction is Direction.READ
        else (rview, rarena, rb, lview, larena, lb))
    before = dst.buf.copy()
    execute(plan, req, larena, rarena, direction)
    h0, h1 = plan.heads
    f, g = dst_view.spec.first_head, src_view.spec.first_head
    got = logical_kv(dst_view, dst, dst_ids)[:, :, :, h0 - f:h1 - f]
    assert np.array_equal(got, logical_kv(src_view, src, src_ids)[:, :, :, h0 - g:h1 - g])
    outside = ~target_mask(dst_view, dst, dst_ids, plan.heads)
    assert np.array_equal(dst.buf[outside], before[outside])
    return plan, req


L, K = 3, 2  # layers, kv regions per layer in ``spec``
BB = 8 * 4 * 16 * 2  # one block of one region with all 8 heads


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_homogeneous_tp_is_one_descriptor_per_region_per_run(tp):
    """Same TP, same layout, split storage: each run of consecutive ids is one descriptor per region."""
    s = spec(tp_size=tp, tp_rank=tp - 1)
    plan, req = run(s, s, [2, 3, 4, 9], [5, 6, 7, 1])
    assert plan.mode == "direct" and plan.pieces_per_block == 1
    assert plan.heads == (8 - 8 // tp, 8)
    assert req.local.shape[0] == L * K * 2
    assert sorted(set(req.local[:, 1].tolist())) == [BB // tp, 3 * BB // tp]
    assert_disjoint(req.local)


def test_tp8_to_tp8_every_rank_moves_its_own_head():
    """TP 8 -> TP 8 with 8 KV heads: rank r reads only rank r, one head, whole blocks."""
    for r in range(8):
        s = spec(tp_size=8, tp_rank=r)
        assert peer_ranks(s, 8) == [r] and notify_ranks(s, 8) == [r]
        assert expected_notifications(s, 8) == 1
        plan, req = run(s, s, [0, 5], [3, 4])
        assert plan.heads == (r, r + 1) and plan.mode == "direct"
        assert req.num_bytes == L * K * 2 * BB // 8


def test_hnd_prefill_to_nhd_decode_is_staged_whole_remote_blocks():
    """HND -> NHD cuts blocks into single vectors: staged, one remote descriptor per block run."""
    plan, req = run(spec(layout="NHD"), spec(layout="HND"), [7, 2, 3], [4, 5, 6])
    assert plan.mode == "host-staged" and not plan.over_read and plan.reversible
    assert req.staging_bytes == req.num_bytes == L * K * 3 * BB
    assert req.remote.shape[0] == L * K      # remote ids 4,5,6 are one run per region
    assert len(req.unpack_index()) == L * K
    direct = build_plan(*place_cache(spec(layout="NHD"))[:1], place_cache(spec(layout="HND"))[0],
                        min_direct_bytes=0)
    assert direct.mode == "direct" and direct.pieces_per_block == 8 * 4


def test_hnd_to_nhd_without_conversion_names_both_layouts():
    from kvxfer.errors import LayoutError
    local, remote = place_cache(spec(layout="NHD"))[0], place_cache(spec(layout="HND"))[0]
    with pytest.raises(LayoutError, match="NHD.*HND"):
        build_plan(local, remote, allow_conversion=False)


def test_cross_layer_blocks_are_one_descriptor_per_run():
    """Cross-layer on both sides: one descriptor per run of consecutive ids covering every layer."""
    s = spec(storage="cross_layer")
    plan, req = run(s, s, [4, 5, 6, 9], [10, 11, 12, 3])
    assert plan.group == L * K
    assert req.local[:, 1].tolist() == [3 * L * K * BB, L * K * BB]
    assert req.local[:, 0].tolist() == [0x10_0000 + 4 * L * K * BB, 0x10_0000 + 9 * L * K * BB]


def test_packed_joins_k_and_v():
    s = spec(storage="packed")
    plan, req = run(s, s, [1, 2, 8], [0, 1, 2])
    assert plan.group == K
    assert req.local.shape[0] == L * 2 and set(req.local[:, 1].tolist()) == {2 * K * BB, K * BB}


def test_split_to_cross_layer_is_direct_per_region():
    plan, req = run(spec(), spec(storage="cross_layer"), [1, 2], [5, 6], gap=40)
    assert plan.mode == "direct" and plan.group == 1
    assert req.local.shape[0] == L * K * 2 and set(req.local[:, 1].tolist()) == {BB}


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_decode_tp_above_prefill_tp_reads_head_slices(layout):
    """TP 1 -> TP 2: each decode rank reads its half of the heads from prefill rank 0."""
    for r in range(2):
        d = spec(layout=layout, tp_size=2, tp_rank=r)
        assert peer_ranks(d, 1) == [0]
        plan, req = run(d, spec(layout=layout), [3, 1], [0, 7])
        assert plan.heads == (4 * r, 4 * r + 4)
        if layout == "HND":      # a head slice of an HND block is contiguous
            assert plan.mode == "direct" and set(req.local[:, 1].tolist()) == {BB // 2}
        else:                    # NHD interleaves heads per token: over-read whole blocks
            assert plan.mode == "host-staged" and plan.over_read and not plan.reversible
    assert expected_notifications(spec(layout=layout), 2) == 2


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_prefill_tp_above_decode_tp_gathers_chunks(layout):
    """TP 2 -> TP 1: the decode rank reads half of its heads from each prefill rank."""
    d = spec(layout=layout)
    assert peer_ranks(d, 2) == [0, 1]
    heads = []
    for r in range(2):
        plan, _ = run(d, spec(layout=layout, tp_size=2, tp_rank=r), [3, 1], [0, 7], min_direct_bytes=0)
        heads.append(plan.heads)
        assert plan.mode == "direct"
    assert heads == [(0, 4), (4, 8)]
    assert expected_notifications(spec(tp_size=2, tp_rank=1), 1) == 1


def test_gqa_replicated_heads_read_once_all_replicas_notified():
    """2 KV heads on prefill TP 8 (4 replicas each) -> decode TP 1: read 2 ranks, notify all 8."""
    d = spec(num_kv_heads=2)
    reads = peer_ranks(d, 8)
    assert reads == [0, 4] and notify_ranks(d, 8) == list(range(8))
    for r in reads:
        plan, _ = run(d, spec(num_kv_heads=2, tp_size=8, tp_rank=r), [1], [2])
        assert plan.heads == (r // 4, r // 4 + 1)
    # decode TP 4 over 2 heads: replica index = consumer rank % 4, so the 4 consumers hit 4 ranks
    assert [peer_ranks(spec(num_kv_heads=2, tp_size=4, tp_rank=c), 8) for c in range(4)] == [[0], [1], [6], [7]]
    assert expected_notifications(spec(num_kv_heads=2, tp_size=8, tp_rank=5), 4) == 2


def test_mla_reads_one_rank_and_notifies_every_rank():
    mla = dict(num_kv_heads=1, mla=True, head_dim=32)
    for c in range(2):
        d = spec(tp_size=2, tp_rank=c, **mla)
        assert peer_ranks(d, 4) == [c] and notify_ranks(d, 4) == [0, 1, 2, 3]
        plan, req = run(d, spec(tp_size=4, tp_rank=c, storage="cross_layer", **mla), [2, 3], [0, 1])
        assert plan.mode == "direct" and plan.heads == (0, 1)
        assert req.num_bytes == L * 2 * 4 * 32 * 2
    assert expected_notifications(spec(tp_size=4, tp_rank=3, **mla), 2) == 2


@pytest.mark.parametrize("bs_local,bs_remote", [(4, 16), (16, 4)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_block_size_ratio(bs_local, bs_remote, layout):
    n_local, n_remote = 16 // bs_local * 2, 16 // bs_remote * 2
    lb = list(range(1, 1 + n_local))
    rb = list(range(n_remote))[::-1]
    plan, req = run(spec(block_size=bs_local, layout=layout), spec(block_size=bs_remote, layout=layout),
                    lb, rb, min_direct_bytes=0)
    assert req.num_bytes == L * K * 32 * 8 * 16 * 2
    if layout == "NHD":          # token-major blocks cut cleanly at the smaller block
        assert plan.pieces_per_block == max(1, bs_local // bs_remote)
    else:                        # head-major: one piece per head of the smaller block
        assert plan.pieces_per_block == 8 * max(1, bs_local // bs_remote)


def test_write_direction_uses_the_same_plan():
    """The producer's plan in reverse: WRITE pushes prefill TP 1 heads into decode TP 2 rank 1."""
    plan, req = run(spec(layout="HND"), spec(layout="HND", tp_size=2, tp_rank=1), [3, 4], [6, 0],
                    direction=Direction.WRITE)
    assert plan.heads == (4, 8) and plan.mode == "direct"
    plan, req = run(spec(layout="HND"), spec(layout="NHD"), [3, 4], [6, 0], direction=Direction.WRITE)
    assert plan.mode == "host-staged" and plan.reversible


def test_empty_request_moves_nothing():
    s = spec()
    lview, _ = place_cache(s)
    for mode in ("direct", "host-staged"):
        req = build_plan(lview, lview, mode=mode).for_request([], [])
        assert req.local.shape == (0, 3) and req.num_bytes == 0 and req.staging_bytes == 0


def test_staged_write_refused_when_plan_over_reads():
    """Over-read pieces would overwrite other heads on a WRITE: refused with a clear error."""
    from kvxfer.errors import LayoutError
    from kvxfer.layout.oracle import execute as run_plan
    pview, parena = place_cache(spec(layout="HND", tp_size=2, tp_rank=1))
    cview, carena = place_cache(spec(layout="NHD"), arena_base=0x4000_0000)
    plan = build_plan(pview, cview)   # prefill rank 1 pushes heads 4..7 into NHD blocks of 8 heads
    assert plan.mode == "host-staged" and plan.over_read and not plan.reversible
    req = plan.for_request([1, 2], [3, 4])
    with pytest.raises(LayoutError, match="staged WRITE not supported"):
        run_plan(plan, req, parena, carena, Direction.WRITE)


def test_real_addresses_of_numpy_buffers():
    """Plans over the real addresses of two numpy allocations, run with the reference copier."""
    from kvxfer.layout import CacheGeometry, CacheView
    from kvxfer.layout.oracle import Arena
    local_spec, remote_spec = spec(layout="NHD", storage="packed"), spec(layout="HND", tp_size=2, tp_rank=1)
    views = []
    for s, seed in ((local_spec, 5), (remote_spec, 6)):
        arena = Arena.wrap(np.zeros(s.cache_bytes, dtype=np.uint8))
        view = CacheView(s, CacheGeometry.contiguous(s, arena.base))
        fill_pattern(view, arena, seed)
        views.append((view, arena))
    (lview, larena), (rview, rarena) = views
    plan = build_plan(lview, rview)
    req = plan.for_request([9, 3], [0, 1])
    assert plan.mode == "host-staged" and req.remote[:, 0].min() >= rarena.base
    execute(plan, req, larena, rarena)
    got = logical_kv(lview, larena, [9, 3])[:, :, :, 4:8]
    assert np.array_equal(got, logical_kv(rview, rarena, [0, 1]))


def test_head_packed_same_heads_moves_whole_rows_one_descriptor_per_run_per_layer():
    """vLLM's CPU cache: a layer's block is one contiguous row; equal specs coalesce runs."""
    from kvxfer.layout.oracle import execute, fill_pattern, logical_kv, place_cache
    from kvxfer.types import Direction

    s = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
               dtype="float16", layout="HND", storage="head_packed", model="m")
    lv, la = place_cache(s, gap=64)
    rv, ra = place_cache(s, arena_base=0x4000_0000, gap=32)
    fill_pattern(lv, la, 1)
    fill_pattern(rv, ra, 2)
    plan = build_plan(lv, rv)
    req = plan.for_request([5, 6, 7, 0], [1, 2, 3, 9])
    assert plan.mode == "direct"
    assert req.local.shape[0] == 3 * 2  # per layer: the run 5,6,7<-1,2,3 and the single block 0<-9
    execute(plan, req, la, ra, Direction.READ)
    np.testing.assert_array_equal(logical_kv(lv, la, [5, 6, 7, 0]), logical_kv(rv, ra, [1, 2, 3, 9]))
