"""How a request's end reaches its handle when threads race, and nothing of one request's end
touches another's:

* a request failed by another thread (an abort) just after a progress pass found its bytes in
  ends with that failure (the pass that drained it completes its handle; before, the handle
  stayed pending for ever);
* the backstop: a handle whose request's end was lost completes a second after a poll saw it so,
  and never before (its ending thread may be completing it);
* a pass that meets an ended request late leaves a newer request of the same id alone;
* one error failing several requests names each one's own quarantined blocks;
* a request booked as the engine closes is refused, never left where ``close`` cannot find it."""

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import ORPHAN_GRACE, Part, TransferEngine
from kvxfer.errors import AbortedError, ClosedError
from kvxfer.types import Direction, MemKind


class Landed:
    """A backend transfer that has completed."""

    notifies = False
    num_bytes, descriptors = 64, 1

    def poll(self) -> bool:
        return True

    def cancel(self) -> bool:
        return True  # done: nothing it started writes any more


class NeverLands(Landed):
    """A posted transfer that never lands; cancelling it ends it at once."""

    def poll(self) -> bool:
        return False


def _posted(engine, clock, rid, blocks, job):
    [req] = engine.reserve_many([(rid, clock.now() + 10, blocks)], Direction.READ, granted=True)
    with engine.posting([req]):
        assert engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=job)], mode="direct", started=True)
    return req


def _engine():
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    clock = ManualClock()
    return TransferEngine(me, MemKind.VRAM, clock=clock), clock


def test_a_read_aborted_as_its_poll_finds_it_landed_fails_with_the_abort(monkeypatch):
    engine, clock = _engine()
    req = _posted(engine, clock, "r", [3], Landed())
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
def test_a_handle_whose_completion_was_lost_completes_a_second_after_a_poll_saw_it(monkeypatch, caplog):
    """The backstop: were an engine bug to end a request without completing its handle, a poll
    ``ORPHAN_GRACE`` after one first found it so completes it with the request's outcome (and
    logs the loss), so no handle is left pending for ever; before that the thread that ended
    the request may still be completing it, and nothing is done."""
    engine, clock = _engine()
    req = _posted(engine, clock, "r", [3], Landed())
    monkeypatch.setattr(engine, "_complete", lambda r: None)  # the completion is lost
    assert not req.handle.done() and req.finished and engine.in_flight() == 0
    assert not req.handle.done()  # the first poll that sees it: the ending thread may be at it
    clock.advance(ORPHAN_GRACE / 2)
    assert not req.handle.done() and "without completing" not in caplog.text
    clock.advance(ORPHAN_GRACE)
    assert req.handle.done()
    assert req.handle.wait(0).request_id == "r"  # it had succeeded: its stats, no error
    assert "without completing its handle" in caplog.text


def test_a_handle_completed_by_the_thread_that_ended_it_never_meets_the_backstop(caplog):
    """A poll that meets a request ended a moment ago, its handle not yet completed by the
    ending thread (a drain at the deadline, say), leaves it to that thread: no second
    completion, nothing logged."""
    engine, clock = _engine()
    req = _posted(engine, clock, "r", [3], NeverLands())
    engine.cancel("r", AbortedError("request 'r' aborted by the consumer"))
    clock.advance(20)  # past its deadline and the grace
    end = engine._drain(req, force=True)  # the ending thread, between the move and the completion
    assert req.finished and not req.handle._finished
    assert not req.handle.done()  # a poll now: left to that thread
    end()
    assert isinstance(req.handle.exception(), AbortedError)
    assert "without completing" not in caplog.text


def test_a_pass_that_meets_an_ended_request_late_leaves_its_retry_alone():
    """A progress pass works on a snapshot of the requests: one that ended meanwhile, and whose
    id the caller has already submitted again, must not take the new request out of the engine
    (before: the pass's drain took the id out of the table, so no pass, cancel or ``close``
    reached the retry; an awaiting caller waited for ever)."""
    engine, clock = _engine()
    first = _posted(engine, clock, "a", [3], NeverLands())
    engine.cancel("a", AbortedError("request 'a' aborted by the consumer"))
    with engine._lock:
        snapshot = list(engine._requests.values())  # a pass starts on another thread ...
    engine.progress()                               # ... while this one ends the request
    assert first.handle.done() and first.finished
    retry = _posted(engine, clock, "a", [3], NeverLands())
    engine._progress(snapshot)                      # the first pass goes on, with the ended request
    assert engine.has("a") and engine.in_flight() == 1
    assert engine.cancel("a", AbortedError("request 'a' aborted again"))  # still reachable
    engine.progress()
    assert retry.handle.done() and isinstance(retry.handle.exception(), AbortedError)


def test_one_error_failing_several_requests_names_each_ones_quarantined_blocks():
    """A step's reads failed with one error object: each quarantined request's error names its
    own blocks, and one that ended cleanly names none (before, they shared one attribute: the
    last writer's blocks, and a clean end reported as quarantined)."""
    engine, clock = _engine()

    class Stuck(NeverLands):
        def cancel(self) -> bool:
            return False  # not confirmed ended: its blocks stay quarantined

    reqs = [_posted(engine, clock, "q1", [1, 2], Stuck()), _posted(engine, clock, "q2", [5], Stuck()),
            _posted(engine, clock, "ok", [7], NeverLands())]
    error = AbortedError("the step was aborted")
    for req in reqs:
        engine.fail(req, error)
    clock.advance(11)  # past the deadlines and the grace: the stuck ones are quarantined
    engine.progress()
    got = {req.handle.request_id: getattr(req.handle.exception(), "quarantined_blocks", None) for req in reqs}
    assert got == {"q1": [1, 2], "q2": [5], "ok": None}
    assert all(isinstance(req.handle.exception(), AbortedError) for req in reqs)
    assert engine.quarantined() == {"q1": [1, 2], "q2": [5]}


def test_a_request_booked_as_the_engine_closes_is_refused_not_left_behind(monkeypatch):
    """``close`` fails every request it finds; one booked between its flag and its list of
    requests would be found by nobody (with no deadline, a handle pending for ever). Booking
    checks the flag again under the engine's lock, so it is refused instead."""
    engine, clock = _engine()
    checked = []
    real_lock = engine._lock

    class CloseOnEnter:  # ``close`` runs just after the booking's first check
        def __enter__(self):
            if not checked:
                checked.append(True)
                engine._closed = True  # what ``close`` does first
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    monkeypatch.setattr(engine, "_lock", CloseOnEnter())
    with pytest.raises(ClosedError):
        engine.reserve_many([("late", None, [3])], Direction.READ, granted=True)
    monkeypatch.setattr(engine, "_lock", real_lock)
    assert engine.in_flight() == 0
