"""The backend's two executors (``kvxfer.engine.posted``): a direct transfer and a host-staged one.

Each is a ``Job``: ``cancel`` confirms only once the backend says the transfer ended, and a
staged job holds its staging range exactly as long as bytes may still land in it.
"""

import numpy as np
import pytest

from kvxfer.backend.base import descs
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.engine.posted import DirectJob, HostStagedJob, StagingBuffer
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import PeerLostError, TransferFailedError
from kvxfer.types import Direction, MemKind, Region

N = 4096


class _Plan:
    def __init__(self, local, remote, n, staging=0):
        self.local, self.remote, self.num_bytes, self.staging_bytes = local, remote, n, staging


def _world():
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    src = np.arange(N, dtype=np.uint32).view(np.uint8)[:N].copy()
    peer.register([Region(src.ctypes.data, N, 0, MemKind.DRAM)])
    return me, peer, me.add_peer(peer.metadata()), src


def _direct(me, name, dst, src):
    me.register([Region(dst.ctypes.data, N, 0, MemKind.DRAM)])
    plan = _Plan(descs([dst.ctypes.data], [N], 0), descs([src.ctypes.data], [N], 0), N)
    return DirectJob(me, Direction.READ, plan, MemKind.DRAM, name, MemKind.DRAM, b"note", "request 'r'")


def test_direct_job_moves_the_bytes_and_the_backend_carries_its_notification():
    me, peer, name, src = _world()
    dst = np.zeros(N, np.uint8)
    job = _direct(me, name, dst, src)
    assert job.notifies and (job.num_bytes, job.descriptors) == (N, 1)
    assert job.poll() and np.array_equal(dst, src)
    assert [m for _, m in peer.notifications()] == [b"note"]


def test_direct_job_cancel_is_not_confirmed_while_the_transfer_is_pending():
    me, _, name, src = _world()
    dst = np.zeros(N, np.uint8)
    me.hold_transfers(True)
    job = _direct(me, name, dst, src)
    assert job.cancel() is False and job.cancel() is False   # bytes may still arrive
    me.hold_transfers(False)
    assert job.cancel() is True and job.cancel() is True      # ended, idempotent


def test_direct_job_names_a_lost_peer_as_peer_lost():
    me, peer, name, src = _world()
    me.hold_transfers(True)
    job = _direct(me, name, np.zeros(N, np.uint8), src)
    peer.kill()
    me.hold_transfers(False)
    with pytest.raises(PeerLostError, match="request 'r'"):
        job.poll()


def _staged(me, name, src, area, unpacked):
    plan = _Plan(descs([0], [N], 0), descs([src.ctypes.data], [N], 0), N, staging=N)
    return HostStagedJob(me, Direction.READ, plan, MemKind.DRAM, name, MemKind.DRAM, b"n", "request 's'", area)


def _area(me, capacity, unpacked):
    buf = np.zeros(capacity, np.uint8)
    me.register([Region(buf.ctypes.data, capacity, 0, MemKind.DRAM)])
    alloc = StagingAllocator(capacity)
    unpack = lambda plan, addr: unpacked.append(buf[addr - buf.ctypes.data:][:plan.staging_bytes].copy())
    return StagingBuffer(buf.ctypes.data, alloc, unpack), alloc, buf


def test_staged_job_lands_in_its_range_unpacks_once_and_frees_the_range():
    me, _, name, src = _world()
    unpacked = []
    area, alloc, _buf = _area(me, 2 * N, unpacked)
    job = _staged(me, name, src, area, unpacked)
    assert alloc.in_use == N
    assert job.poll()
    assert len(unpacked) == 1 and np.array_equal(unpacked[0], src) and alloc.in_use == 0


def test_staged_job_waits_unposted_while_the_buffer_is_full_then_runs():
    me, _, name, src = _world()
    unpacked = []
    area, alloc, _buf = _area(me, N, unpacked)
    me.hold_transfers(True)
    first = _staged(me, name, src, area, unpacked)
    second = _staged(me, name, src, area, unpacked)
    assert second.waiting and not second.poll()                 # no range free: nothing posted
    me.hold_transfers(False)
    assert first.poll() and alloc.in_use == 0
    assert second.poll() and not second.waiting                 # posts now, and it lands
    assert len(unpacked) == 2 and alloc.in_use == 0


def test_staged_job_keeps_its_range_until_a_cancelled_transfer_ended():
    me, _, name, src = _world()
    area, alloc, _buf = _area(me, N, [])
    me.hold_transfers(True)
    job = _staged(me, name, src, area, [])
    assert job.cancel() is False and alloc.in_use == N          # bytes may still land in the range
    me.hold_transfers(False)
    assert job.cancel() is True and alloc.in_use == 0


def test_staged_job_refuses_a_part_larger_than_the_buffer_or_no_buffer():
    me, _, name, src = _world()
    area, alloc, _buf = _area(me, N // 2, [])
    with pytest.raises(TransferFailedError, match=f"needs {N} bytes; the staging buffer holds {N // 2}"):
        _staged(me, name, src, area, [])
    with pytest.raises(TransferFailedError, match="needs a staging buffer"):
        _staged(me, name, src, None, [])
    assert alloc.in_use == 0
