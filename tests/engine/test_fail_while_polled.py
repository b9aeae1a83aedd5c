"""A request failed by another thread (an abort) while a progress pass finds its bytes landed
ends with that failure: the pass that drained it also completes its handle. Before, the pass
tried to succeed it (no longer live: nothing happened) and dropped the drain's completion, so
the handle stayed pending for ever, past its deadline, with the request gone from the engine."""

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import AbortedError
from kvxfer.types import Direction, MemKind


class Landed:
    """A backend transfer that has completed."""

    notifies = False
    num_bytes, descriptors = 64, 1

    def poll(self) -> bool:
        return True

    def cancel(self) -> bool:
        return True  # done: nothing it started writes any more


def test_a_read_aborted_as_its_poll_finds_it_landed_fails_with_the_abort(monkeypatch):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    clock = ManualClock()
    engine = TransferEngine(me, MemKind.VRAM, clock=clock)
    [req] = engine.reserve_many([("r", clock.now() + 10, [3])], Direction.READ, granted=True)
    with engine.posting([req]):
        assert engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=Landed())], mode="direct",
                             started=True)
    poll = engine._poll

    def poll_then_abort(r):  # the abort comes in just after the poll found the bytes in
        landed = poll(r)
        engine.cancel("r", AbortedError("request 'r' aborted by the consumer"))
        return landed

    monkeypatch.setattr(engine, "_poll", poll_then_abort)
    engine.progress()
    assert req.handle.done(), "the request left the engine with its handle still pending"
    assert isinstance(req.handle.exception(), AbortedError)
    assert engine.in_flight() == 0 and not engine.quarantined()


@pytest.mark.lost_completion
def test_a_handle_whose_completion_was_lost_completes_by_its_deadline(monkeypatch, caplog):
    """The backstop: were an engine bug to end a request without completing its handle, the
    handle's next poll past its deadline and the grace completes it with the request's outcome
    (and logs the loss), so no handle is left pending for ever."""
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    clock = ManualClock()
    engine = TransferEngine(me, MemKind.VRAM, clock=clock)
    [req] = engine.reserve_many([("r", clock.now() + 10, [3])], Direction.READ, granted=True)
    with engine.posting([req]):
        assert engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=Landed())], mode="direct",
                             started=True)
    monkeypatch.setattr(engine, "_complete", lambda r: None)  # the completion is lost
    assert not req.handle.done() and req.finished and engine.in_flight() == 0
    clock.advance(9)
    assert not req.handle.done()  # before its deadline: the thread that ended it may still be at it
    clock.advance(2)
    assert req.handle.done()
    assert req.handle.wait(0).request_id == "r"  # it had succeeded: its stats, no error
    assert "without completing its handle" in caplog.text
