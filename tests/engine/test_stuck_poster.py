"""A poster stuck inside a backend call never holds a handle past its deadline.

The poster of a request marks it (``TransferEngine.posting``) from before it posts until
``attach``, so the request cannot end meanwhile. If the backend's
call does not return (a transport hanging on a dead peer), the deadline must still end the
handle: once the deadline and the drain's grace have passed, any poller (the progress pass, a
waiter's ``done()``) fails it with its destination blocks quarantined, and what the poster
attaches afterwards is confirmed ended before the blocks are reported reclaimed.
"""

import threading

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import TransferTimeoutError
from kvxfer.types import Direction, MemKind


class RunningJob:
    """A job a stuck poster started: it may write until ``end`` is set."""

    num_bytes, descriptors, notifies, moves_itself = 1000, 1, False, True

    def __init__(self):
        self.end = threading.Event()

    def poll(self) -> bool:
        return False

    def cancel(self) -> bool:
        return self.end.is_set()


def _engine():
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    clock = ManualClock()
    reclaimed = []
    engine = TransferEngine(me, MemKind.VRAM, clock=clock, on_reclaimed=reclaimed.append)
    return engine, clock, reclaimed


@pytest.mark.parametrize("poller", ["progress", "done"])
def test_a_request_whose_poster_is_stuck_ends_by_its_deadline_and_its_late_parts_are_waited_for(poller):
    engine, clock, reclaimed = _engine()
    req = engine.reserve("r", Direction.READ, deadline=clock.now() + 1.0, blocks=[3, 4], granted=False)
    inside, back = threading.Event(), threading.Event()
    job = RunningJob()
    result = []

    def poster():  # marked as the request's poster inside a backend call that does not return, then attaches
        with engine.posting([req]):
            inside.set()
            back.wait(10)
            result.append(engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=job)], started=True))

    thread = threading.Thread(target=poster)
    thread.start()
    inside.wait(5)
    try:
        clock.advance(1.1)
        (engine.progress if poller == "progress" else req.handle.done)()
        assert not req.handle.done()  # inside the grace the poster may still come back
        clock.advance(0.25)
        (engine.progress if poller == "progress" else req.handle.done)()
        assert req.handle.done()
        with pytest.raises(TransferTimeoutError, match="still being posted|deadline passed") as err:
            req.handle.wait(0)
        assert err.value.quarantined_blocks == [3, 4]
        assert engine.quarantined() == {"r": [3, 4]}
    finally:
        back.set()
        thread.join(5)
    assert result == [False]  # attached to the quarantined request, not started anew
    engine.progress()
    assert reclaimed == [] and engine.quarantined() == {"r": [3, 4]}  # the late job may still write
    job.end.set()
    engine.progress()
    assert reclaimed == ["r"] and engine.quarantined() == {}
