"""Reads of ``num_tokens`` tokens whose last blocks are partial (issue 37): random block sizes on both
sides, TP 1/2 both ways, NHD/HND, every storage and plan mode; checked byte by byte with the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _layout_checks import assert_disjoint, block_mask, check_staged_map, check_tables, rows_mask
from kvxfer.errors import BlockIdError
from kvxfer.layout import KVSpec, build_plan, peer_ranks
from kvxfer.layout.oracle import (
    byte_addresses, execute, fill_pattern, fill_staging, logical_kv, place_cache, region_views,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_KNOBS = st.sampled_from([("auto", 4096), ("auto", 0), ("direct", 0), ("staged", 0), ("staged", 1 << 30)])


def _blocks(tokens: int, size: int) -> int:
    return -(-tokens // size)


@st.composite
def partial_pair(draw):
    """(local spec, remote spec, num_tokens): block sizes multiples of one another in either
    direction, any number of tokens (zero, under one block, several units and a partial one)."""
    heads = draw(st.sampled_from([2, 4]))
    dtype, head_dim = draw(st.sampled_from([("float16", 2), ("float32", 1), ("uint8", 4)]))
    bs_l = draw(st.sampled_from([1, 2, 4, 8, 16]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    bs_r = bs_l * ratio if draw(st.booleans()) or bs_l % ratio else bs_l // ratio
    num_tokens = draw(st.integers(0, 3 * max(bs_l, bs_r) + 1))
    k_dim = draw(st.sampled_from([0, 0, 0, 1]))
    common = dict(num_layers=draw(st.integers(1, 2)), num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                  model="m")

    def one(bs, tp):
        layout = draw(st.sampled_from(["NHD", "HND"]))
        storage = draw(st.sampled_from(["split", "packed", "cross_layer"] + (["head_packed"] if layout == "HND"
                                                                             else [])))
        chunk = k_dim if layout == "HND" and head_dim > 1 and storage != "head_packed" else 0
        return KVSpec(block_size=bs, num_blocks=_blocks(num_tokens, bs) + draw(st.integers(1, 3)), tp_size=tp,
                      layout=layout, storage=storage, k_dim_chunk=chunk, **common)

    tp_l, tp_r = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    remote = one(bs_r, tp_r)
    local = one(bs_l, tp_l).with_rank(draw(st.integers(0, tp_l - 1)))
    return local, remote, num_tokens


def _ids(draw, num_blocks: int, count: int) -> np.ndarray:
    return np.array(draw(st.permutations(range(num_blocks)))[:count], dtype=np.int64)


def _token_mask(view, arena, ids, heads, tokens: int) -> np.ndarray:
    """Bytes of ``heads`` of the first ``tokens`` tokens of ``ids`` (what a partial read may write)."""
    s = view.spec
    mask = np.zeros(arena.buf.size, dtype=bool)
    h = slice(heads[0] - s.first_head, heads[1] - s.first_head)
    for layer in range(s.num_layers):
        for kv in range(s.kv_count):
            mask[byte_addresses(view, layer, kv, ids)[:tokens, h] - arena.base] = True
    return mask


@SETTINGS
@given(data=st.data(), pair=partial_pair(), knobs=PLAN_KNOBS)
def test_partial_read_moves_exactly_the_first_tokens(data, pair, knobs):
    """After reading ``num_tokens`` tokens from every producer rank it needs, the consumer's
    blocks hold exactly the producer's first ``num_tokens`` tokens for its heads, and no other
    byte changed: in particular none past token ``num_tokens`` in its last, partial block."""
    local_spec, remote_spec, n = pair
    mode, min_direct = knobs
    lview, larena = place_cache(local_spec, gap=8)
    fill_pattern(lview, larena, seed=1)
    before = larena.buf.copy()
    lb = _ids(data.draw, local_spec.num_blocks, _blocks(n, local_spec.block_size))
    rb = _ids(data.draw, remote_spec.num_blocks, _blocks(n, remote_spec.block_size))
    expected = logical_kv(lview, larena, lb)
    allowed = np.zeros(larena.buf.size, dtype=bool)
    for rank in peer_ranks(local_spec, remote_spec.tp_size):
        rview, rarena = place_cache(remote_spec.with_rank(rank), arena_base=0x4000_0000, gap=8)
        fill_pattern(rview, rarena, seed=2 + rank)
        plan = build_plan(lview, rview, mode=mode, min_direct_bytes=min_direct)
        req = plan.for_request(lb, rb, num_tokens=n)
        event(f"{plan.mode} whole={n % max(local_spec.block_size, remote_spec.block_size) == 0}")
        check_tables(req)
        check_staged_map(plan, req)
        assert_disjoint(req.local)
        assert not (rows_mask(req.remote, rarena) & ~block_mask(rview, rarena, rb)).any()
        execute(plan, req, larena, rarena)
        h0, h1 = plan.heads
        src = logical_kv(rview, rarena, rb)
        f, g = local_spec.first_head, rview.spec.first_head
        expected[:, :, :n, h0 - f:h1 - f] = src[:, :, :n, h0 - g:h1 - g]
        allowed |= _token_mask(lview, larena, lb, plan.heads, n)
    assert np.array_equal(logical_kv(lview, larena, lb), expected)
    assert np.array_equal(larena.buf[~allowed], before[~allowed])


@settings(max_examples=100, deadline=None)
@given(pair=partial_pair(), extra=st.sampled_from(["more_tokens", "negative", "long_local", "long_remote",
                                                     "short_local", "short_remote"]))
def test_bad_num_tokens_is_a_typed_error(pair, extra):
    """A token count the lists cannot hold, a negative one, or a list more than one partial block
    longer than needed: BlockIdError naming both values."""
    local_spec, remote_spec, n = pair
    lview, _ = place_cache(local_spec)
    rview, _ = place_cache(remote_spec.with_rank(peer_ranks(local_spec, remote_spec.tp_size)[0]))
    plan = build_plan(lview, rview)
    nl, nr = _blocks(n, local_spec.block_size), _blocks(n, remote_spec.block_size)
    if extra == "more_tokens":
        bad, ln, rn, match = n + max(local_spec.block_size, remote_spec.block_size), nl, nr, "is more than"
    elif extra == "negative":
        bad, ln, rn, match = -1, nl, nr, "non-negative"
    elif extra in ("long_local", "long_remote"):
        bad, match = n, "more than num_tokens"
        ln, rn = (nl + 1, nr) if extra == "long_local" else (nl, nr + 1)
    else:
        if (nl if extra == "short_local" else nr) == 0:
            return
        bad, match = n, "is more than"
        ln, rn = (nl - 1, nr) if extra == "short_local" else (nl, nr - 1)
    local_ids = np.arange(min(ln, local_spec.num_blocks))
    remote_ids = np.arange(min(rn, rview.spec.num_blocks))
    if local_ids.size != ln or remote_ids.size != rn:
        return  # the cache is too small for the bad list itself (an id error, tested elsewhere)
    with pytest.raises(BlockIdError, match=match) as err:
        plan.for_request(local_ids, remote_ids, num_tokens=bad)
    assert str(bad) in str(err.value)


def test_without_num_tokens_the_lists_must_cover_the_same_tokens():
    """Today's rule is unchanged when ``num_tokens`` is not given."""
    spec = dict(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float16", model="m")
    lview, _ = place_cache(KVSpec(block_size=8, num_blocks=4, **spec))
    rview, _ = place_cache(KVSpec(block_size=2, num_blocks=8, **spec))
    plan = build_plan(lview, rview)
    with pytest.raises(BlockIdError, match="local 1 blocks x 8 = 8 tokens, remote 3 blocks x 2 = 6 tokens"):
        plan.for_request([0], [0, 1, 2])
    assert plan.for_request([0], [0, 1, 2], num_tokens=5).num_bytes == 5 * 2 * 2 * 4 * 2


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bs=st.sampled_from([2, 4, 8]), tp=st.sampled_from([1, 2]), mode=st.sampled_from(["auto", "direct"]))
def test_partial_read_between_head_packed_caches(data, bs, tp, mode):
    """Two head_packed caches of one block size move whole rows (planned as ``packed``); their
    partial last block is planned on the memory as it is."""
    n = data.draw(st.integers(1, 3 * bs))
    spec = dict(num_layers=2, num_kv_heads=4, head_dim=2, dtype="float16", model="m", layout="HND",
                storage="head_packed", tp_size=tp)
    blocks = _blocks(n, bs)
    lspec = KVSpec(block_size=bs, num_blocks=blocks + 2, **spec)
    lview, larena = place_cache(lspec)
    rview, rarena = place_cache(lspec, arena_base=0x4000_0000)
    fill_pattern(lview, larena, seed=1)
    fill_pattern(rview, rarena, seed=2)
    before = larena.buf.copy()
    lb = _ids(data.draw, lspec.num_blocks, blocks)
    rb = _ids(data.draw, lspec.num_blocks, blocks)
    plan = build_plan(lview, rview, mode=mode)
    req = plan.for_request(lb, rb, num_tokens=n)
    check_tables(req)
    execute(plan, req, larena, rarena)
    got, want = logical_kv(lview, larena, lb), logical_kv(rview, rarena, rb)
    assert np.array_equal(got[:, :, :n], want[:, :, :n])
    allowed = _token_mask(lview, larena, lb, plan.heads, n)
    assert np.array_equal(larena.buf[~allowed], before[~allowed])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), bs_l=st.sampled_from([2, 4, 8]), ratio=st.sampled_from([1, 2, 4]), up=st.booleans())
def test_a_partial_read_cut_into_staging_chunks_moves_the_same_bytes(data, bs_l, ratio, up):
    """``chunk_request`` (host staging smaller than the request) cuts a partial read at whole units
    and ends its last chunk at token ``num_tokens``: the chunks together move what the whole does."""
    from kvxfer.engine.paths.reading import chunk_request

    bs_r = bs_l * ratio if up else max(1, bs_l // ratio)
    unit = max(bs_l, bs_r)
    n = data.draw(st.integers(unit + 1, 5 * unit - 1).filter(lambda t: t % unit))
    common = dict(num_layers=2, num_kv_heads=2, head_dim=2, dtype="float16", model="m")
    lspec = KVSpec(block_size=bs_l, num_blocks=_blocks(n, bs_l) + 2, layout="NHD", **common)
    rspec = KVSpec(block_size=bs_r, num_blocks=_blocks(n, bs_r) + 2, layout="HND", **common)
    lview, larena = place_cache(lspec)
    rview, rarena = place_cache(rspec, arena_base=0x4000_0000)
    fill_pattern(lview, larena, seed=1)
    fill_pattern(rview, rarena, seed=2)
    before = larena.buf.copy()
    lb = _ids(data.draw, lspec.num_blocks, _blocks(n, bs_l))
    rb = _ids(data.draw, rspec.num_blocks, _blocks(n, bs_r))
    plan = build_plan(lview, rview, mode="staged")
    whole = plan.for_request(lb, rb, num_tokens=n)
    per_unit = plan.for_request(lb[:unit // bs_l], rb[:unit // bs_r]).staging_bytes   # one whole unit
    chunks = chunk_request(plan, whole, lb, rb, per_unit, num_tokens=n)
    assert len(chunks) == _blocks(n, unit)
    assert sum(c.num_bytes for c in chunks) == whole.num_bytes
    for c in chunks:
        execute(plan, c, larena, rarena)
    got, want = logical_kv(lview, larena, lb), logical_kv(rview, rarena, rb)
    assert np.array_equal(got[:, :, :n], want[:, :, :n])
    allowed = _token_mask(lview, larena, lb, plan.heads, n)
    assert np.array_equal(larena.buf[~allowed], before[~allowed])
