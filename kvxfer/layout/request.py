"""Per-request descriptor arrays from block ids (layer: layout, pure; numpy only, no nixl/zmq/torch).

Everything here is vectorised: work grows with the number of output descriptors, never with
a Python loop per block. Loops run only over regions (``num_layers * kv``) when unpacking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import numpy as np

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.types import TransferPath

__all__ = ["MapSet", "RequestPlan", "UnpackMap", "check_block_id_lists", "check_block_ids", "check_coverage",
           "check_token_count", "id_bounds", "join_requests", "merge_rows"]

_U64 = np.uint64


def check_block_ids(side: str, ids: Sequence[int] | np.ndarray, bound: int) -> np.ndarray:
    """Return ``ids`` as a 1-D int64 array after checking each is in ``[0, bound)`` and distinct.

    Raises:
        BlockIdError: not 1-D integers, an id out of range (names the id and the bound) or a
            repeated id (two token ranges would share one block).
    """
    fast = _small_ids(ids, bound)
    if fast is not None:
        return fast
    a = np.asarray(ids)
    if a.ndim != 1:
        raise BlockIdError(f"{side} block ids must be a 1-D sequence; got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise BlockIdError(f"{side} block ids must be integers; got dtype {a.dtype}")
    s = np.sort(a)  # gives the range too: one pass fewer than max() and min()
    lo, hi = s[0], s[-1]
    if lo < 0 or hi >= bound:
        bad = lo if lo < 0 else hi
        raise BlockIdError(f"{side} block id {int(bad)} is outside [0, {bound})")
    if a.size > 1:
        dup = s[1:] == s[:-1]
        if dup.any():
            raise BlockIdError(f"{side} block ids must be distinct; got {int(s[1:][dup][0])} twice")
    return a.astype(np.int64, copy=False)


#: Lists up to this long are checked as Python ints (a read of a few blocks: several numpy
#: calls cost more than the ids); longer ones, and any list that fails, take the numpy checks.
_SMALL = 64


def id_bounds(ids: np.ndarray) -> tuple[int, int]:
    """The smallest and largest of a non-empty 1-D integer array, as Python ints; a short one
    (up to ``_SMALL``) through Python's ``min``/``max``, which cost less there than numpy's calls."""
    if ids.size <= _SMALL:
        values = ids.tolist()
        return min(values), max(values)
    return int(ids.min()), int(ids.max())


def _small_ids(ids, bound: int) -> np.ndarray | None:
    """``check_block_ids``' result for a short valid list of ids (an int64 array), else None:
    the caller then checks it the general way, which also names what is wrong."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or not 0 < ids.size <= _SMALL:
            return None
        values = ids.tolist()
    elif type(ids) in (list, tuple) and 0 < len(ids) <= _SMALL and all(type(i) is int for i in ids):
        values = ids
    else:
        return None
    if min(values) < 0 or max(values) >= bound or len(set(values)) != len(values):
        return None
    return ids.astype(np.int64, copy=False) if isinstance(ids, np.ndarray) else np.array(values, dtype=np.int64)


def check_coverage(local_blocks: int, local_size: int, remote_blocks: int, remote_size: int,
                   num_tokens=None) -> int | None:
    """The tokens a read of ``local_blocks`` blocks of ``local_size`` tokens <- ``remote_blocks``
    of ``remote_size`` moves: None (every token of both lists, which must cover the same
    tokens) when ``num_tokens`` is None, else ``num_tokens``, which each list must cover with
    its last block possibly partial: ``N <= blocks * size <= N + size - 1`` on both sides.

    Raises:
        BlockIdError: unequal coverage without ``num_tokens``, ``num_tokens`` not a
            non-negative integer, or a list covering fewer than ``num_tokens`` tokens or more
            than one partial block beyond them (names both values).
    """
    local_tokens, remote_tokens = local_blocks * local_size, remote_blocks * remote_size
    if num_tokens is None:
        if local_tokens != remote_tokens:
            raise BlockIdError(
                f"local and remote block lists must cover the same tokens; local {local_blocks} blocks x "
                f"{local_size} = {local_tokens} tokens, remote {remote_blocks} blocks x {remote_size} = "
                f"{remote_tokens} tokens (pass num_tokens for a read whose last blocks are partial)")
        return None
    n = check_token_count("local", local_blocks, local_size, num_tokens)
    check_token_count("remote", remote_blocks, remote_size, n)
    return n


def check_token_count(side: str, blocks: int, size: int, num_tokens) -> int:
    """``num_tokens`` as an int after checking one side's list of ``blocks`` blocks of ``size``
    tokens holds them with at most its last block partial (``check_coverage``'s rule, one side).

    Raises:
        BlockIdError: ``num_tokens`` not a non-negative integer, more tokens than the list
            covers, or a list longer than ``ceil(num_tokens / size)`` blocks (names both values).
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise BlockIdError(f"num_tokens must be a non-negative integer or None; got {num_tokens!r}")
    n, tokens = int(num_tokens), blocks * size
    need = -(-n // size)
    if blocks < need:
        raise BlockIdError(f"num_tokens {n} is more than the {side} block list covers: {blocks} blocks x "
                           f"{size} = {tokens} tokens")
    if blocks > need:
        raise BlockIdError(f"the {side} block list covers {blocks} blocks x {size} = {tokens} tokens, more "
                           f"than num_tokens {n} needs ({need} blocks; at most {need * size} tokens)")
    return n


def check_block_id_lists(side: str, lists: Sequence, bound: int) -> list[np.ndarray]:
    """``check_block_ids`` for many requests' ids at once (an engine step's), each list on its own
    (an id may appear in two lists, not twice in one); the same result and the same errors.

    One pass over all of them when every list is a 1-D array of one integer type; anything else,
    or any failure, takes the lists one by one, so an error names the offending id as
    ``check_block_ids`` does, in list order.
    """
    if len(lists) <= 1:  # a lone read: nothing to batch
        return [check_block_ids(side, ids, bound) for ids in lists]
    arrays = [np.asarray(ids) for ids in lists]
    kind = arrays[0].dtype
    if kind.kind not in "iu" or any(a.dtype != kind for a in arrays):
        return [check_block_ids(side, ids, bound) for ids in lists]
    try:
        flat = np.concatenate(arrays)  # a 0-D list, or lists of other ndims, raise
    except ValueError:
        return [check_block_ids(side, ids, bound) for ids in lists]
    if flat.ndim != 1:  # every list 2-D or more
        return [check_block_ids(side, ids, bound) for ids in lists]
    if flat.size:
        top = int(flat.max())
        if flat.min() < 0 or top >= bound:
            return [check_block_ids(side, ids, bound) for ids in lists]  # raises, naming the id
        sizes = [a.size for a in arrays]
        owner = np.repeat(np.arange(len(arrays), dtype=np.int64), sizes)
        span = top + 1  # every id is below it: (list, id) as one integer when it fits
        flat = flat.astype(np.int64, copy=False)
        if span * len(arrays) < 2**62:
            keys = np.sort(owner * span + flat)
            repeated = bool((keys[1:] == keys[:-1]).any())
        else:
            order = np.lexsort((flat, owner))
            ids, who = flat[order], owner[order]
            repeated = bool(np.any((ids[1:] == ids[:-1]) & (who[1:] == who[:-1])))
        if repeated:
            return [check_block_ids(side, ids, bound) for ids in lists]  # raises, naming the id
    # views of the one int64 copy, list by list
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size] if a.size else np.zeros(0, dtype=np.int64))
        at += a.size
    return out


def merge_rows(loc: np.ndarray, rem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coalesce consecutive rows of two ``[N, 3]`` tables that continue each other on BOTH sides.

    Row order is kept; returns the (possibly shorter) tables. One scratch array is reused
    for both sides because fresh large temporaries cost page faults.
    """
    n = loc.shape[0]
    if n <= 1:
        return loc, rem
    length = loc[:, 1]
    scratch = np.empty(n - 1, dtype=_U64)
    np.add(rem[:-1, 0], length[:-1], out=scratch)
    cont = np.equal(rem[1:, 0], scratch)
    np.add(loc[:-1, 0], length[:-1], out=scratch)
    cont &= np.equal(loc[1:, 0], scratch)
    if not cont.any():
        return loc, rem
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged = np.add.reduceat(length, starts)
    loc, rem = loc[starts], rem[starts]
    loc[:, 1] = merged
    rem[:, 1] = merged
    return loc, rem


def join_requests(reqs: Sequence["RequestPlan"], staged: bool) -> "RequestPlan":
    """One ``RequestPlan`` made of ``reqs``' rows in order; for host-staged plans their staging
    images follow one another (each part's local offsets and map move to its own range)."""
    if len(reqs) == 1:
        return reqs[0]
    starts = np.cumsum([0] + [r.staging_bytes for r in reqs]).tolist()
    local = [r.local for r in reqs]
    if staged:   # local addresses are staging offsets: move each part to its own range
        local = [t + np.array([start, 0, 0], dtype=_U64) if t.size else t for t, start in zip(local, starts)]
    return RequestPlan(
        local=np.concatenate(local).reshape(-1, 3), remote=np.concatenate([r.remote for r in reqs]).reshape(-1, 3),
        staging_bytes=int(starts[-1]) if staged else 0, num_bytes=sum(r.num_bytes for r in reqs),
        build_maps=partial(_joined_maps, tuple(reqs), tuple(starts)) if staged else None)


def _joined_maps(reqs: tuple, starts: tuple, side: str) -> "MapSet":
    """The parts' maps of ``side``, each over its own staging range (a part's own MapSet flattened)."""
    parts = []
    for r, start, stop in zip(reqs, starts, starts[1:]):
        m = r._map(side)
        if isinstance(m, MapSet):
            parts += [(p, start + a, start + b) for p, a, b in m.parts]
        else:
            parts.append((m, start, stop))
    return MapSet(tuple(parts))


@dataclass(frozen=True)
class UnpackMap:
    """Vector-unit map between a staging buffer and one side's regions, shared by every region.

    Region ``r = layer * kv_count + kv`` pairs ``staging[src + region_offset[r]]`` with
    ``region[dst]`` (``dst`` counts vectors from the region's block 0). ``region_bytes`` is
    that side's ``spec.region_bytes``. A map of one region per layer (``kv`` set, ``kv_count``
    1) covers region ``(r, kv)`` at position ``r``. ``vector_bytes`` is the unit of every
    index: a head vector, or a sub-vector where a side keeps K dim-major.
    """

    src: np.ndarray            # int64, staging vector index before the region's offset
    dst: np.ndarray            # int64, vector index in the region (from block 0)
    region_offset: np.ndarray  # int64 [num_layers * kv_count]
    kv_count: int
    vector_bytes: int
    region_bytes: int
    kv: int | None = None

    def index(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``[(layer, kv, staging_vec, region_vec)]`` per region."""
        return [
            (r, self.kv, self.src + off, self.dst) if self.kv is not None else
            (r // self.kv_count, r % self.kv_count, self.src + off, self.dst)
            for r, off in enumerate(self.region_offset.tolist())
        ]

    def unit_bytes(self, kv: int) -> int:
        """Bytes of the unit the indices of region ``kv`` count in."""
        return self.vector_bytes

    def run(self, staging: np.ndarray, staging_bytes: int,
            region_view: Callable[[int, int], np.ndarray], to_regions: bool) -> None:
        """Copy staging -> regions (``to_regions``) or regions -> staging, vector by vector."""
        vb = self.vector_bytes
        st = _vectors(staging, vb, staging_bytes, "staging buffer")
        for layer, kv, src, dst in self.index():
            region = _vectors(region_view(layer, kv), vb, self.region_bytes, f"region view ({layer}, {kv})")
            if to_regions:
                region[dst] = st[src]
            else:
                st[src] = region[dst]


@dataclass(frozen=True)
class MapSet:
    """Maps of plans that each cover part of the staging buffer (K and V planned apart, where a
    side keeps K dim-major): ``parts[i]`` is a map and the byte range ``[start, stop)`` of
    staging it uses; indices stay in each map's own unit (``unit_bytes``)."""

    parts: tuple[tuple[UnpackMap, int, int], ...]

    def __post_init__(self) -> None:
        for m, start, stop in self.parts:
            if start % m.vector_bytes or not 0 <= start <= stop:
                raise LayoutError(f"a staging part must start on its own unit: [{start}, {stop}) with "
                                  f"{m.vector_bytes}-byte units")

    def index(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``[(layer, kv, staging_vec, region_vec)]`` per region, staging indices from staging's start."""
        out = []
        for m, start, _ in self.parts:
            out += [(layer, kv, src + start // m.vector_bytes, dst) for layer, kv, src, dst in m.index()]
        return out

    def unit_bytes(self, kv: int) -> int:
        return next(m.vector_bytes for m, _, _ in self.parts if m.kv in (kv, None))

    def run(self, staging: np.ndarray, staging_bytes: int,
            region_view: Callable[[int, int], np.ndarray], to_regions: bool) -> None:
        """``UnpackMap.run`` of every part over its own slice of ``staging``."""
        _vectors(staging, 1, staging_bytes, "staging buffer")
        for m, start, stop in self.parts:
            m.run(staging[start:stop], stop - start, region_view, to_regions)


def _vectors(buf: np.ndarray, vb: int, need_bytes: int, what: str) -> np.ndarray:
    """View a 1-D contiguous uint8 buffer as an array of ``vb``-byte opaque vectors."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        got = getattr(buf, "dtype", type(buf).__name__), getattr(buf, "shape", None)
        raise LayoutError(f"{what} must be a 1-D uint8 numpy array; got {got}")
    if buf.size < need_bytes:
        raise LayoutError(f"{what} must hold at least {need_bytes} bytes; got {buf.size}")
    if not buf.flags.c_contiguous:
        raise LayoutError(f"{what} must be contiguous")
    n = need_bytes // vb
    return buf[: n * vb].view(np.dtype((np.void, vb)))


@dataclass
class RequestPlan:
    """Descriptors for one request; ``local[i]`` and ``remote[i]`` move together.

    ``local``/``remote``: ``[N, 3]`` uint64 ``(addr, len, device)`` with equal lengths row by
    row. Staged plans: ``local`` addresses are byte OFFSETS into a staging buffer of
    ``staging_bytes`` and ``unpack_numpy`` / ``unpack_index`` finish the move.
    ``num_bytes``: bytes on the wire (sum of lengths; staged over-reads count).
    The device column is the owning cache's device; for staged plans the engine sets the
    local column to its staging buffer's (offsets are relative to that buffer).

    Staged plans also describe the staging buffer from the remote side (``source_index``):
    a producer holding the remote cache can pack the same staging image itself (on its GPU)
    and move it in a few large operations instead of ``remote``'s per-block pieces.
    """

    local: np.ndarray
    remote: np.ndarray
    staging_bytes: int
    num_bytes: int
    build_maps: Callable[[str], "UnpackMap | MapSet"] | None = field(default=None, repr=False)
    _maps: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def mode(self) -> TransferPath:
        return TransferPath.DIRECT if self.build_maps is None else TransferPath.HOST_STAGED

    def _map(self, side: str) -> UnpackMap:
        if self.build_maps is None:
            raise LayoutError("unpack/pack apply to staged plans only; this request is direct")
        if side not in self._maps:
            self._maps[side] = self.build_maps(side)
        return self._maps[side]

    @property
    def unpack_map(self) -> "UnpackMap | MapSet":
        """Compact form of ``unpack_index`` (built on first use; the descriptors do not need it)."""
        return self._map("local")

    def unpack_index(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``[(layer, kv, src_vec, dst_vec)]``: ``staging_vectors[src_vec] -> region_vectors[dst_vec]``.

        Indices are int64 in units of one head vector (``spec.vector_bytes``) of the LOCAL
        cache; the same map ``unpack_numpy`` runs. ``dst_vec`` counts from the region's block 0.
        Where a side keeps K dim-major, K's indices count sub-vectors: the unit of region ``kv``
        is ``unpack_map.unit_bytes(kv)`` bytes.
        """
        return self._map("local").index()

    def unpack_numpy(self, staging: np.ndarray,
                     region_view: Callable[[int, int], np.ndarray]) -> None:
        """Scatter a filled staging buffer into the local cache; writes only the target vectors.

        ``region_view(layer, kv)`` returns a writable 1-D uint8 array of at least
        ``spec.region_bytes`` starting at block 0 of that local region.
        """
        self._map("local").run(staging, self.staging_bytes, region_view, to_regions=True)

    def pack_numpy(self, staging: np.ndarray,
                   region_view: Callable[[int, int], np.ndarray]) -> None:
        """The inverse of ``unpack_numpy`` (staged WRITE): gather local vectors into staging."""
        self._map("local").run(staging, self.staging_bytes, region_view, to_regions=False)

    def source_index(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """``[(layer, kv, stage_vec, remote_vec)]``: ``remote_region_vectors[remote_vec] -> staging_vectors[stage_vec]``.

        The REMOTE side's view of the same staging image the descriptors fill (including any
        over-read vectors), in vector units of the remote cache from the region's block 0.
        """
        return self._map("remote").index()

    def pack_source_numpy(self, staging: np.ndarray,
                          remote_region_view: Callable[[int, int], np.ndarray]) -> None:
        """Fill ``staging`` from the remote cache's regions (run where that cache lives)."""
        self._map("remote").run(staging, self.staging_bytes, remote_region_view, to_regions=False)
