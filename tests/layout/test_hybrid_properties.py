"""Property tests for several KV-cache groups: random hybrid caches (full and sliding attention, SSM state) at TP
1/2/4 both ways, every group's plan executed over real byte buffers and checked against the oracle."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _layout_checks import assert_disjoint, check_tables, rows_mask
from kvxfer.layout import KVSpec, build_plan, head_range
from kvxfer.layout.groups import AttentionGroup, HybridSpec, StateGroup
from kvxfer.layout.hybrid import (
    build_hybrid_plan, hybrid_expected_notifications, hybrid_notify_ranks, hybrid_peer_ranks,
)
from kvxfer.layout.oracle import (
    execute_hybrid, logical_kv, place_cache, place_hybrid, read_state, state_mask, target_mask, write_state,
)
from kvxfer.layout.ssm import gdn_state, mamba1_state, mamba2_state
from kvxfer.layout.state import StateSpec, StateTensor
from kvxfer.types import Direction

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TP = st.sampled_from([1, 2, 4])


@st.composite
def state_tensors(draw, same_tp: bool):
    """A Mamba1, Mamba2 or Gated DeltaNet layer's conv and SSM state (``kvxfer.layout.ssm``, vLLM's shapes; DS or SD
    conv order, speculative rows or not); sometimes an opaque tensor beside them (equal TP only)."""
    kw = dict(conv_dtype=draw(st.sampled_from(["float16", "float32", "uint8"])), ssm_dtype="float32",
              order=draw(st.sampled_from(["DS", "SD"])), num_spec=draw(st.integers(0, 1)))
    small, kernel = st.sampled_from([1, 2, 3]), draw(st.sampled_from([2, 3]))
    kind = draw(st.sampled_from(["mamba1", "mamba2", "gdn"]))
    if kind == "mamba1":
        tensors = mamba1_state(draw(st.sampled_from([4, 8])), draw(small), kernel, **kw)
    elif kind == "mamba2":
        tensors = mamba2_state(draw(st.sampled_from([1, 2, 4, 8])), draw(small), draw(st.sampled_from([1, 2, 4])),
                               draw(small), kernel, **kw)
    else:
        tensors = gdn_state(draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([2, 4, 8])), draw(small),
                            draw(small), kernel, **kw)
    if same_tp and draw(st.integers(0, 3)) == 0:
        tensors += (StateTensor.opaque("extra", "uint8", draw(st.integers(1, 5))),)
    return tuple(tensors)


@st.composite
def hybrid_pair(draw, share: bool = False):
    """(local HybridSpec at some rank, remote HybridSpec at rank 0, tokens). ``share``: every attention
    group of a side has one spec, so ``place_hybrid(share=True)`` gives them one memory (vLLM's shared
    tensors) and their block ids must be disjoint."""
    tp_l, tp_r = draw(TP), draw(TP)
    layers = draw(st.integers(1, 2))
    common = dict(num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])), model="m",
                  head_dim=draw(st.sampled_from([1, 2, 4])), dtype=draw(st.sampled_from(["float16", "float32"])))
    units = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["full", "sliding", "state"]), min_size=1, max_size=4))
    kinds += ["sliding"] if kinds == ["full"] else []   # one full group alone is today's cache
    local, remote, first = [], [], {}
    for i, kind in enumerate(kinds):
        if kind == "state":
            tensors = draw(state_tensors(tp_l == tp_r))
            page = draw(st.booleans())
            for side, tp in ((local, tp_l), (remote, tp_r)):
                probe = StateSpec(layers, tensors, 1, tp_size=tp, model="m")
                stride = sum(probe.tensor_bytes) + draw(st.integers(0, 8)) if page else 0
                side.append(StateGroup(StateSpec(layers, tensors, draw(st.integers(3, 6)), slot_stride=stride,
                                                 tp_size=tp, model="m"), name=f"g{i}"))
            continue
        bs_l = draw(st.sampled_from([1, 2, 4]))
        ratio = draw(st.sampled_from([1, 2]))
        bs_r = bs_l * ratio if draw(st.booleans()) or bs_l % ratio else bs_l // ratio
        unit = max(bs_l, bs_r)
        window = draw(st.integers(1, 3 * unit)) if kind == "sliding" else 0
        for key, side, tp, bs in (("l", local, tp_l, bs_l), ("r", remote, tp_r, bs_r)):
            if share and key in first:
                spec = first[key]
            else:
                layout = draw(st.sampled_from(["NHD", "HND"]))
                storage = draw(st.sampled_from(["split", "packed", "cross_layer"] +
                                               (["head_packed"] if layout == "HND" else [])))
                spec = KVSpec(num_layers=layers, block_size=bs, tp_size=tp, layout=layout, storage=storage,
                              num_blocks=units * 8 // bs * (4 if share else 1) + draw(st.integers(1, 3)), **common)
                first[key] = spec
            side.append(AttentionGroup(spec, sliding_window=window, name=f"g{i}"))
    unit_max = max([g.spec.block_size for g in local + remote if isinstance(g, AttentionGroup)], default=1)
    tokens = draw(st.integers(max(1, (units - 1) * unit_max + 1), units * unit_max))
    rank = draw(st.integers(0, tp_l - 1))
    return HybridSpec(tuple(local)).with_rank(rank), HybridSpec(tuple(remote)), tokens


def _ids(draw, spec: HybridSpec, tokens: int, other: HybridSpec, n_slots: int, share: bool):
    """One id list per group: attention blocks from token 0 to the last unit; ``n_slots`` state slots.
    ``share``: groups of one spec draw from one pool, so ids are disjoint where they share memory."""
    out, pools = [], {}
    for i, (g, o) in enumerate(zip(spec.groups, other.groups)):
        if isinstance(g, AttentionGroup):
            unit = max(g.spec.block_size, o.spec.block_size)
            count = -(-tokens // unit) * unit // g.spec.block_size
            key = g.spec if share else i
            if key not in pools:
                pools[key] = list(draw(st.permutations(range(g.spec.num_blocks))))
            pool = pools[key]
            out.append(np.array(pool[:count], dtype=np.int64))
            del pool[:count]
        else:
            out.append(np.array(draw(st.permutations(range(g.spec.num_slots)))[:n_slots], dtype=np.int64))
    return out


def _window(g: AttentionGroup, o: AttentionGroup, tokens: int) -> tuple[int, int]:
    """Token range a group moves, from the definition: the window (or everything), in whole units."""
    unit = max(g.spec.block_size, o.spec.block_size)
    stop = -(-tokens // unit) * unit
    start = max(0, tokens - g.sliding_window + 1) // unit * unit if g.sliding_window else 0
    return start, stop


def _global_state(rng, spec: StateSpec, n_slots: int):
    """Random global state of the request's slots: ``[tensor][segment]`` ``[layers, slots, outer, units, unit_bytes]``."""
    out = []
    for t in spec.tensors:
        if t.segments is None:
            out.append([rng.integers(0, 256, (spec.num_layers, n_slots, 1, 1, t.slot_bytes(spec.tp_size)), dtype=np.uint8)])
        else:
            out.append([rng.integers(0, 256, (spec.num_layers, n_slots, t.outer, u, w * t.inner * t.itemsize),
                                     dtype=np.uint8) for u, w in t.segments])
    return out


def _run(data, pair, direction: Direction, gap: int, share: bool = False):
    """Consumer ``local`` gets every group from every producer rank it reads (READ), or every producer
    rank pushes to it (WRITE, direct plans); returns nothing, asserts the bytes."""
    cons, prod0, tokens = pair
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cview, carena = place_hybrid(cons, gap=gap, share=share)
    carena.buf[:] = rng.integers(0, 256, carena.buf.size, dtype=np.uint8)
    before = carena.buf.copy()
    n_slots = data.draw(st.integers(1, 2))
    cids = _ids(data.draw, cons, tokens, prod0, n_slots, share)
    pids = _ids(data.draw, prod0, tokens, cons, n_slots, share)
    # the state every producer rank holds: one global value per request slot, cut by each rank's units
    glob = {i: _global_state(rng, g.spec, len(cids[i])) for i, g in enumerate(prod0.groups) if isinstance(g, StateGroup)}
    allowed = np.zeros(carena.buf.size, dtype=bool)
    expected_kv, covered, state_bytes = {}, {}, {}
    for i, g in enumerate(cons.groups):
        if isinstance(g, AttentionGroup):
            expected_kv[i] = logical_kv(cview.views[i], carena, cids[i])
        else:
            allowed |= state_mask(cview.views[i], carena, cids[i])
    opaque_from_rank = {}
    for rank in hybrid_peer_ranks(cons, prod0.tp_size):
        pspec = prod0.with_rank(rank)
        pview, parena = place_hybrid(pspec, arena_base=0x4000_0000, gap=gap, share=share)
        parena.buf[:] = rng.integers(0, 256, parena.buf.size, dtype=np.uint8)
        for i, values in glob.items():
            pvals = [[v if t.segments is not None else rng.integers(0, 256, v.shape, dtype=np.uint8) for v in vs]
                     for t, vs in zip(pspec.groups[i].spec.tensors, values)]
            write_state(pview.views[i], parena, pids[i], pvals)
            opaque_from_rank[(i, rank)] = pvals
        if direction is Direction.READ:
            plan = build_hybrid_plan(cview, pview)
            req = plan.for_request(cids, pids, num_tokens=tokens)
        else:
            plan = build_hybrid_plan(pview, cview, local_is_consumer=False, mode="direct")
            req = plan.for_request(pids, cids, num_tokens=tokens)
        event(f"{direction.value} tp {prod0.tp_size}->{cons.tp_size} parts={sum(p is not None for p in req.parts)}/"
              f"{len(req.parts)} kinds={sorted({g.kind.value for g in cons.groups})}")
        before_read = parena.buf.copy()
        for i, (part_plan, part) in enumerate(zip(plan.parts, req.parts)):
            if part is None:
                continue
            check_tables(part)
            g = cons.groups[i]
            dest = part.local if direction is Direction.READ else part.remote
            if part.mode == "direct":
                assert_disjoint(dest)
            if isinstance(g, StateGroup):
                state_bytes[i] = state_bytes.get(i, 0) + part.num_bytes
                assert not (rows_mask(dest, carena) & ~state_mask(cview.views[i], carena, cids[i])).any()
                continue
            ps, cs = pview.views[i].spec, cview.views[i].spec
            h0, h1 = part_plan.heads
            start, stop = _window(g, prod0.groups[i], tokens)
            cb = cids[i][start // cs.block_size: stop // cs.block_size]
            pb = pids[i][start // ps.block_size: stop // ps.block_size]
            src = logical_kv(pview.views[i], parena, pb)
            f, p0 = cs.first_head, ps.first_head
            expected_kv[i][:, :, start:stop, h0 - f:h1 - f] = src[:, :, :, h0 - p0:h1 - p0]
            allowed |= target_mask(cview.views[i], carena, cb, (h0, h1))
            covered.setdefault(i, []).append((h0, h1))
        execute_hybrid(plan, req, carena if direction is Direction.READ else parena,
                       parena if direction is Direction.READ else carena, direction)
        assert np.array_equal(parena.buf, before_read)   # the producer's cache is only read
    for i, g in enumerate(cons.groups):
        if isinstance(g, AttentionGroup):
            assert np.array_equal(logical_kv(cview.views[i], carena, cids[i]), expected_kv[i])
            need = head_range(g.spec.num_kv_heads, g.spec.tp_size, g.spec.tp_rank)
            heads = sorted(covered[i])
            assert heads[0][0] == need[0] and heads[-1][1] == need[1]
            assert all(a[1] == b[0] for a, b in zip(heads, heads[1:])), heads
            continue
        got, spec = read_state(cview.views[i], carena, cids[i]), g.spec
        for t, tensor in enumerate(spec.tensors):
            if tensor.segments is None:   # equal TP: rank r's own bytes
                assert np.array_equal(got[t][0], opaque_from_rank[(i, spec.tp_rank)][t][0])
                continue
            for k, (u0, u1) in enumerate(tensor.local_units(spec.tp_size, spec.tp_rank)):
                assert np.array_equal(got[t][k], glob[i][t][k][:, :, :, u0:u1])
        # every byte of the slots moved exactly once (a replicated segment is read from one replica)
        assert state_bytes[i] == len(cids[i]) * spec.num_layers * sum(spec.tensor_bytes)
    assert np.array_equal(carena.buf[~allowed], before[~allowed])


@SETTINGS
@given(data=st.data(), pair=hybrid_pair(), gap=st.sampled_from([0, 8]))
def test_hybrid_read_moves_every_group_exactly(data, pair, gap):
    """A consumer rank reads every group from ``hybrid_peer_ranks``: each attention group's blocks (a sliding
    group's window only) hold the producer's KV for every needed head, each state slot the global state of its
    units, and no other byte changed."""
    _run(data, pair, Direction.READ, gap)


@settings(SETTINGS, max_examples=80)
@given(data=st.data(), pair=hybrid_pair(share=True), direction=st.sampled_from([Direction.READ, Direction.WRITE]))
def test_groups_sharing_memory_move_only_their_own_blocks(data, pair, direction):
    """Attention groups of one shape share one memory (as vLLM's groups share tensors), their ids kept apart:
    moving every group writes each group's blocks and leaves the others' bytes as they were."""
    _run(data, pair, direction, 0, share=True)


@SETTINGS
@given(data=st.data(), pair=hybrid_pair())
def test_hybrid_write_pushes_every_group_exactly(data, pair):
    """The producers' plans used as WRITEs (direct, as ``Agent.write`` plans) give the consumer the same cache."""
    _run(data, pair, Direction.WRITE, 0)


@settings(max_examples=100, deadline=None)
@given(pair=hybrid_pair())
def test_hybrid_notifications_match_dependencies(pair):
    """Each producer rank expects as many notices as consumer ranks list it; reads are a subset of notices."""
    cons, prod, _ = pair
    consumers = [cons.with_rank(c) for c in range(cons.tp_size)]
    for c in consumers:
        assert set(hybrid_peer_ranks(c, prod.tp_size)) <= set(hybrid_notify_ranks(c, prod.tp_size))
    for p in range(prod.tp_size):
        listed = sum(p in hybrid_notify_ranks(c, prod.tp_size) for c in consumers)
        assert hybrid_expected_notifications(prod.with_rank(p), cons.tp_size) == listed >= 1


@settings(max_examples=100, deadline=None)
@given(data=st.data(), tp_l=TP, tp_r=TP, layout=st.sampled_from(["NHD", "HND"]),
       storage=st.sampled_from(["split", "packed", "cross_layer"]))
def test_single_group_plans_exactly_as_build_plan(data, tp_l, tp_r, layout, storage):
    """``HybridSpec.single`` is today's cache: the same peers and, row for row, the same descriptors."""
    heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    local = KVSpec(2, heads, 4, 2, 6, tp_size=tp_l, tp_rank=data.draw(st.integers(0, tp_l - 1)), layout=layout,
                   storage=storage, model="m")
    remote = KVSpec(2, heads, 4, 2, 6, tp_size=tp_r, layout=data.draw(st.sampled_from(["NHD", "HND"])), model="m")
    hl = HybridSpec.single(local)
    from kvxfer.layout import peer_ranks
    assert hybrid_peer_ranks(hl, tp_r) == peer_ranks(local, tp_r)
    lb = np.array(data.draw(st.permutations(range(6)))[:3])
    rb = np.array(data.draw(st.permutations(range(6)))[:3])
    lview, _ = place_cache(local)
    hview, _ = place_hybrid(hl)
    for r in peer_ranks(local, tp_r):
        rview, _ = place_cache(remote.with_rank(r), arena_base=0x4000_0000)
        hr, _ = place_hybrid(HybridSpec.single(remote.with_rank(r)), arena_base=0x4000_0000)
        want = build_plan(lview, rview).for_request(lb, rb)
        got = build_hybrid_plan(hview, hr).for_request([lb], [rb]).parts[0]
        assert np.array_equal(got.local, want.local) and np.array_equal(got.remote, want.remote)
        assert got.mode == want.mode and got.num_bytes == want.num_bytes
