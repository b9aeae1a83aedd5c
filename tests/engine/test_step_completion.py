"""A step's reads share one kernel: polling one read that completes also completes the others of
its launch that may complete (granted and posted), in one pass (the agent sends their done
notices together at its next whole pass: tests/engine/test_done_channel.py); while a waiter polls
a step's read itself, the progress thread leaves that step to it, and takes it back when the
waiter stops."""

import threading
import time

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.shared import SharedJob
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import TransferFailedError
from kvxfer.types import Direction, MemKind


class KernelJob:
    """Moves its own bytes (like an IPC kernel): done once ``finished`` is set; counts its polls."""

    notifies = False
    moves_itself = True

    def __init__(self):
        self.finished = threading.Event()
        self.polls = 0
        self.num_bytes, self.descriptors = 64, 1

    def poll(self) -> bool:
        self.polls += 1
        return self.finished.is_set()

    def cancel(self) -> bool:
        return True


def _step(n=4, granted=None, wake=None, on_end=None):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    engine = TransferEngine(me, MemKind.VRAM, clock=ManualClock(), wake=wake)
    job = KernelJob()
    shared = SharedJob(job, members=n)
    reqs = engine.reserve_many([(f"r{i}", None, [i]) for i in range(n)], Direction.READ, granted=False,
                               on_end=on_end)
    sent: list[str] = []

    def notice(rid):
        sent.append(rid)

    with engine.posting(reqs):
        for i, req in enumerate(reqs):
            part = Part("peer", None, MemKind.VRAM, b"", job=shared.member(16, 1),
                        on_done=lambda rid=f"r{i}": notice(rid))
            assert engine.attach(req, [part], mode="ipc", started=True, group=reqs)
    for i, req in enumerate(reqs):
        if granted is None or i in granted:
            engine.grant(req)
    return engine, job, reqs, sent


def test_polling_one_read_of_a_step_completes_every_granted_read_of_its_launch():
    engine, job, reqs, sent = _step(4, granted={0, 1, 3})
    job.finished.set()
    assert reqs[0].handle.done()                      # one poll, nobody else polling
    assert [r.finished for r in reqs[1:]] == [True, False, True]  # completed by that one poll
    assert sorted(sent) == ["r0", "r1", "r3"]
    assert not reqs[2].finished                       # not granted: its bytes may not count yet
    engine.grant(reqs[2])
    assert reqs[2].handle.done() and sent[-1] == "r2"
    assert engine.in_flight() == 0


def test_a_steps_reads_completed_together_are_reported_once_before_their_callbacks():
    """``on_end`` (the agent's reports) runs once for the reads one poll completes, after every one
    of their handles is complete and before any of their done-callbacks; a read that ends later
    (here: failed) gets its own call."""
    seen: list = []

    def on_end(handles):
        seen.append(("end", [h.request_id for h in handles], [h.done() for h in handles]))

    engine, job, reqs, _ = _step(4, granted={0, 1, 2}, on_end=on_end)
    for r in reqs:
        r.handle.add_done_callback(lambda h: seen.append(("callback", h.request_id)))
    job.finished.set()
    assert reqs[0].handle.done()
    assert seen == [("end", ["r0", "r1", "r2"], [True, True, True]),
                    ("callback", "r0"), ("callback", "r1"), ("callback", "r2")]
    engine.cancel("r3", TransferFailedError("aborted"))
    engine.progress()
    assert reqs[3].handle.done() and seen[-2:] == [("end", ["r3"], [True]), ("callback", "r3")]


def test_a_report_that_raises_is_logged_and_the_reads_still_complete_with_their_callbacks(caplog):
    """``on_end`` raising (an agent bug) leaves nothing pending: every handle is complete and its
    own done-callbacks run; the error is logged with its traceback."""
    import logging

    def on_end(handles):
        raise RuntimeError("report bug")

    engine, job, reqs, _ = _step(2, on_end=on_end)
    ran = []
    for r in reqs:
        r.handle.add_done_callback(lambda h: ran.append(h.request_id))
    job.finished.set()
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        assert reqs[0].handle.done()
    assert all(r.handle.done() for r in reqs) and ran == ["r0", "r1"]
    assert any("report bug" in (rec.exc_text or "") for rec in caplog.records)
    assert engine.in_flight() == 0


def test_a_step_whose_kernel_is_still_running_completes_nothing():
    engine, job, reqs, sent = _step(3)
    assert not reqs[1].handle.done()
    engine.progress()
    assert not any(r.finished for r in reqs) and sent == []
    job.finished.set()
    time.sleep(0.001)  # a shared job reuses its "not done" answer for 50 us (one pass asks it once)
    engine.progress()
    assert all(r.finished for r in reqs) and sorted(sent) == ["r0", "r1", "r2"]


def test_the_progress_thread_leaves_a_watched_step_to_its_waiter_and_takes_it_back():
    woken = threading.Event()
    engine, job, reqs, sent = _step(3, wake=woken.set)
    assert engine.moving() == 1
    reqs[1].handle._watched += 1                      # a waiter spinning on one read of the step
    before = job.polls
    engine.progress()
    assert job.polls == before and engine.moving() == 0  # nobody else polls the step's kernel
    reqs[1].handle._watched -= 1
    assert engine.moving() == 1
    # a real waiter: it spins for a while, then hands the request back and wakes the progress thread
    from kvxfer.errors import WaitTimeout
    try:
        reqs[1].handle.wait(0.01)
    except WaitTimeout:
        pass
    assert woken.is_set() and reqs[1].handle._watched == 0
    job.finished.set()
    time.sleep(0.001)
    engine.progress()
    assert all(r.finished for r in reqs)


def _reserved(n, verify=None):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    engine = TransferEngine(me, MemKind.VRAM, clock=ManualClock())
    job = KernelJob()
    shared = SharedJob(job, members=n)
    reqs = engine.reserve_many([(f"r{i}", None, [i]) for i in range(n)], Direction.READ, granted=False)
    parts = [[Part("peer", None, MemKind.VRAM, b"", job=shared.member(16 * (i + 1), i + 1))] for i in range(n)]
    return engine, job, reqs, parts


def test_a_step_attached_and_granted_in_one_pass_completes_in_one_poll_each_with_its_own_stats():
    from kvxfer.errors import LeaseExpiredError

    engine, job, reqs, parts = _reserved(3)
    reqs[1].verify = lambda: LeaseExpiredError("r1: the producer's hold word changed")  # a token read whose hold ended
    reqs[2].verify = lambda: None                                                      # one whose hold stood
    with engine.posting(reqs):
        engine.attach_step(reqs, parts, mode="ipc", setup_seconds=[0.1, 0.2, 0.3], grant=True)
    assert [r.granted for r in reqs] == [True, True, True]
    assert not reqs[0].handle.done()                  # the kernel still runs: nothing completes
    job.finished.set()
    time.sleep(0.001)
    assert reqs[0].handle.done() and reqs[2].finished  # one poll completes the step's others
    stats = [reqs[0].handle.wait(0), reqs[2].handle.wait(0)]
    assert [(s.num_bytes, s.descriptors, s.mode, s.setup_seconds) for s in stats] == [
        (16, 1, "ipc", 0.1), (48, 3, "ipc", 0.3)]
    assert reqs[1].error is not None and not reqs[1].finished  # its look failed: it drains, typed
    engine.progress()
    assert isinstance(reqs[1].handle.exception(), LeaseExpiredError)
    assert engine.in_flight() == 0


def test_a_step_read_that_failed_before_its_attach_keeps_its_part_until_the_shared_job_ended():
    from kvxfer.errors import TransferFailedError

    engine, job, reqs, parts = _reserved(2)
    with engine.posting(reqs):
        engine.cancel("r0", TransferFailedError("aborted by the engine"))  # while the launch is under way
        engine.attach_step(reqs, parts, mode="ipc", setup_seconds=[0.0, 0.0], grant=True)
    assert reqs[0].parts == parts[0] and reqs[1].granted and not reqs[0].granted
    engine.progress()
    assert not reqs[0].finished                        # the kernel may still write its blocks
    job.finished.set()
    time.sleep(0.001)
    engine.progress()
    assert isinstance(reqs[0].handle.exception(), TransferFailedError)
    assert reqs[1].handle.wait(0).num_bytes == 32
    assert engine.in_flight() == 0 and engine.quarantined() == {}


def test_attach_step_takes_running_parts_only():
    import pytest

    engine, _, reqs, _ = _reserved(1)
    with pytest.raises(ValueError, match="running parts only"):
        engine.attach_step(reqs, [[Part("peer", object(), MemKind.VRAM, b"")]], mode="ipc", setup_seconds=[0.0])
