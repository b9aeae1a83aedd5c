"""Test oracle for the GPU path: an independent, element-level view of a cache (tests only; numpy)."""

from __future__ import annotations

import numpy as np

from kvxfer.layout.spec import CacheGeometry, KVSpec, Layout


def element_view(spec: KVSpec, memory: np.ndarray, geom: CacheGeometry) -> np.ndarray:
    """A ``[layers, kv, blocks, tokens, heads, head_dim]`` view of a cache whose regions are
    evenly spaced in ``memory`` (true of ``CacheGeometry.contiguous``). Elements are uint8 lanes
    of ``itemsize`` bytes each, so dtype does not matter."""
    mem = memory.reshape(-1).view(np.uint8)
    base = int(mem.ctypes.data)
    b = geom.bases.astype(np.int64)
    layer_stride = int(b[1, 0] - b[0, 0]) if spec.num_layers > 1 else 0
    kv_stride = int(b[0, 1] - b[0, 0]) if spec.kv_count > 1 else 0
    vb, isz = spec.vector_bytes, spec.itemsize
    if spec.layout is Layout.NHD:
        tok, head = spec.heads_per_rank * vb, vb
    else:  # head-major; K and V heads interleave in head_packed storage
        tok, head = vb, spec.block_size * vb * (2 if spec.storage.value == "head_packed" else 1)
    start = int(b[0, 0]) - base
    shape = (spec.num_layers, spec.kv_count, spec.num_blocks, spec.block_size,
             spec.heads_per_rank, spec.head_dim, isz)
    strides = (layer_stride, kv_stride, spec.block_stride, tok, head, isz, 1)
    return np.lib.stride_tricks.as_strided(mem[start:], shape=shape, strides=strides)


def expected_move(src: KVSpec, src_view: np.ndarray, src_ids, dst: KVSpec, dst_view: np.ndarray,
                  dst_ids, num_tokens: int) -> None:
    """Write into ``dst_view`` what a transfer of ``num_tokens`` tokens must leave there."""
    s_first, d_first = src.first_head, dst.first_head
    lo = max(s_first, d_first)
    hi = min(s_first + src.heads_per_rank, d_first + dst.heads_per_rank)
    if src.mla:
        lo, hi, s_first, d_first = 0, 1, 0, 0
    tok = np.arange(num_tokens)
    sb, so = np.asarray(src_ids)[tok // src.block_size], tok % src.block_size
    db, do = np.asarray(dst_ids)[tok // dst.block_size], tok % dst.block_size
    for g in range(lo, hi):
        dst_view[:, :, db, do, g - d_first] = src_view[:, :, sb, so, g - s_first]
