"""Pair-copy tables for the kernels: which bytes go where, as strided block pairs (layer: layout; pure numpy, no torch/cupy/nixl).

Every GPU move kvxfer makes (pack into staging, unpack out of it, the same-host single pass)
is one *pair copy*: ``n`` pairs of addresses ``(src[i], dst[i])``, and for every pair the
same small box of ``tokens x heads`` head vectors (``vector_bytes`` each). Vector ``(t, h)``
of pair ``i`` is read at ``src[i] + (t * src_ts + h * src_hs) * vector_bytes`` and written at
``dst[i] + (t * dst_ts + h * dst_hs) * vector_bytes``. The token and head strides (in vectors)
encode NHD (``ts = heads_per_rank, hs = 1``) or HND (``ts = 1, hs = block_size``, or
``2 * block_size`` for ``head_packed``), so head
slicing (heterogeneous TP), HND<->NHD permutation and different block sizes are all just
strides and offsets, and one kernel executes every case.

Pairs are enumerated in *wire order*: layer, then K/V, then token chunk of the request
(``gcd`` of the two block sizes). A staged transfer lays pair ``i`` at bytes
``[i * pair_bytes, (i + 1) * pair_bytes)`` of the staging buffer in the consumer's layout,
so producer and consumer compute matching tables from the two specs alone.

A pair copy moves whole head vectors, so it cannot express a K kept dim-major
(``KVSpec.k_dim_chunk``): ``pair_copy_why`` says so, every table builder here raises that
``LayoutError`` (naming both layouts), and the engine takes the descriptor plan instead
(``build_plan``: direct, or host-staged with an unpack that works in sub-vectors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from kvxfer.errors import BlockIdError, ConfigError, LayoutError
from kvxfer.layout.spec import CacheGeometry, KVSpec, Layout
from kvxfer.layout.plan import head_overlap
from kvxfer.layout.request import check_block_ids

__all__ = ["PairCopy", "Side", "Overlap", "overlap", "direct_pairs", "DirectTemplate", "pack_pairs",
           "pair_copy_why", "unpack_pairs", "request_tokens"]


@dataclass(frozen=True)
class Side:
    """Where pair ``p`` starts on one side of a copy, in a form the GPU evaluates itself.

    A *cache* side (``bases`` set): ``r, c = divmod(p, n_chunks)``, ``tok = c * chunk``,
    ``addr = bases[r] + ids[tok // block_size] * stride + ((tok % block_size) * ts + head * hs) * vb``.
    A *staging* side (``bases`` None): ``addr = base + p * stride`` (``stride`` = pair bytes).
    ``ts``/``hs`` are the token/head strides inside the box, in vectors.
    """

    bases: np.ndarray | None = field(repr=False)
    ids: np.ndarray | None = field(repr=False)
    stride: int
    block_size: int
    ts: int
    hs: int
    head: int = 0
    base: int = 0
    bits: int | None = field(default=None, repr=False, compare=False)  # low_bits(), when known

    def addresses(self, p0: int, n: int, n_chunks: int, chunk: int, vector_bytes: int) -> np.ndarray:
        """uint64 start addresses of pairs ``[p0, p0 + n)`` (the host twin of the kernel's math)."""
        p = np.arange(p0, p0 + n, dtype=np.int64)
        if self.bases is None:
            return (np.uint64(self.base % 2**64) + (p * self.stride).astype(np.uint64))
        r, c = np.divmod(p, n_chunks)
        tok = c * chunk
        blk = self.ids[tok // self.block_size]
        inner = ((tok % self.block_size) * self.ts + self.head * self.hs) * vector_bytes
        return self.bases[r] + (blk * self.stride + inner).astype(np.uint64)

    def moved(self, delta: int) -> "Side":
        if self.bases is not None:
            raise ConfigError("only a staging side can be moved to another address")
        return replace(self, base=(self.base + delta) % 2**64)

    def low_bits(self) -> int:
        """OR of every term an address is built from (its lowest set bit bounds the alignment)."""
        if self.bits is not None:
            return self.bits
        acc = self.stride | (self.base if self.bases is None else int(np.bitwise_or.reduce(self.bases)))
        return acc


@dataclass(frozen=True)
class PairCopy:
    """One strided pair copy (see the module docstring): pairs ``[p0, p0 + n)`` of a request.

    ``src``/``dst`` (uint64 start addresses) are computed on the host only when asked for; the
    GPU kernel evaluates ``src_side``/``dst_side`` itself from the block ids.
    """

    src_side: Side
    dst_side: Side
    n: int
    n_chunks: int
    tokens: int
    heads: int
    vector_bytes: int
    p0: int = 0

    @property
    def src_ts(self) -> int:
        return self.src_side.ts

    @property
    def src_hs(self) -> int:
        return self.src_side.hs

    @property
    def dst_ts(self) -> int:
        return self.dst_side.ts

    @property
    def dst_hs(self) -> int:
        return self.dst_side.hs

    @property
    def src(self) -> np.ndarray:
        return self.src_side.addresses(self.p0, self.n, self.n_chunks, self.tokens, self.vector_bytes)

    @property
    def dst(self) -> np.ndarray:
        return self.dst_side.addresses(self.p0, self.n, self.n_chunks, self.tokens, self.vector_bytes)

    @property
    def pair_bytes(self) -> int:
        return self.tokens * self.heads * self.vector_bytes

    @property
    def nbytes(self) -> int:
        return self.n * self.pair_bytes

    def slice(self, start: int, stop: int) -> "PairCopy":
        """Pairs ``[start, stop)`` of this copy (a piece of a pipelined transfer)."""
        if not 0 <= start <= stop <= self.n:
            raise ConfigError(f"pair range must lie in [0, {self.n}]; got [{start}, {stop})")
        return replace(self, p0=self.p0 + start, n=stop - start)

    def shifted(self, src_delta: int = 0, dst_delta: int = 0) -> "PairCopy":
        """The same copy with a staging side's addresses moved by a byte delta."""
        src = self.src_side.moved(src_delta) if src_delta else self.src_side
        dst = self.dst_side.moved(dst_delta) if dst_delta else self.dst_side
        return replace(self, src_side=src, dst_side=dst)

    def alignment(self) -> int:
        """Largest power of two (<= 16) dividing every address the copy touches."""
        acc = self.src_side.low_bits() | self.dst_side.low_bits() | self.vector_bytes | 16
        return acc & -acc


@dataclass(frozen=True)
class Overlap:
    """Heads two ranks share: ``heads`` of them, starting at local offsets ``src_head``/``dst_head``."""

    heads: int
    src_head: int
    dst_head: int


def overlap(src: KVSpec, dst: KVSpec) -> Overlap | None:
    """Heads the destination rank needs from the source rank, or None when they share none.

    Raises LayoutError when the two specs do not describe the same model cache.
    """
    heads = head_overlap(src, dst)  # the layout translator's own rules (compatibility, model included)
    if heads is None:
        return None
    start, stop = heads
    return Overlap(stop - start, start - src.first_head, start - dst.first_head)


def _strides(spec: KVSpec) -> tuple[int, int]:
    """(token stride, head stride) inside one block, in vectors (the spec's own definition, so
    storages that interleave K and V heads, like ``head_packed``, need nothing here)."""
    return spec.token_stride, spec.head_stride


def request_tokens(a: KVSpec, a_ids: np.ndarray, b: KVSpec, b_ids: np.ndarray,
                   num_tokens: int | None = None) -> int:
    """Tokens a request moves: ``num_tokens`` or what both id lists hold, rounded to whole chunks.

    Raises BlockIdError when ``num_tokens`` exceeds what either id list can hold.
    """
    cap = min(len(a_ids) * a.block_size, len(b_ids) * b.block_size)
    if num_tokens is None:
        num_tokens = cap
    if num_tokens > cap or num_tokens < 0:
        raise BlockIdError(f"num_tokens must be in [0, {cap}] for these block ids; got {num_tokens}")
    g = math.gcd(a.block_size, b.block_size)
    return -(-num_tokens // g) * g  # cap is a multiple of g, so this stays <= cap


def _ids(spec: KVSpec, ids: np.ndarray, side: str) -> np.ndarray:
    return check_block_ids(side, ids, spec.num_blocks)


def _cache_side(spec: KVSpec, geom: CacheGeometry, ids: np.ndarray, head: int) -> Side:
    geom.check(spec)
    ts, hs = _strides(spec)
    return Side(geom.bases.reshape(-1), ids, spec.block_stride, spec.block_size, ts, hs, head)


def _layout_name(s: KVSpec) -> str:
    k = f", K dim-major in chunks of {s.k_dim_chunk}" if s.k_dim_major else ""
    return f"{s.layout.value}/{s.storage.value}{k}"


def pair_copy_why(src: KVSpec, dst: KVSpec) -> str | None:
    """None when pair copies can move KV between these two caches, else why not (names both)."""
    if not (src.k_dim_major or dst.k_dim_major):
        return None
    return (f"pair copies move whole head vectors and cannot express a dim-major K: source "
            f"{_layout_name(src)}, destination {_layout_name(dst)} (the descriptor plan can: direct or host-staged)")


def _shape(src: KVSpec, src_ids, dst: KVSpec, dst_ids, num_tokens, checked: bool = False):
    why = pair_copy_why(src, dst)
    if why is not None:
        raise LayoutError(why)
    ov = overlap(src, dst)
    if ov is None:
        raise LayoutError(f"source rank {src.tp_rank}/{src.tp_size} holds no head destination rank "
                          f"{dst.tp_rank}/{dst.tp_size} needs")
    if checked:
        s_ids, d_ids = src_ids, dst_ids
    else:
        s_ids, d_ids = _ids(src, src_ids, "source"), _ids(dst, dst_ids, "destination")
    chunk = math.gcd(src.block_size, dst.block_size)
    tokens = request_tokens(src, s_ids, dst, d_ids, num_tokens)
    return ov, s_ids, d_ids, chunk, tokens // chunk


def direct_pairs(src: KVSpec, src_geom: CacheGeometry, src_ids, dst: KVSpec, dst_geom: CacheGeometry,
                 dst_ids, num_tokens: int | None = None, *, checked: bool = False) -> PairCopy:
    """Cache-to-cache copy (the same-host single pass): source blocks straight into destination blocks.

    ``src_geom`` holds addresses the copying process can read (e.g. a peer's cache mapped through
    CUDA IPC). Pairs are in wire order; ``num_tokens`` defaults to what both id lists hold.
    ``checked``: both id arrays already passed ``check_block_ids`` against these specs (1-D
    int64, distinct, in range), so they are not checked again.
    """
    ov, s_ids, d_ids, chunk, n = _shape(src, src_ids, dst, dst_ids, num_tokens, checked)
    return PairCopy(_cache_side(src, src_geom, s_ids, ov.src_head),
                    _cache_side(dst, dst_geom, d_ids, ov.dst_head),
                    src.num_layers * src.kv_count * n, n, chunk, ov.heads, src.vector_bytes)


class DirectTemplate:
    """``direct_pairs`` for one fixed pair of caches: what does not depend on the request (the
    heads shared, strides, region bases and their alignment) is worked out once, so a request
    costs only its own ids (the same-host IPC read builds one per request).

    Raises LayoutError as ``direct_pairs`` does (no shared heads, a geometry that does not fit
    its spec).
    """

    def __init__(self, src: KVSpec, src_geom: CacheGeometry, dst: KVSpec, dst_geom: CacheGeometry) -> None:
        ov, _, _, chunk, _ = _shape(src, np.zeros(0, np.int64), dst, np.zeros(0, np.int64), 0, checked=True)
        s = _cache_side(src, src_geom, None, ov.src_head)
        d = _cache_side(dst, dst_geom, None, ov.dst_head)
        self._src = replace(s, bits=s.low_bits())
        self._dst = replace(d, bits=d.low_bits())
        self._specs = (src, dst)
        self._chunk, self._heads, self._vb = chunk, ov.heads, src.vector_bytes
        self._runs = src.num_layers * src.kv_count  # (layer, K/V) regions: pairs per chunk of tokens

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, num_tokens: int | None = None) -> PairCopy:
        """The pair copy of one request: equal to ``direct_pairs(..., checked=True)``.

        Both id arrays must have passed ``check_block_ids`` against their specs (1-D int64,
        distinct, in range); ``num_tokens`` is checked here (BlockIdError)."""
        g = self._chunk
        n = request_tokens(self._specs[0], src_ids, self._specs[1], dst_ids, num_tokens) // g
        s, d = self._src, self._dst
        return PairCopy(Side(s.bases, src_ids, s.stride, s.block_size, s.ts, s.hs, s.head, 0, s.bits),
                        Side(d.bases, dst_ids, d.stride, d.block_size, d.ts, d.hs, d.head, 0, d.bits),
                        self._runs * n, n, g, self._heads, self._vb)


def _wire_side(dst: KVSpec, chunk: int, heads: int, staging: int) -> Side:
    ts, hs = (heads, 1) if dst.layout is Layout.NHD else (1, chunk)
    return Side(None, None, chunk * heads * dst.vector_bytes, chunk, ts, hs, 0, staging)


def pack_pairs(src: KVSpec, src_geom: CacheGeometry, src_ids, dst: KVSpec, dst_ids,
               staging: int = 0, num_tokens: int | None = None) -> PairCopy:
    """Producer side of a staged transfer: source blocks -> staging at address ``staging``, in wire order.

    The staging image is in the destination's layout, so ``unpack_pairs`` on the other side
    needs only head offsets. Only ``dst``'s spec and id count matter here, not its addresses.
    """
    ov, s_ids, d_ids, chunk, n = _shape(src, src_ids, dst, dst_ids, num_tokens)
    return PairCopy(_cache_side(src, src_geom, s_ids, ov.src_head), _wire_side(dst, chunk, ov.heads, staging),
                    src.num_layers * src.kv_count * n, n, chunk, ov.heads, src.vector_bytes)


def unpack_pairs(src: KVSpec, src_ids, dst: KVSpec, dst_geom: CacheGeometry, dst_ids,
                 staging: int = 0, num_tokens: int | None = None) -> PairCopy:
    """Consumer side of a staged transfer: staging at address ``staging`` -> destination blocks."""
    ov, s_ids, d_ids, chunk, n = _shape(src, src_ids, dst, dst_ids, num_tokens)
    return PairCopy(_wire_side(dst, chunk, ov.heads, staging), _cache_side(dst, dst_geom, d_ids, ov.dst_head),
                    src.num_layers * src.kv_count * n, n, chunk, ov.heads, src.vector_bytes)
