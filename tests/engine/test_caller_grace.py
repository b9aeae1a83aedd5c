"""The background driver leaves a read to the thread that submitted it for its first
``CALLER_GRACE`` (issue 34, rule 3: the critical path runs on the thread that asks), and a caller
that will not poll hands it over at once. Fake backend: these are the engine's and the driver's
own decisions, not transfers (the real-process reads are in tests/integration)."""

import types

import pytest

from kvxfer.agent.parts import Submitting
from kvxfer.agent.progress import DONE_DEFER, HOLDING_CADENCE, IDLE_CADENCE, drive_once
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine import transfers
from kvxfer.engine.transfers import CALLER_GRACE, Part, TransferEngine
from kvxfer.errors import TransferFailedError
from kvxfer.types import Direction, MemKind


class Job:
    """Done at its first poll; counts polls."""

    moves_itself = False

    def __init__(self):
        self.polls, self.num_bytes, self.descriptors = 0, 100, 1

    def poll(self) -> bool:
        self.polls += 1
        return True

    def cancel(self) -> bool:
        return True


def _engine(wake=None):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    return TransferEngine(me, MemKind.DRAM, clock=ManualClock(), wake=wake)


def _posted(engine, rid="r"):
    job = Job()
    (req,) = engine.reserve_many([(rid, None, None)], Direction.READ, caller_polls=True)
    assert engine.attach(req, [Part("peer", None, MemKind.DRAM, b"", job=job)], started=True)
    engine.submitted([req])  # read_many returns: its grace starts
    return req, job


def test_a_read_is_its_callers_while_the_submitting_call_works_on_it_then_for_the_grace():
    engine = _engine()
    job = Job()
    (req,) = engine.reserve_many([("r", None, None)], Direction.READ, caller_polls=True)
    assert engine.attach(req, [Part("peer", None, MemKind.DRAM, b"", job=job)], started=True)
    assert req.fresh_until == transfers.SUBMITTING
    level, fresh = engine.driver_view(leave_fresh=True)
    assert level == 0 and fresh == transfers.SUBMITTING  # no grace counted yet: the call is still on it
    engine.progress(leave_fresh=True)
    assert job.polls == 0
    engine.submitted([req])
    assert 0.0 < engine.driver_view(leave_fresh=True)[1] <= CALLER_GRACE
    req.fresh_until = 0.0  # the grace has passed
    engine.progress(leave_fresh=True)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100


def test_submitted_keeps_a_hand_over_made_meanwhile():
    engine = _engine()
    (req,) = engine.reserve_many([("r", None, None)], Direction.READ, caller_polls=True)
    req.handle.add_done_callback(lambda h: None)  # handed to the driver before the call returned
    engine.submitted([req])
    assert req.fresh_until == 0.0


def test_the_driver_leaves_a_fresh_read_to_its_caller_and_polls_it_once_the_grace_ends():
    engine = _engine()
    req, job = _posted(engine)
    level, fresh = engine.driver_view(leave_fresh=True)
    assert level == 0 and 0.0 < fresh <= CALLER_GRACE
    engine.progress(leave_fresh=True)
    assert job.polls == 0 and not req.handle._finished  # the driver did not touch it
    assert engine.driver_view(leave_fresh=False) == (2, 0.0)  # Agent.poll's view: a transfer to poll
    req.fresh_until = 0.0  # the grace has passed
    assert engine.driver_view(leave_fresh=True) == (2, 0.0)
    engine.progress(leave_fresh=True)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100


def test_an_engine_pass_and_a_poll_from_the_caller_never_wait_for_the_grace():
    engine = _engine()
    req, job = _posted(engine)
    engine.progress()  # Agent.poll's pass (an engine's own thread)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100
    req2, job2 = _posted(engine, "r2")
    assert req2.handle.done() and job2.polls == 1  # done() polls it on the caller's thread


def test_a_request_no_caller_polls_is_the_drivers_from_the_start():
    engine = _engine()
    req = engine.reserve("w", Direction.WRITE)  # a write: posted and polled off the caller's thread
    job = Job()
    assert engine.attach(req, [Part("peer", None, MemKind.DRAM, b"", job=job)], started=True)
    assert engine.driver_view(leave_fresh=True) == (2, 0.0)
    engine.progress(leave_fresh=True)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100


def test_a_fresh_read_that_failed_is_drained_by_the_driver_at_once():
    engine = _engine()
    (req,) = engine.reserve_many([("r", None, None)], Direction.READ, caller_polls=True)
    engine.fail(req, TransferFailedError("refused"))
    assert engine.driver_view(leave_fresh=True)[1] == 0.0  # not left to anyone
    engine.progress(leave_fresh=True)
    with pytest.raises(TransferFailedError, match="refused"):
        req.handle.wait(0)


def test_a_done_callback_or_an_await_hands_the_read_to_the_driver_at_once():
    woken = []
    engine = _engine(wake=lambda: woken.append(1))
    req, job = _posted(engine)
    req.handle._add_callback(lambda h: None)  # kvxfer's own callbacks keep the grace
    assert woken == [] and req.fresh_until > 0
    req.handle.add_done_callback(lambda h: None)  # a caller that will not poll
    assert woken == [1] and req.fresh_until == 0.0
    engine.progress(leave_fresh=True)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100


def test_a_callback_on_a_finished_handle_runs_at_once_and_wakes_nobody():
    woken = []
    engine = _engine(wake=lambda: woken.append(1))
    req, _ = _posted(engine)
    engine.progress()
    seen = []
    req.handle.add_done_callback(seen.append)
    assert seen == [req.handle] and woken == []


class _Paths:
    def pipelines_active(self) -> bool:
        return False


class _Backend:
    def __init__(self):
        self.asked = 0

    def notifications(self):
        self.asked += 1
        return []


class _Leases:
    def __init__(self, held: int):
        self.held, self.expired = held, 0

    def __len__(self) -> int:
        return self.held

    def expire(self) -> None:
        self.expired += 1


class _Done:
    def __init__(self):
        self.flushed = 0

    def flush(self) -> None:
        self.flushed += 1


def _driver_agent(engine, held=0):
    return types.SimpleNamespace(engine=engine, paths=_Paths(), backend=_Backend(), leases=_Leases(held), done=_Done(),
                                 clock=ManualClock(), expired_at=0.0, idle_swept_at=0.0, driven_at=0.0,
                                 flushed_at=0.0, submitting=Submitting(),
                                 config=types.SimpleNamespace(peer_idle_ttl=None), peers=None)


def test_the_driver_only_looks_while_every_read_is_left_to_its_caller_then_passes_on_its_cadence(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("kvxfer.agent.progress.time.monotonic", lambda: now[0])
    monkeypatch.setattr(transfers.time, "monotonic", lambda: now[0])
    engine = _engine()
    agent = _driver_agent(engine)
    busy, moving, rest = drive_once(agent, driver=True)  # nothing in flight, cadence due: a whole pass
    assert agent.backend.asked == 1 and rest == IDLE_CADENCE
    req, job = _posted(engine)
    busy, moving, rest = drive_once(agent, driver=True)
    assert (busy, moving, job.polls, agent.backend.asked, agent.done.flushed) == (False, 0, 0, 1, 1)  # only a look
    assert rest == pytest.approx(CALLER_GRACE)
    now[0] += CALLER_GRACE  # its grace ended and the caller did not poll: the driver's now
    busy, moving, rest = drive_once(agent, driver=True)
    assert job.polls == 1 and req.handle.wait(0).num_bytes == 100 and agent.backend.asked == 2
    assert agent.done.flushed == 2  # the done notices queued since go with the whole pass
    drive_once(agent)  # Agent.poll: always a whole pass
    assert agent.backend.asked == 3 and agent.done.flushed == 3


def test_an_agent_holding_requests_passes_on_the_shorter_cadence(monkeypatch):
    monkeypatch.setattr("kvxfer.agent.progress.time.monotonic", lambda: 50.0)
    agent = _driver_agent(_engine(), held=2)
    assert drive_once(agent, driver=True)[2] == HOLDING_CADENCE
    assert drive_once(agent, driver=True)[2] == pytest.approx(HOLDING_CADENCE)  # a look: the pass was just now
    assert agent.backend.asked == 1


def test_the_driver_defers_done_notices_while_a_call_submits_reads_at_most_done_defer(monkeypatch):
    now = [500.0]
    monkeypatch.setattr("kvxfer.agent.progress.time.monotonic", lambda: now[0])
    agent = _driver_agent(_engine())
    drive_once(agent, driver=True)
    assert agent.done.flushed == 1
    agent.submitting.enter()  # a read_many books and launches its step
    now[0] += IDLE_CADENCE
    drive_once(agent, driver=True)  # a whole pass on its cadence, but no flush
    assert agent.done.flushed == 1 and agent.backend.asked == 2
    drive_once(agent)  # Agent.poll, on the engine's own thread: flushes
    assert agent.done.flushed == 2
    now[0] += DONE_DEFER + 0.001
    drive_once(agent, driver=True)  # deferred long enough: flushed even while a call submits
    assert agent.done.flushed == 3
    agent.submitting.leave()
    now[0] += IDLE_CADENCE
    drive_once(agent, driver=True)
    assert agent.done.flushed == 4
