"""Property tests for the GPU path's pair-copy tables, executed on host bytes and checked cell by cell.

Random compatible spec pairs (TP sizes and ranks, NHD/HND, any two block sizes, every storage,
MLA, fused K | V vectors) and random distinct block ids; ``direct_pairs`` and ``pack_pairs`` + ``unpack_pairs``
(through a staging region) run with ``pair_copy_numpy`` over one uint8 arena. The oracle is
independent of the pair code's address math: it reads each cache through the documented tensor
shape of its storage (a plain C-contiguous numpy reshape) and derives head ownership from the
sharding rule itself, so it shares no stride, offset or head-range helper with ``kvxfer.gpu``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.gpu.ops import pair_copy_numpy
from kvxfer.layout.pairs import DirectTemplate, PairCopy, direct_pairs, overlap, pack_pairs, unpack_pairs
from kvxfer.layout.plan import head_overlap
from kvxfer.layout.spec import CacheGeometry, KVSpec

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ADDR = 0x7F12_3456_7000  # the arena's pretend address: a table that ignores its bases reads elsewhere
SENTINEL = 0xA5
TP = st.sampled_from([1, 2, 4, 8])
TP_FEW = st.sampled_from([1, 1, 2, 2, 4, 8])  # weighted so ranks often share several heads
# Any two sizes: the tables move gcd-sized token chunks, so 4 and 6 combine as well as 4 and 8.
BLOCK = st.sampled_from([1, 2, 3, 4, 6, 8])

# Each storage's tensor as the framework allocates it (kvxfer/layout/spec.py's module docstring),
# one C-contiguous allocation, axes named: l layer, k K/V, n block, t token, h head, v vector byte.
_OUTER = {"split": "lkn", "packed": "lnk", "cross_layer": "nlk"}
_INNER = {"NHD": "thv", "HND": "htv"}
_CANON = "lknthv"


def cells(spec: KVSpec, arena: np.ndarray, offset: int) -> np.ndarray:
    """A writable ``[layer, kv, block, token, head, byte]`` view of the cache stored at ``arena[offset:]``."""
    storage = spec.storage.value
    axes = "lnhktv" if storage == "head_packed" else _OUTER[storage] + _INNER[spec.layout.value]
    size = dict(l=spec.num_layers, k=spec.kv_count, n=spec.num_blocks, t=spec.block_size,
                h=spec.heads_per_rank, v=spec.head_dim * spec.itemsize)
    shape = [size[a] for a in axes]
    flat = arena[offset:offset + math.prod(shape)]
    return flat.reshape(shape).transpose([axes.index(a) for a in _CANON])


def owned_heads(spec: KVSpec) -> np.ndarray:
    """Global KV heads a rank stores: equal contiguous slices of the heads in rank order; when
    ranks outnumber heads, ``tp / heads`` consecutive ranks hold the same head; MLA: head 0 everywhere."""
    if spec.mla:
        return np.array([0])
    heads, tp, rank = spec.num_kv_heads, spec.tp_size, spec.tp_rank
    holders = [range(h * tp // heads, max(h * tp // heads + 1, (h + 1) * tp // heads)) for h in range(heads)]
    return np.array([h for h in range(heads) if rank in holders[h]])


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@st.composite
def ids_for(draw, count: int, num_blocks: int) -> np.ndarray:
    """``count`` distinct block ids of ``num_blocks``: a consecutive run, or shuffled."""
    if draw(st.booleans()):
        start = draw(st.integers(0, num_blocks - count))
        return np.arange(start, start + count, dtype=np.int64)
    return np.array(draw(st.permutations(range(num_blocks)))[:count], dtype=np.int64)


@st.composite
def pair_case(draw):
    """(src spec, src ids, dst spec, dst ids, num_tokens or None): a request that the tables accept.

    The source rank is drawn among the ranks holding a head the destination rank needs (by the
    oracle's ownership), and both id lists hold the token count rounded up to whole chunks.
    """
    mla = draw(st.integers(0, 5)) == 0
    fused = not mla and draw(st.integers(0, 4)) == 0   # K | V in one vector (vLLM's GPU caches)
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8, 8]))
    dtype, head_dim = draw(st.sampled_from([("uint8", 3), ("float16", 2), ("bfloat16", 1), ("float32", 1)]))
    common = dict(num_layers=draw(st.integers(1, 3)), num_kv_heads=heads, head_dim=head_dim * (1 + fused),
                  dtype=dtype, mla=mla, kv_fused=fused, model="m")
    bs_src, bs_dst = draw(BLOCK), draw(BLOCK)
    num_tokens = draw(st.integers(0, 14))
    moved = _round_up(num_tokens, math.gcd(bs_src, bs_dst))

    def one(bs: int, rank_of) -> tuple[KVSpec, np.ndarray]:
        layout = draw(st.sampled_from(["NHD", "HND"]))
        storages = ["split", "cross_layer"] + ([] if mla or fused else ["packed"])
        storages += ["head_packed"] if layout == "HND" and not (mla or fused) else []
        count = -(-moved // bs) + draw(st.integers(0, 1))  # a spare id: the tables must not touch its block
        tp = draw(TP_FEW)
        spec = KVSpec(block_size=bs, num_blocks=max(1, count + draw(st.integers(0, 3))), tp_size=tp,
                      layout=layout, storage=draw(st.sampled_from(storages)), **common)
        spec = spec.with_rank(rank_of(spec))
        return spec, draw(ids_for(count, spec.num_blocks))

    dst, d_ids = one(bs_dst, lambda s: draw(st.integers(0, s.tp_size - 1)))
    need = set(owned_heads(dst).tolist())
    src, s_ids = one(bs_src, lambda s: draw(st.sampled_from(
        [r for r in range(s.tp_size) if need & set(owned_heads(s.with_rank(r)).tolist())])))
    return src, s_ids, dst, d_ids, draw(st.sampled_from([num_tokens, None]))


def _run(copy: PairCopy, arena: np.ndarray, cuts: list[int]) -> None:
    """Execute ``copy`` in pieces split at ``cuts`` (as a pipelined transfer would)."""
    edges = [0, *sorted(c for c in cuts if c < copy.n), copy.n]
    for a, b in zip(edges, edges[1:]):
        pair_copy_numpy(copy.slice(a, b), arena, base=ADDR)


@SETTINGS
@given(case=pair_case(), staged=st.booleans(), seed=st.integers(0, 2**32 - 1),
       pads=st.lists(st.integers(0, 9), min_size=4, max_size=4), data=st.data(), template=st.booleans())
def test_pair_tables_move_exactly_the_shared_kv(case, staged, seed, pads, data, template):
    """Every destination cell of a (token, shared head, layer, K/V) holds the source's cell; no other
    arena byte changes (destination sentinels, source, gaps); the staging image is in wire order.
    ``template``: the direct copy comes from a ``DirectTemplate`` (the IPC read's per-link tables)."""
    src, s_ids, dst, d_ids, num_tokens = case
    g = math.gcd(src.block_size, dst.block_size)
    moved = (_round_up(num_tokens, g) if num_tokens is not None
             else min(len(s_ids) * src.block_size, len(d_ids) * dst.block_size))
    shared = np.intersect1d(owned_heads(src), owned_heads(dst))
    layers, kv, vb = src.num_layers, src.kv_count, src.head_dim * src.itemsize
    wire = layers * kv * moved * shared.size * vb
    event(f"{'staged' if staged else 'direct'} mla={src.mla} fused={src.kv_fused} chunk={g} heads={shared.size}")

    # arena: [pad][source cache][pad][destination cache][pad][staging][pad]
    s_off = pads[0]
    d_off = s_off + src.cache_bytes + pads[1]
    w_off = d_off + dst.cache_bytes + pads[2]
    arena = np.random.default_rng(seed).integers(0, 256, w_off + wire + pads[3], dtype=np.uint8)
    src_cells, dst_cells = cells(src, arena, s_off), cells(dst, arena, d_off)
    dst_cells[...] = SENTINEL
    before = arena.copy()

    # oracle: token t sits in slot t % block_size of the t // block_size-th id; head h at h - first
    t = np.arange(moved)[:, None]
    s_at = (s_ids[t // src.block_size], t % src.block_size, shared[None, :] - owned_heads(src)[0])
    d_at = (d_ids[t // dst.block_size], t % dst.block_size, shared[None, :] - owned_heads(dst)[0])
    values = src_cells[:, :, s_at[0], s_at[1], s_at[2]]  # [layer, kv, token, head, byte]

    s_geom = CacheGeometry.contiguous(src, ADDR + s_off)
    d_geom = CacheGeometry.contiguous(dst, ADDR + d_off)
    if staged:
        pack = pack_pairs(src, s_geom, s_ids, dst, d_ids, ADDR + w_off, num_tokens)
        unpack = unpack_pairs(src, s_ids, dst, d_geom, d_ids, ADDR + w_off, num_tokens)
        assert pack.nbytes == unpack.nbytes == wire and pack.n == unpack.n
        cuts = data.draw(st.lists(st.integers(0, max(pack.n, 1)), max_size=3))
        _run(pack, arena, cuts)
        # wire order: layer, K/V, chunk of g tokens; each box in the destination's layout
        boxes = values.reshape(layers, kv, moved // g, g, shared.size, vb)
        if dst.layout.value == "HND":
            boxes = boxes.transpose(0, 1, 2, 4, 3, 5)
        image = np.ascontiguousarray(boxes).reshape(-1)
        assert np.array_equal(arena[w_off:w_off + wire], image)
        _run(unpack, arena, cuts)
    else:
        image = before[w_off:w_off + wire]
        if template:
            direct = DirectTemplate(src, s_geom, dst, d_geom).copy(s_ids, d_ids, num_tokens)
        else:
            direct = direct_pairs(src, s_geom, s_ids, dst, d_geom, d_ids, num_tokens)
        assert direct.nbytes == wire
        _run(direct, arena, data.draw(st.lists(st.integers(0, max(direct.n, 1)), max_size=3)))

    assert np.array_equal(dst_cells[:, :, d_at[0], d_at[1], d_at[2]], values)
    covered = np.zeros(dst_cells.shape[:5], dtype=bool)
    covered[:, :, d_at[0], d_at[1], d_at[2]] = True
    assert (dst_cells[~covered] == SENTINEL).all(), "a cell outside the request changed"
    want = before.copy()
    cells(dst, want, d_off)[:, :, d_at[0], d_at[1], d_at[2]] = values
    want[w_off:w_off + wire] = image
    assert np.array_equal(arena, want), "a byte outside the destination cells (or staging) changed"


@SETTINGS
@given(case=pair_case())
def test_direct_template_gives_direct_pairs_copy(case):
    """A template's copy is ``direct_pairs``'s, field by field, alignment included; both refuse a
    token count beyond the ids the same way."""
    src, s_ids, dst, d_ids, num_tokens = case
    s_geom, d_geom = CacheGeometry.contiguous(src, ADDR), CacheGeometry.contiguous(dst, ADDR + src.cache_bytes)
    want = direct_pairs(src, s_geom, s_ids, dst, d_geom, d_ids, num_tokens)
    template = DirectTemplate(src, s_geom, dst, d_geom)
    got = template.copy(s_ids, d_ids, num_tokens)
    for name in ("n", "n_chunks", "tokens", "heads", "vector_bytes", "p0", "nbytes"):
        assert getattr(got, name) == getattr(want, name), name
    for a, b in ((got.src_side, want.src_side), (got.dst_side, want.dst_side)):
        assert (a.stride, a.block_size, a.ts, a.hs, a.head, a.base) == (b.stride, b.block_size, b.ts, b.hs, b.head, b.base)
        assert np.array_equal(a.bases, b.bases) and a.ids is not None and np.array_equal(a.ids, b.ids)
        assert a.low_bits() == b.low_bits()
    assert got.alignment() == want.alignment()
    assert np.array_equal(got.src, want.src) and np.array_equal(got.dst, want.dst)
    too_many = min(len(s_ids) * src.block_size, len(d_ids) * dst.block_size) + 1
    with pytest.raises(BlockIdError, match=f"got {too_many}"):
        template.copy(s_ids, d_ids, too_many)
    with pytest.raises(BlockIdError, match=f"got {too_many}"):
        direct_pairs(src, s_geom, s_ids, dst, d_geom, d_ids, too_many)


def test_direct_template_refuses_ranks_that_share_no_head():
    a = KVSpec(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2, num_blocks=4, dtype="uint8", tp_size=2)
    with pytest.raises(LayoutError, match="holds no head"):
        DirectTemplate(a.with_rank(0), CacheGeometry.contiguous(a, ADDR), a.with_rank(1),
                       CacheGeometry.contiguous(a, ADDR))


@settings(max_examples=200, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8]), tp=st.tuples(TP, TP),
       ranks=st.tuples(st.integers(0, 7), st.integers(0, 7)), mla=st.booleans())
def test_overlap_is_the_shared_heads(heads, tp, ranks, mla):
    """``head_overlap`` (the layout's one rule) and the tables' ``overlap`` name exactly the heads
    both ranks hold (local offsets included); the tables refuse a pair that shares none."""
    heads = 1 if mla else heads
    src, dst = (KVSpec(1, heads, 2, 4, 2, dtype="uint8", mla=mla, tp_size=t, tp_rank=r % t)
                for t, r in zip(tp, ranks))
    shared = np.intersect1d(owned_heads(src), owned_heads(dst))
    ov = overlap(src, dst)
    assert head_overlap(src, dst) == head_overlap(dst, src)
    if shared.size == 0:
        assert ov is None and head_overlap(src, dst) is None
        geom = CacheGeometry.contiguous(src, ADDR)
        with pytest.raises(LayoutError, match="holds no head"):
            direct_pairs(src, geom, [0], dst, CacheGeometry.contiguous(dst, ADDR), [0])
        return
    assert head_overlap(src, dst) == (shared[0], shared[-1] + 1)
    assert (ov.heads, ov.src_head, ov.dst_head) == (
        shared.size, shared[0] - owned_heads(src)[0], shared[0] - owned_heads(dst)[0])
