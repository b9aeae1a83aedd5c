"""Per-peer piece templates: which byte ranges of one "unit" of tokens move where (layer: layout, pure; numpy only, no nixl/zmq/torch).

A *unit* is ``max(local.block_size, remote.block_size)`` tokens: a whole number of blocks on
both sides. Inside one region (one layer's K or V) and one unit, the heads a plan moves form
``unit_tokens * num_heads`` head vectors. Each vector has a place on both sides:
``(block index within the unit, vector offset within that block)``, where the offset is
``token * heads_per_rank + head`` for NHD and ``head * block_size + token`` for HND.

A template lists the *pieces* of one unit in the remote's native order; every request then
repeats it over its units and regions (see ``request.py``). Templates are built once per peer,
so loops and sorting over one unit's vectors are fine here.

Where either side keeps K dim-major (``KVSpec.k_dim_chunk``), a head vector of K is not
contiguous: templates for K (``kv=0``) then count in *sub-vectors* of ``grain`` elements (the
largest run contiguous on both sides, ``sub_vector``), each token's vector being ``head_dim //
grain`` of them. Templates for V, and for K when both sides are token-major, count whole vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np

from kvxfer.layout.spec import KVSpec, Storage

__all__ = ["PieceTemplate", "UnpackTemplate", "direct_template", "staged_template", "sub_vector", "unit_vectors"]


@dataclass(frozen=True)
class PieceTemplate:
    """Pieces of one unit of one region; all arrays have one entry per piece.

    ``l_blk``/``r_blk``: block index within the unit; ``l_off``/``r_off``: byte offset within
    that block; ``length``: bytes. For staged templates the local columns are unused and
    ``l_off`` is the piece's byte offset inside the unit's staging chunk.
    """

    l_blk: np.ndarray
    l_off: np.ndarray
    r_blk: np.ndarray
    r_off: np.ndarray
    length: np.ndarray

    @property
    def count(self) -> int:
        return int(self.length.shape[0])

    @property
    def bytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class UnpackTemplate:
    """Where each moved vector of a staging chunk goes (staged plans only).

    ``src``: vector index inside the unit's chunk; ``dst_blk``: local block index within the
    unit; ``dst_vec``: vector offset within that local block. ``chunk_vectors``: chunk size.
    ``vector_bytes``: the unit every index counts (a head vector, or a sub-vector of a K that
    either side keeps dim-major).
    """

    src: np.ndarray
    dst_blk: np.ndarray
    dst_vec: np.ndarray
    chunk_vectors: int
    vector_bytes: int


def sub_vector(local: KVSpec, remote: KVSpec, kv: int) -> int:
    """Elements of the unit templates of region ``kv`` count in: the largest run of one token's
    head vector contiguous on both sides (``head_dim`` unless a side keeps K dim-major)."""
    return math.gcd(local.grain(kv), remote.grain(kv))


def _in_block_offset(spec: KVSpec, kv: int, grain: int, token: np.ndarray, head: np.ndarray,
                     part: np.ndarray) -> np.ndarray:
    """Offset, in sub-vectors of ``grain`` elements, within a block of ``spec``'s region ``kv``
    of part ``part`` of in-block ``token``'s vector of GLOBAL ``head``."""
    parts = spec.head_dim // grain
    vec = (head - spec.first_head) * spec.head_stride
    if spec.grain(kv) == spec.head_dim:   # token-major: the vector's parts follow one another
        return (token * spec.token_stride + vec) * parts + part
    per_chunk = spec.k_dim_chunk // grain  # dim-major K (HND): [head_dim // c, block_size, c]
    chunk, inner = np.divmod(part, per_chunk)
    return vec * parts + (chunk * spec.block_size + token) * per_chunk + inner


def unit_vectors(local: KVSpec, remote: KVSpec, heads: tuple[int, int], kv: int = 1,
                 tokens: int | None = None) -> dict[str, np.ndarray]:
    """Every (sub-)vector of one unit of region ``kv``, sorted in the remote's memory order.

    ``tokens`` (default: the whole unit) keeps only the unit's first ``tokens`` tokens: the
    partial last unit of a request that ends inside a block.

    Returns int64 arrays ``l_blk, l_vec, r_blk, r_vec`` (block within unit, offset within block
    in units of ``sub_vector(local, remote, kv)`` elements) of length ``unit_tokens * heads * parts``.
    """
    unit = max(local.block_size, remote.block_size) if tokens is None else tokens
    grain = sub_vector(local, remote, kv)
    parts = local.head_dim // grain
    n_heads = heads[1] - heads[0]
    token = np.repeat(np.arange(unit, dtype=np.int64), n_heads * parts)
    head = np.tile(np.repeat(np.arange(heads[0], heads[1], dtype=np.int64), parts), unit)
    part = np.tile(np.arange(parts, dtype=np.int64), unit * n_heads)
    l_blk, l_tok = np.divmod(token, local.block_size)
    r_blk, r_tok = np.divmod(token, remote.block_size)
    v = {
        "l_blk": l_blk,
        "l_vec": _in_block_offset(local, kv, grain, l_tok, head, part),
        "r_blk": r_blk,
        "r_vec": _in_block_offset(remote, kv, grain, r_tok, head, part),
    }
    order = np.lexsort((v["r_vec"], v["r_blk"]))
    return {k: a[order] for k, a in v.items()}


def _starts(breaks: np.ndarray) -> np.ndarray:
    """Indices where a new run begins, given a bool array of 'breaks from the previous'."""
    breaks = breaks.copy()
    breaks[0] = True
    return np.flatnonzero(breaks)


def _step_breaks(blk: np.ndarray, vec: np.ndarray) -> np.ndarray:
    """True where element i does not continue element i-1 in memory (other block or a gap)."""
    out = np.ones(blk.shape, dtype=bool)
    out[1:] = (blk[1:] != blk[:-1]) | (vec[1:] != vec[:-1] + 1)
    return out


def direct_template(local: KVSpec, remote: KVSpec, heads: tuple[int, int], kv: int = 1,
                    tokens: int | None = None) -> PieceTemplate:
    """Maximal pieces of region ``kv`` that are contiguous on BOTH sides (runs in the remote's order).
    ``kv`` matters only where a side keeps K dim-major; K and V are alike otherwise. ``tokens``:
    as ``unit_vectors`` (a partial unit)."""
    v = unit_vectors(local, remote, heads, kv, tokens)
    brk = _step_breaks(v["l_blk"], v["l_vec"]) | _step_breaks(v["r_blk"], v["r_vec"])
    s = _starts(brk)
    n = np.diff(np.append(s, brk.shape[0]))
    vb = sub_vector(local, remote, kv) * local.itemsize
    return PieceTemplate(
        l_blk=v["l_blk"][s], l_off=v["l_vec"][s] * vb,
        r_blk=v["r_blk"][s], r_off=v["r_vec"][s] * vb, length=n * vb,
    )


def staged_template(local: KVSpec, remote: KVSpec, heads: tuple[int, int],
                    min_piece_bytes: int, kv: int = 1,
                    tokens: int | None = None) -> tuple[PieceTemplate, UnpackTemplate, bool]:
    """Remote pieces of region ``kv`` in native order feeding a staging chunk, and the unpack map.

    Runs of needed vectors that are contiguous in the remote block become pieces. When any
    run is shorter than ``min_piece_bytes`` the plan *over-reads*: one piece per remote block
    spanning its first to its last needed vector (the unneeded vectors between them land in
    staging and are never unpacked). ``tokens``: as ``unit_vectors`` (a partial unit; an
    over-read then may read remote bytes past the last token, never write local ones).
    Returns ``(pieces, unpack, over_read)``.
    """
    v = unit_vectors(local, remote, heads, kv, tokens)
    vb = sub_vector(local, remote, kv) * local.itemsize
    s = _starts(_step_breaks(v["r_blk"], v["r_vec"]))
    n = np.diff(np.append(s, v["r_blk"].shape[0]))
    # Over-reading a head_packed block would span the other region's interleaved heads and
    # make K and V pieces overlap; read those per head instead.
    over_read = (bool(n.min() * vb < min_piece_bytes) and int(np.unique(v["r_blk"]).size) < int(s.size)
                 and remote.storage is not Storage.HEAD_PACKED)
    if over_read:
        s = _starts(np.concatenate(([True], v["r_blk"][1:] != v["r_blk"][:-1])))
        last = np.append(s[1:], v["r_blk"].shape[0]) - 1
        n = v["r_vec"][last] - v["r_vec"][s] + 1
    chunk_start = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
    piece_of = np.cumsum(np.isin(np.arange(v["r_blk"].shape[0]), s)) - 1
    src = chunk_start[piece_of] + v["r_vec"] - v["r_vec"][s][piece_of]
    pieces = PieceTemplate(
        l_blk=np.zeros_like(s), l_off=chunk_start * vb,
        r_blk=v["r_blk"][s], r_off=v["r_vec"][s] * vb, length=n * vb,
    )
    unpack = UnpackTemplate(src=src, dst_blk=v["l_blk"], dst_vec=v["l_vec"], chunk_vectors=int(n.sum()),
                            vector_bytes=vb)
    return pieces, unpack, over_read
