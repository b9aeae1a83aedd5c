"""The layout translator: TransferPlan between a local and a remote cache (layer: layout, pure; numpy only, no nixl/zmq/torch).

``build_plan`` runs once per (local rank, remote rank) pair: it checks the two specs can be
combined, picks the head range to move, builds the per-unit piece template and decides the
mode. ``TransferPlan.for_request`` then turns block ids into descriptor arrays, vectorised.

Rows of a request are emitted in the order ``[region group, unit, region in group, piece]``.
A region group is a run of regions (``layer * kv_count + kv``) whose blocks follow each other
in memory (packed K|V, or a whole cross-layer row), so adjacent pieces land next to each other
and ``merge_rows`` coalesces them; it also joins consecutive block ids when a group fills the
block stride on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.layout.kvsplit import SplitKVPlan
from kvxfer.layout.request import RequestPlan, UnpackMap, check_block_ids, check_coverage, join_requests, merge_rows
from kvxfer.layout.spec import CacheGeometry, KVSpec, Storage
from kvxfer.layout.template import PieceTemplate, UnpackTemplate, direct_template, staged_template
from kvxfer.layout.tp import head_range
from kvxfer.types import TransferPath

__all__ = ["CacheView", "SplitKVPlan", "TransferPlan", "build_plan", "check_compatible", "head_overlap"]

_U64 = np.uint64
_MATCHING = ("model", "dtype", "head_dim", "num_layers", "num_kv_heads", "mla", "kv_fused")


@dataclass(frozen=True)
class CacheView:
    """One rank's cache: its ``spec`` and where it lives (``geometry``, the owner's addresses)."""

    spec: KVSpec
    geometry: CacheGeometry

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise LayoutError(f"CacheView.spec must be a KVSpec; got {type(self.spec).__name__}")
        if not isinstance(self.geometry, CacheGeometry):
            raise LayoutError(f"CacheView.geometry must be a CacheGeometry; got {type(self.geometry).__name__}")
        self.geometry.check(self.spec)


def _describe(s: KVSpec) -> str:
    k = f"/K-dim-major{s.k_dim_chunk}" if s.k_dim_major else ""
    return f"{s.layout.value}/{s.storage.value}{k}/bs{s.block_size}/tp{s.tp_rank}of{s.tp_size}"


def check_compatible(a: KVSpec, b: KVSpec) -> None:
    """The one compatibility rule of every path (descriptor plans and GPU pair tables alike).

    Raises:
        LayoutError: model, dtype, head_dim, num_layers, num_kv_heads, mla or kv_fused differ (names both).
    """
    for name in _MATCHING:
        if getattr(a, name) != getattr(b, name):
            raise LayoutError(f"{name} differs: local has {getattr(a, name)!r}; remote has {getattr(b, name)!r}")


def head_overlap(a: KVSpec, b: KVSpec) -> tuple[int, int] | None:
    """The one head-overlap rule of every path (descriptor plans, GPU pair tables, staged reads).

    Returns the global KV-head range ``[start, stop)`` both ranks store, i.e. the heads a
    consumer rank needs from a producer rank (symmetric in ``a`` and ``b``), or None when they
    share none. MLA caches share their one latent head, ``(0, 1)``, on every rank.

    Raises:
        LayoutError: the specs do not describe the same model cache (``check_compatible``).
    """
    check_compatible(a, b)
    a0, a1 = head_range(a.num_kv_heads, a.tp_size, a.tp_rank, a.mla)
    b0, b1 = head_range(b.num_kv_heads, b.tp_size, b.tp_rank, b.mla)
    start, stop = max(a0, b0), min(a1, b1)
    return (start, stop) if start < stop else None


def _check_pair(a: KVSpec, b: KVSpec) -> tuple[int, int]:
    """Raise LayoutError unless the specs can be combined; return the shared head range."""
    heads = head_overlap(a, b)
    small, big = sorted((a.block_size, b.block_size))
    if big % small:
        raise LayoutError(
            f"block sizes must be integer multiples of one another; local has {a.block_size}, "
            f"remote has {b.block_size}"
        )
    if heads is None:
        la, lb = (a.first_head, a.first_head + a.heads_per_rank), (b.first_head, b.first_head + b.heads_per_rank)
        raise LayoutError(
            f"remote rank {b.tp_rank}/{b.tp_size} holds heads [{lb[0]}, {lb[1]}) but local rank "
            f"{a.tp_rank}/{a.tp_size} needs heads [{la[0]}, {la[1]}): no overlap"
        )
    return heads


def _bases(view: CacheView, kv: int | None) -> np.ndarray:
    """Region bases ``[layers, kv]`` a plan covers: all, or the one column ``kv``."""
    b = view.geometry.bases
    return b if kv is None else b[:, kv:kv + 1]


def _group_size(sides: list[tuple[np.ndarray, int]]) -> int:
    """Largest g in (all regions, regions per layer, 1) such that every aligned run of g regions
    chains in memory (block b of region r+1 starts where block b of region r ends) on every side;
    ``sides`` holds each side's region bases ``[layers, kv]`` and block bytes."""
    n, per_layer = sides[0][0].size, sides[0][0].shape[1]
    for g in sorted({n, per_layer, 1}, reverse=True):
        if g == 1:
            return 1
        ok = True
        for bases, bb in sides:
            flat = bases.reshape(-1)
            chain = (flat[1:] - flat[:-1]) == _U64(bb)      # uint64 wrap never equals bb
            inner = (np.arange(1, n) % g) != 0               # pairs inside one group
            ok &= bool(chain[inner].all())
        if ok:
            return g
    return 1


def _span(off: np.ndarray, length: np.ndarray, per_unit: int, block_bytes: int, group: int) -> int | None:
    """Bytes of one (group region, unit) on one side when its pieces, in order, are one
    contiguous range there (and, inside a group, fill the block), else None."""
    if per_unit != 1 or (off[1:] != off[:-1] + length[:-1]).any():
        return None
    total = int(length.sum())
    return total if group == 1 or total == block_bytes else None


class TransferPlan:
    """Byte-range correspondence between a local and a remote rank's caches; built once per peer.

    Attributes: ``mode`` (``TransferPath.DIRECT`` or ``TransferPath.HOST_STAGED``: remote pieces
    land in a host staging buffer and are unpacked; equal to "direct" / "host-staged"), ``local``, ``remote`` (CacheViews), ``heads``
    (global head range moved), ``pieces_per_block`` (descriptors per region and local block
    before coalescing), ``over_read`` (staged pieces include unneeded remote vectors; then the
    plan cannot be reversed for a WRITE), ``reversible``, ``group`` (regions per group).

    ``tokens`` (internal): the plan of a request's partial last unit, whose template covers only
    that unit's first ``tokens`` tokens (``ceil(tokens / block_size)`` blocks a side).
    ``min_piece``: the ``min_direct_bytes`` a staged plan's template was built with; ``exact``:
    the views to plan a partial unit on when these views describe the memory only for whole
    blocks (``_as_packed``).
    """

    def __init__(self, local: CacheView, remote: CacheView, heads: tuple[int, int], mode: TransferPath,
                 pieces: PieceTemplate, unpack: UnpackTemplate | None, over_read: bool,
                 kv: int | None = None, *, tokens: int | None = None, min_piece: int = 4096,
                 exact: tuple[CacheView, CacheView] | None = None) -> None:
        self.local, self.remote, self.heads, self.mode = local, remote, heads, mode
        self.pieces, self.unpack, self.over_read = pieces, unpack, over_read
        self.reversible = not over_read
        self.kv = kv   # None: every region; 0 or 1: only that one of each layer (see kvsplit.py)
        self.min_piece, self.exact = min_piece, exact
        self._tails: dict[int, TransferPlan] = {}
        if unpack is not None:   # staging chunk vector c comes from remote (block _src_blk[c], vector _src_vec[c])
            vb = unpack.vector_bytes
            n_vec = pieces.length // vb
            self._src_blk = np.repeat(pieces.r_blk, n_vec)
            self._src_vec = np.repeat(pieces.r_off // vb, n_vec) + (
                np.arange(int(n_vec.sum())) - np.repeat(np.cumsum(n_vec) - n_vec, n_vec))
        ls, rs = local.spec, remote.spec
        self._unit = max(ls.block_size, rs.block_size) if tokens is None else tokens
        self._l_per_unit, self._r_per_unit = -(-self._unit // ls.block_size), -(-self._unit // rs.block_size)
        self.pieces_per_block = -(-pieces.count // self._l_per_unit)
        l_bases, r_bases = _bases(local, kv), _bases(remote, kv)
        self._kv_count = l_bases.shape[1]
        sides = [(r_bases, rs.block_bytes)] + ([(l_bases, ls.block_bytes)] if mode is TransferPath.DIRECT else [])
        self.group = _group_size(sides)
        n_regions = l_bases.size
        self._gbase_l = l_bases.reshape(n_regions // self.group, 1, self.group, 1)
        self._gbase_r = r_bases.reshape(n_regions // self.group, 1, self.group, 1)
        # Fast path: when one (group, unit)'s pieces form one contiguous span on every side
        # that has addresses (both for direct; remote for staged), emit one row per span and
        # join runs of consecutive block ids when a span fills the block stride.
        span_r = _span(pieces.r_off, pieces.length, self._r_per_unit, rs.block_bytes, self.group)
        span_l = (_span(pieces.l_off, pieces.length, self._l_per_unit, ls.block_bytes, self.group)
                  if mode is TransferPath.DIRECT else span_r)
        self._span = span_r if span_r is not None and span_l is not None else None
        self._join = self._span is not None and self.group * self._span == rs.block_stride and (
            mode is TransferPath.HOST_STAGED or self.group * self._span == ls.block_stride)

    def __repr__(self) -> str:
        return (f"TransferPlan(mode={self.mode!r}, heads={self.heads}, local={_describe(self.local.spec)}, "
                f"remote={_describe(self.remote.spec)}, pieces_per_block={self.pieces_per_block}, "
                f"group={self.group}, over_read={self.over_read})")

    # ---- per request -----------------------------------------------------------------
    def for_request(self, local_blocks: Sequence[int] | np.ndarray,
                    remote_blocks: Sequence[int] | np.ndarray, *, num_tokens: int | None = None) -> RequestPlan:
        """Descriptors moving the tokens of ``local_blocks`` <-> ``remote_blocks`` (token order).

        ``num_tokens`` None: every token of both lists, which must cover the same tokens. Given,
        exactly the first ``num_tokens`` tokens move and each list ends with its own partial
        last block (``ceil(num_tokens / block_size)`` blocks a side): no byte of a token past
        ``num_tokens`` is read into or written in either side's last block.

        Raises:
            BlockIdError: unequal token coverage, or lists that do not fit ``num_tokens`` (names
                both), an id outside ``[0, num_blocks)`` (names the id and the bound), or a
                repeated id.
        """
        ls, rs = self.local.spec, self.remote.spec
        lb = check_block_ids("local", local_blocks, ls.num_blocks)
        rb = check_block_ids("remote", remote_blocks, rs.num_blocks)
        n = check_coverage(lb.size, ls.block_size, rb.size, rs.block_size, num_tokens)
        whole = None if n is None else n // self._unit
        if n is None or n == whole * self._unit:
            return self._whole_units(lb, rb)
        lw, rw = whole * self._l_per_unit, whole * self._r_per_unit
        tail = self._tail(n - whole * self._unit)._whole_units(lb[lw:], rb[rw:])
        if not whole:
            return tail
        return join_requests([self._whole_units(lb[:lw], rb[:rw]), tail], self.mode is TransferPath.HOST_STAGED)

    def _tail(self, tokens: int) -> "TransferPlan":
        """The plan (same mode, regions and heads) of a unit's first ``tokens`` tokens; cached."""
        plan = self._tails.get(tokens)
        if plan is None:
            local, remote = self.exact or (self.local, self.remote)
            ls, rs = local.spec, remote.spec
            kind = 1 if self.kv is None else self.kv
            if self.mode is TransferPath.DIRECT:
                pieces, unpack, over = direct_template(ls, rs, self.heads, kind, tokens), None, False
            else:
                pieces, unpack, over = staged_template(ls, rs, self.heads, self.min_piece, kind, tokens)
            plan = TransferPlan(local, remote, self.heads, self.mode, pieces, unpack, over, self.kv,
                                tokens=tokens, min_piece=self.min_piece)
            self._tails[tokens] = plan
        return plan

    def _whole_units(self, lb: np.ndarray, rb: np.ndarray) -> RequestPlan:
        """``for_request`` of checked ids that cover whole units of this plan."""
        if self._span is not None:
            return self._span_request(lb, rb)
        lb = lb.reshape(-1, self._l_per_unit).astype(_U64)
        rb = rb.reshape(-1, self._r_per_unit).astype(_U64)
        return self._direct_request(lb, rb) if self.mode is TransferPath.DIRECT else self._staged_request(lb, rb)

    def _span_request(self, lb: np.ndarray, rb: np.ndarray) -> RequestPlan:
        """Fast path (see ``__init__``): one row per (group, run of units); ``lb`` and ``rb`` 1-D.

        Writes straight into the output tables: fresh large temporaries cost page faults.
        """
        p, direct = self.pieces, self.mode is TransferPath.DIRECT
        n_units, span = rb.size, _U64(self.group * self._span)
        if self._join and n_units > 1:
            cont = rb[1:] == rb[:-1] + 1
            if direct:
                cont &= lb[1:] == lb[:-1] + 1
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            runs = np.diff(np.append(starts, n_units)).astype(_U64) * span
        else:
            starts = np.arange(n_units)
            runs = np.full(n_units, span, dtype=_U64)
        n_groups = self._gbase_r.shape[0]
        # one allocation for both tables: glibc trims (and the next request re-faults) less
        both = np.empty((2, n_groups, starts.size, 3), dtype=_U64)
        loc, rem = both[0], both[1]
        r_first = rb[starts].astype(_U64) * _U64(self.remote.spec.block_stride) + _U64(p.r_off[0])
        np.add(self._gbase_r[:, 0, 0, :], r_first, out=rem[:, :, 0])
        if direct:
            l_first = lb[starts].astype(_U64) * _U64(self.local.spec.block_stride) + _U64(p.l_off[0])
            np.add(self._gbase_l[:, 0, 0, :], l_first, out=loc[:, :, 0])
        else:
            group_first = np.arange(n_groups, dtype=_U64)[:, None] * (_U64(n_units) * span)
            np.add(group_first, starts.astype(_U64) * span, out=loc[:, :, 0])
        loc[:, :, 1] = runs
        rem[:, :, 1] = runs
        loc[:, :, 2] = self.local.geometry.device
        rem[:, :, 2] = self.remote.geometry.device
        total = int(runs.sum()) * n_groups
        maps = None if direct else partial(self._maps, lb.reshape(-1, self._l_per_unit), rb.reshape(-1, 1))
        return RequestPlan(local=loc.reshape(-1, 3), remote=rem.reshape(-1, 3),
                           staging_bytes=0 if direct else total, num_bytes=total, build_maps=maps)

    def _rows(self, shape: tuple[int, ...], l_addr, r_addr, length) -> tuple[np.ndarray, np.ndarray]:
        """Fill ``[*shape, 3]`` local and remote tables by broadcasting, then coalesce them."""
        both = np.empty((2, *shape, 3), dtype=_U64)   # one allocation: see _span_request
        loc, rem = both[0], both[1]
        np.add(*l_addr, out=loc[..., 0])
        np.add(*r_addr, out=rem[..., 0])
        loc[..., 1] = length
        rem[..., 1] = length
        loc[..., 2] = self.local.geometry.device
        rem[..., 2] = self.remote.geometry.device
        return merge_rows(loc.reshape(-1, 3), rem.reshape(-1, 3))

    def _direct_request(self, lb: np.ndarray, rb: np.ndarray) -> RequestPlan:
        p, ls, rs = self.pieces, self.local.spec, self.remote.spec
        l_in = lb[:, p.l_blk] * _U64(ls.block_stride) + p.l_off.astype(_U64)     # [units, P]
        r_in = rb[:, p.r_blk] * _U64(rs.block_stride) + p.r_off.astype(_U64)
        shape = (self._gbase_l.shape[0], lb.shape[0], self.group, p.count)
        loc, rem = self._rows(shape, (self._gbase_l, l_in[None, :, None, :]),
                              (self._gbase_r, r_in[None, :, None, :]), p.length.astype(_U64))
        total = int(p.bytes) * shape[0] * shape[1] * shape[2]
        return RequestPlan(local=loc, remote=rem, staging_bytes=0, num_bytes=total)

    def _staged_request(self, lb: np.ndarray, rb: np.ndarray) -> RequestPlan:
        p, rs = self.pieces, self.remote.spec
        n_units, g, n_groups = lb.shape[0], self.group, self._gbase_r.shape[0]
        r_in = rb[:, p.r_blk] * _U64(rs.block_stride) + p.r_off.astype(_U64)
        shape = (n_groups, n_units, g, p.count)
        chunk_id = np.arange(n_groups * n_units * g, dtype=_U64).reshape(n_groups, n_units, g, 1)
        loc, rem = self._rows(shape, (chunk_id * _U64(p.bytes), p.l_off.astype(_U64)),
                              (self._gbase_r, r_in[None, :, None, :]), p.length.astype(_U64))
        total = int(p.bytes) * n_groups * n_units * g
        return RequestPlan(local=loc, remote=rem, staging_bytes=total, num_bytes=total,
                           build_maps=partial(self._maps, lb, rb))

    def _maps(self, lb: np.ndarray, rb: np.ndarray, side: str) -> UnpackMap:
        """Vector-unit map between staging and the ``side`` ("local" or "remote") regions.

        Staging holds chunks ``(group, unit, region in group)`` of ``chunk_vectors`` each;
        the map is the same for every region up to the chunk offset.
        """
        u, g = self.unpack, self.group
        view, ids = (self.local, lb) if side == "local" else (self.remote, rb)
        s = view.spec
        n_units, chunk = ids.shape[0], u.chunk_vectors
        if side == "local":
            blk, vec, src = u.dst_blk, u.dst_vec, u.src
        else:
            blk, vec, src = self._src_blk, self._src_vec, np.arange(chunk, dtype=np.int64)
        dst = (ids[:, blk].astype(np.int64) * (s.block_stride // u.vector_bytes) + vec).reshape(-1)
        src = (np.arange(n_units, dtype=np.int64)[:, None] * (g * chunk) + src).reshape(-1)
        region = np.arange(s.num_layers * self._kv_count, dtype=np.int64)
        offset = ((region // g) * n_units * g + region % g) * chunk
        return UnpackMap(src=src, dst=dst, region_offset=offset, kv_count=self._kv_count,
                         vector_bytes=u.vector_bytes, region_bytes=s.region_bytes, kv=self.kv)


def _whole_head_packed_rows(ls: KVSpec, rs: KVSpec) -> bool:
    """Both caches are head_packed with the same heads and block size: a layer's block is one
    contiguous row on both sides (K and V of every head), so rows can move whole."""
    return (ls.storage is rs.storage is Storage.HEAD_PACKED and ls.block_size == rs.block_size
            and ls.heads_per_rank == rs.heads_per_rank and ls.first_head == rs.first_head
            and ls.k_dim_chunk == rs.k_dim_chunk)


def _as_packed(view: CacheView) -> CacheView:
    """The same memory described as ``packed`` (K rows then V rows of the block). Only whole-row
    copies between two such views are faithful: they move the same bytes either way."""
    s = view.spec
    bases = view.geometry.bases.copy()
    bases[:, 1] = bases[:, 0] + np.uint64(s.block_bytes)
    spec = replace(s, storage=Storage.PACKED, k_dim_chunk=0)   # the bytes of K's order move as they are
    return CacheView(spec, CacheGeometry(bases, view.geometry.device, view.geometry.kind))


def build_plan(local: CacheView, remote: CacheView, *, allow_conversion: bool = True,
               min_direct_bytes: int = 4096, mode: str = "auto") -> "TransferPlan | SplitKVPlan":
    """Plan moving the heads ``local`` needs that ``remote`` holds, for any request.

    Direction-agnostic: a READ moves remote -> local along the plan, a WRITE the reverse
    (direct plans, and staged plans with ``reversible``; pack with ``RequestPlan.pack_numpy``).

    ``mode="auto"`` picks "direct" unless the layouts cut a block into pieces smaller than
    both ``min_direct_bytes`` and one block's moved bytes; then "host-staged" (remote pieces in
    the remote's native order land in a staging buffer, a local unpack permutes them), or a
    LayoutError when ``allow_conversion`` is false. ``mode="direct"``/``"host-staged"`` force a
    mode (``"staged"``, the name before, is taken as ``"host-staged"``). The plan's ``mode`` is a
    ``TransferPath`` member. Where a side keeps K dim-major, K and V are planned apart and
    joined (``SplitKVPlan``, the same interface; both parts in one mode, host-staged when
    either needs it).

    Raises:
        LayoutError: model, dtype, head_dim, num_layers, num_kv_heads or mla differ (names
            both values); block sizes not integer multiples; no shared heads; conversion needed
            but not allowed (names both layouts); an unknown ``mode``.
    """
    for name, view in (("local", local), ("remote", remote)):
        if not isinstance(view, CacheView):
            raise LayoutError(f"{name} must be a CacheView; got {type(view).__name__}")
    if getattr(local.spec, "hybrid", None) is not None or getattr(remote.spec, "hybrid", None) is not None:
        from kvxfer.layout.carrier import build_flat_plan  # a hybrid cache's carrier: every group's plan
        return build_flat_plan(local, remote, allow_conversion=allow_conversion)
    if mode not in ("auto", "direct", "host-staged", "staged"):
        raise LayoutError(f"mode must be 'auto', 'direct' or 'host-staged'; got {mode!r}")
    mode = "host-staged" if mode == "staged" else str(mode)
    if not isinstance(min_direct_bytes, int) or min_direct_bytes < 0:
        raise LayoutError(f"min_direct_bytes must be a non-negative integer; got {min_direct_bytes!r}")
    ls, rs = local.spec, remote.spec
    heads = _check_pair(ls, rs)
    exact = None
    if mode != "host-staged" and _whole_head_packed_rows(ls, rs):
        exact = (local, remote)   # a partial last block is planned on the memory as it is
        local, remote = _as_packed(local), _as_packed(remote)
        ls, rs = local.spec, remote.spec
    if not (ls.k_dim_major or rs.k_dim_major):
        plan = _plan_regions(local, remote, heads, mode, allow_conversion, min_direct_bytes, None)
        plan.exact = exact
        return plan
    # K and V differ in form on some side: one plan per region kind, in one mode
    parts = [_plan_regions(local, remote, heads, mode, allow_conversion, min_direct_bytes, kv) for kv in (1, 0)]
    if len({p.mode for p in parts}) > 1:
        parts = [_plan_regions(local, remote, heads, "host-staged", allow_conversion, min_direct_bytes, kv)
                 for kv in (1, 0)]
    return SplitKVPlan(parts)


def _plan_regions(local: CacheView, remote: CacheView, heads: tuple[int, int], mode: str,
                  allow_conversion: bool, min_direct_bytes: int, kv: int | None) -> TransferPlan:
    """``build_plan``'s choice for the regions ``kv`` (None: all; 0/1: K or V of every layer)."""
    ls, rs = local.spec, remote.spec
    kind = 1 if kv is None else kv   # without a dim-major K, K and V plan alike
    direct = direct_template(ls, rs, heads, kind)
    natural = (heads[1] - heads[0]) * min(ls.block_size, rs.block_size) * ls.vector_bytes
    smallest = int(direct.length.min())
    fragmented = smallest < min(natural, min_direct_bytes)
    if mode == "auto" and fragmented and not allow_conversion:
        raise LayoutError(
            f"local {_describe(ls)} and remote {_describe(rs)} only match in {smallest}-byte pieces "
            f"(< min_direct_bytes {min_direct_bytes}); allow conversion to stage and unpack"
        )
    if mode == "direct" or (mode == "auto" and not fragmented):
        return TransferPlan(local, remote, heads, TransferPath.DIRECT, direct, None, False, kv,
                            min_piece=min_direct_bytes)
    pieces, unpack, over_read = staged_template(ls, rs, heads, min_direct_bytes, kind)
    return TransferPlan(local, remote, heads, TransferPath.HOST_STAGED, pieces, unpack, over_read, kv,
                        min_piece=min_direct_bytes)
