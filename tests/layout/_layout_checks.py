"""Shared helpers for the layout tests: run plans over real numpy buffers and check bytes."""

from __future__ import annotations

import numpy as np

from kvxfer.layout import CacheView, RequestPlan, TransferPlan
from kvxfer.layout.oracle import Arena, byte_addresses


def check_tables(req: RequestPlan) -> None:
    """Both tables are [N,3] uint64 with equal, positive per-row lengths summing to num_bytes."""
    assert req.local.dtype == np.uint64 and req.remote.dtype == np.uint64
    assert req.local.shape == req.remote.shape and req.local.shape[1:] == (3,)
    assert np.array_equal(req.local[:, 1], req.remote[:, 1])
    assert (req.local[:, 1] > 0).all()
    assert int(req.local[:, 1].sum()) == req.num_bytes


def assert_disjoint(rows: np.ndarray) -> None:
    """No two descriptors of a table overlap."""
    if rows.shape[0] < 2:
        return
    order = np.argsort(rows[:, 0], kind="stable")
    start, length = rows[order, 0], rows[order, 1]
    assert (start[1:] >= start[:-1] + length[:-1]).all(), "descriptors overlap"


def block_mask(view: CacheView, arena: Arena, block_ids) -> np.ndarray:
    """Bool mask of every byte of the given blocks (all heads, all regions)."""
    s = view.spec
    mask = np.zeros(arena.buf.size, dtype=bool)
    for layer in range(s.num_layers):
        for kv in range(s.kv_count):
            mask[byte_addresses(view, layer, kv, np.asarray(block_ids)) - arena.base] = True
    return mask


def rows_mask(rows: np.ndarray, arena: Arena) -> np.ndarray:
    """Bool mask of the bytes a descriptor table touches inside ``arena``."""
    mask = np.zeros(arena.buf.size, dtype=bool)
    for addr, n, _ in rows.tolist():
        mask[addr - arena.base: addr - arena.base + n] = True
    return mask


def check_staged_map(plan: TransferPlan, req: RequestPlan) -> None:
    """Staging is tiled exactly by the local rows; unpack targets are distinct per region."""
    if plan.mode != "host-staged":
        return
    offs = req.local[:, 0].astype(np.int64)
    ends = np.cumsum(req.local[:, 1].astype(np.int64))
    if offs.size:
        assert offs[0] == 0
    assert np.array_equal(offs[1:], ends[:-1]) and (ends[-1] if ends.size else 0) == req.staging_bytes
    for _, kv, src, dst in req.unpack_index():
        vb = req.unpack_map.unit_bytes(kv)   # a head vector, or a sub-vector of a dim-major K
        assert src.dtype == np.int64 and dst.dtype == np.int64
        assert np.unique(dst).size == dst.size
        assert src.min(initial=0) >= 0 and src.max(initial=0) * vb < max(req.staging_bytes, 1)
