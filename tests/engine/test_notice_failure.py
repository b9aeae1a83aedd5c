"""A read whose bytes arrived completes even when its done notice cannot be sent (the producer
died just after the move): the notice's failure is logged, never left to hang the handle.
Before, the request left the engine's table and its handle never completed."""

import logging

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import PeerLostError
from kvxfer.types import Direction, MemKind


class DoneJob:
    num_bytes, descriptors, notifies, moves_itself = 64, 1, False, True

    def poll(self) -> bool:
        return True

    def cancel(self) -> bool:
        return True


def _notice_to_a_dead_peer():
    raise PeerLostError("peer 'p' is gone (closed or killed)")


def test_a_read_completes_when_its_done_notice_cannot_be_sent(caplog):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    engine = TransferEngine(me, MemKind.VRAM, clock=ManualClock())
    part = Part("peer", None, MemKind.VRAM, b"", job=DoneJob(), on_done=_notice_to_a_dead_peer)
    with caplog.at_level(logging.WARNING, logger="kvxfer.engine"):
        handle = engine.submit("r", Direction.READ, [part], timeout=5, mode="ipc")
        engine.progress()
        stats = handle.wait(0)
    assert stats.num_bytes == 64
    assert engine.in_flight() == 0
    assert any("done notice to peer not sent" in r.message for r in caplog.records)
