"""Engine parts that move their own bytes (the GPU paths' jobs): completion, notification, failure, cancel."""

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import TransferFailedError, TransferTimeoutError
from kvxfer.types import Direction, MemKind


class StepJob:
    """Finishes (or fails) after ``steps`` polls; records cancellation."""

    def __init__(self, steps: int, error=None):
        self.steps, self.error, self.cancelled, self.polls = steps, error, 0, 0
        self.num_bytes, self.descriptors = 1000, 3

    def poll(self) -> bool:
        self.polls += 1
        if self.polls < self.steps:
            return False
        if self.error is not None:
            raise self.error
        return True

    def cancel(self) -> bool:
        self.cancelled += 1
        return True


def _engine():
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    clock = ManualClock()
    return TransferEngine(me, MemKind.VRAM, clock=clock), peer, clock


def test_job_part_completes_then_notifies_the_peer_with_the_stats_of_the_job():
    engine, peer, _ = _engine()
    job = StepJob(3)
    handle = engine.submit("r", Direction.READ, [Part("peer", None, MemKind.VRAM, b"done-note", job=job)],
                           timeout=10, mode="ipc")
    engine.progress()
    assert not handle.done() and peer.notifications() == []   # done() polled it: the second poll
    assert job.polls == 2
    engine.progress()
    stats = handle.wait(0)
    assert (stats.mode, stats.num_bytes, stats.descriptors, stats.peers) == ("ipc", 1000, 3, 1)
    assert peer.notifications() == [("me", b"done-note")]   # what a NIXL read carries on completion
    assert job.cancelled == 0


def test_a_failing_job_fails_the_request_and_cancels_the_others_without_notifying():
    engine, peer, _ = _engine()
    bad, slow = StepJob(1, TransferFailedError("piece 3 failed")), StepJob(100)
    handle = engine.submit("r", Direction.READ, [Part("peer", None, MemKind.VRAM, b"a", job=slow),
                                                 Part("peer", None, MemKind.VRAM, b"b", job=bad)],
                           timeout=10, mode="staged")
    engine.progress()
    with pytest.raises(TransferFailedError, match="piece 3 failed"):
        handle.wait(0)
    assert slow.cancelled == 1 and peer.notifications() == []


def test_deadline_and_cancel_stop_the_job():
    engine, _, clock = _engine()
    job = StepJob(100)
    handle = engine.submit("r", Direction.READ, [Part("peer", None, MemKind.VRAM, b"n", job=job)],
                           timeout=5, mode="staged")
    clock.advance(6)
    engine.progress()
    with pytest.raises(TransferTimeoutError, match="0 of 1 parts"):
        handle.wait(0)
    assert job.cancelled == 1
    other = StepJob(100)
    h2 = engine.submit("r2", Direction.READ, [Part("peer", None, MemKind.VRAM, b"n", job=other)],
                       timeout=5, mode="staged")
    assert engine.cancel("r2", TransferFailedError("aborted"))
    engine.progress()  # the handle ends once the job is stopped (it cannot write any more)
    assert other.cancelled == 1 and h2.done()
