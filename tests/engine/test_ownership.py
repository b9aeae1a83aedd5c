"""The engine's ownership of a consumer's destination: a failed, cancelled or late request never
reports success, and its handle fails only once its transfers ended (else its blocks are quarantined)."""


import numpy as np
import pytest

from kvxfer.backend.base import descs
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import BlockIdError, PeerLostError, TransferFailedError, TransferTimeoutError
from kvxfer.types import Direction, MemKind, Region


class _Plan:
    """The two descriptor tables of a one-row request (what a layout RequestPlan carries)."""

    def __init__(self, local, remote, n):
        self.local, self.remote = local, remote
        self.num_bytes, self.staging_bytes = n, 0


def _pair(n=4096):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    dst, src = np.zeros(n, np.uint8), np.arange(n, dtype=np.uint8)
    me.register([Region(dst.ctypes.data, n, 0, MemKind.DRAM)])
    peer.register([Region(src.ctypes.data, n, 0, MemKind.DRAM)])
    name = me.add_peer(peer.metadata())
    plan = _Plan(descs([dst.ctypes.data], [n], 0), descs([src.ctypes.data], [n], 0), n)
    clock = ManualClock()
    reclaimed = []
    engine = TransferEngine(me, MemKind.DRAM, clock=clock, drain_grace=0.5, on_reclaimed=reclaimed.append)
    return engine, me, peer, name, plan, dst, src, clock, reclaimed


def _part(name, plan):
    return Part(name, plan, MemKind.DRAM, b"note")


def test_cancel_waits_for_the_transfer_to_end_before_the_handle_fails():
    engine, me, _, name, plan, dst, src, clock, _ = _pair()
    me.hold_transfers(True)  # the transfer stays in flight, as over a slow link
    handle = engine.submit("r", Direction.READ, [_part(name, plan)], timeout=10, blocks=[3])
    engine.cancel("r", TransferFailedError("aborted"))
    engine.progress()
    assert not handle.done()           # bytes may still land: the read has not ended
    me.hold_transfers(False)           # the transfer ends (its bytes land now, before the end)
    engine.progress()
    with pytest.raises(TransferFailedError, match="aborted"):
        handle.wait(0)
    settled = dst.copy()
    engine.progress()
    assert np.array_equal(dst, settled) and engine.counts().in_flight == 0


def test_unconfirmed_end_quarantines_the_blocks_until_the_backend_confirms():
    engine, me, _, name, plan, dst, src, clock, reclaimed = _pair()
    me.hold_transfers(True)
    handle = engine.submit("r", Direction.READ, [_part(name, plan)], timeout=1, blocks=[3, 5])
    clock.advance(1.2)
    engine.progress()                  # deadline passed: draining, not yet failed
    assert not handle.done()
    clock.advance(0.5)
    engine.progress()                  # grace over: fail, quarantine
    with pytest.raises(TransferTimeoutError) as info:
        handle.wait(0)
    assert info.value.quarantined_blocks == [3, 5]
    assert engine.quarantined() == {"r": [3, 5]} and engine.counts().quarantined_blocks == 2
    with pytest.raises(BlockIdError, match="quarantined"):
        engine.submit("s", Direction.READ, [_part(name, plan)], timeout=1, blocks=[5])
    # a step whose one read touches a quarantined block is refused whole, naming the block and its request
    with pytest.raises(BlockIdError, match=r"local block 3 is quarantined: request 'r'"):
        engine.reserve_many([("s0", None, [7, 8]), ("s1", None, [9, 3]), ("s2", None, [10])], Direction.READ)
    assert not any(engine.has(rid) for rid in ("s0", "s1", "s2"))
    assert [r.handle.request_id for r in engine.reserve_many([("s0", None, [7, 8]), ("s1", None, [9])],
                                                                Direction.READ)] == ["s0", "s1"]
    me.hold_transfers(False)
    engine.progress()
    assert reclaimed == ["r"] and engine.quarantined() == {}
    for rid in ("s0", "s1"):
        engine.cancel(rid, TransferFailedError("not needed"))
    engine.progress()
    assert engine.counts().in_flight == 0


def test_completion_after_the_window_is_a_failure_not_a_success():
    engine, me, _, name, plan, dst, src, clock, _ = _pair()
    me.hold_transfers(True)
    handle = engine.submit("r", Direction.READ, [_part(name, plan)], deadline=clock.now() + 1.0, blocks=[0])
    clock.advance(1.01)
    me.hold_transfers(False)  # done, but only observed after the window closed
    engine.progress()
    engine.progress()
    with pytest.raises(TransferTimeoutError):
        handle.wait(0)


def test_a_peer_lost_mid_transfer_is_peer_lost_with_the_backend_reason_chained():
    engine, me, peer, name, plan, dst, src, clock, _ = _pair()
    me.hold_transfers(True)
    handle = engine.submit("r", Direction.READ, [_part(name, plan)], timeout=10, blocks=[0])
    peer.kill()
    me.hold_transfers(False)  # the transport notices: the transfer ends FAILED
    engine.progress()
    engine.progress()
    with pytest.raises(PeerLostError) as info:
        handle.wait(0)
    assert info.value.__cause__ is not None


def test_success_inside_the_window_copies_every_byte():
    engine, me, _, name, plan, dst, src, clock, _ = _pair()
    handle = engine.submit("r", Direction.READ, [_part(name, plan)], timeout=10, blocks=[0])
    engine.progress()
    assert handle.wait(0).num_bytes == 4096 and np.array_equal(dst, src)
