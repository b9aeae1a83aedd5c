"""Prepared descriptor lists of whole blocks, for small direct reads (layer: engine; never nixl, zmq or the agent).

A direct read posts descriptor rows that the backend turns into transfer lists on every post
(NIXL's ``initialize_xfer``). Where the layout plan between two caches moves every block as one
piece per region (same layout, heads and block size on both sides: one row per region and block),
both caches' per-block rows can be prepared once (``Backend.prepare``, NIXL's
``prep_xfer_dlist``) and a read posted as two index arrays (``post_prepared``,
``make_prepped_xfer``), as vLLM's NixlConnector does: no rows built per read, and a cheaper
post (docs/benchmarks.md, "Busy engines"). Only small reads take it (at most
``PREPARED_DESCRIPTORS`` descriptors) without a run of blocks adjacent on both sides: the others
keep the plan's rows, which join such runs into fewer descriptors. Caches of more than ``PREPARED_ROWS`` rows a side are not
prepared (preparing costs time and memory in NIXL). A cache on the GPU is not prepared: its
direct reads cross hosts in large pieces, and its same-host reads take the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PREPARED_DESCRIPTORS", "PREPARED_ROWS", "PreparedBlocks", "PreparedRequest", "prepare_blocks",
           "prepared_descriptors"]

PREPARED_DESCRIPTORS = 1024   # a read of at most this many descriptors (regions x blocks) is posted prepared
# rows a side (regions x blocks) prepared at most: larger caches post rows. 65,536 rows took ~1 ms
# to prepare a side on the CI host; this bound, a few ms and a few MiB of NIXL's memory
PREPARED_ROWS = 1 << 18


@dataclass(frozen=True)
class PreparedRequest:
    """A read's move as indices into prepared lists (a ``RequestPlan`` stand-in for ``DirectJob``)."""

    local: np.ndarray     # indices into the local list
    remote: np.ndarray    # indices into the remote list
    num_bytes: int
    lists: "PreparedBlocks"
    staging_bytes: int = 0
    build_maps: object = None


class PreparedBlocks:
    """Both caches' per-block rows, prepared once in the backend for one peer (``prepare_blocks``)."""

    def __init__(self, backend, peer: str, local_id: int, remote_id: int, regions: int, local_blocks: int,
                 remote_blocks: int, block_bytes: int) -> None:
        self._backend, self.peer = backend, peer
        self.local_id, self.remote_id = local_id, remote_id
        regions = np.arange(regions, dtype=np.int64)[:, None]
        self._local_rows, self._remote_rows = regions * local_blocks, regions * remote_blocks  # each region's first row
        self._bytes = block_bytes

    def request(self, local: np.ndarray, remote: np.ndarray) -> PreparedRequest:
        """The move of ``local[i] <- remote[i]`` (checked ids, whole blocks, one block each)."""
        li = (self._local_rows + local).reshape(-1)
        ri = (self._remote_rows + remote).reshape(-1)
        return PreparedRequest(li, ri, li.size * self._bytes, self)

    def close(self) -> None:
        for prep in (self.local_id, self.remote_id):
            try:
                self._backend.unprepare(prep)
            except Exception:  # noqa: BLE001 - the backend or the peer is gone: NIXL freed them with it
                pass


def prepared_descriptors() -> int:
    """The largest read (descriptors: regions x blocks) posted through prepared lists."""
    return PREPARED_DESCRIPTORS


def _rows(geometry, spec) -> np.ndarray:
    """Every block of every region as one descriptor row, region-major ``[region * blocks + block]``."""
    bases = geometry.bases.reshape(-1, 1).astype(np.uint64)
    addr = (bases + np.arange(spec.num_blocks, dtype=np.uint64) * np.uint64(spec.block_stride)).reshape(-1)
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addr, spec.block_bytes, geometry.device
    return out


def _whole_blocks(plan, local, remote) -> bool:
    """Whether ``plan`` moves each block as one piece per region, region k to region k: checked
    on two blocks of each side (the plan's rows are linear in the ids)."""
    ls, rs = local.spec, remote.spec
    if ls.block_bytes != rs.block_bytes or ls.block_size != rs.block_size or local.geometry.bases.shape != \
            remote.geometry.bases.shape or min(ls.num_blocks, rs.num_blocks) < 4:
        return False
    try:
        req = plan.for_request(np.array([0, 2]), np.array([1, 3]))
    except Exception:  # noqa: BLE001 - any plan that cannot say is not whole blocks
        return False
    if getattr(req, "staging_bytes", 1) or req.local.shape[0] != 2 * local.geometry.bases.size:
        return False
    lb = local.geometry.bases.reshape(-1).astype(np.uint64)
    rb = remote.geometry.bases.reshape(-1).astype(np.uint64)
    want = {(int(lb[k] + lblk * ls.block_stride), int(rb[k] + rblk * rs.block_stride))
            for k in range(lb.size) for lblk, rblk in ((0, 1), (2, 3))}
    got = {(int(lr[0]), int(rr[0])) for lr, rr in zip(req.local, req.remote)}
    sizes = set(req.local[:, 1].tolist()) | set(req.remote[:, 1].tolist())
    return got == want and sizes == {ls.block_bytes}


def prepare_blocks(backend, plan, local, remote, peer: str) -> PreparedBlocks | None:
    """Prepare both caches' per-block lists for reads from ``peer`` (``remote``: its ``CacheView``)
    into ``local`` along ``plan``; None where the plan is not whole blocks, a cache is too large,
    or the backend cannot prepare (the read then posts the plan's rows)."""
    if not hasattr(backend, "post_prepared") or not _whole_blocks(plan, local, remote):
        return None
    regions = local.geometry.bases.size
    if regions * max(local.spec.num_blocks, remote.spec.num_blocks) > PREPARED_ROWS:
        return None
    kind = local.geometry.kind
    local_id = backend.prepare(None, _rows(local.geometry, local.spec), kind)
    try:
        remote_id = backend.prepare(peer, _rows(remote.geometry, remote.spec), remote.geometry.kind)
    except Exception:
        backend.unprepare(local_id)
        raise
    return PreparedBlocks(backend, peer, local_id, remote_id, regions, local.spec.num_blocks,
                          remote.spec.num_blocks, local.spec.block_bytes)
