"""A request's waiter polls the request itself (``TransferHandle.wait`` / ``done``): a finished
request completes on the waiter's thread, exactly once, beside a progress thread or without one."""

import threading

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import TransferFailedError, TransferTimeoutError, WaitTimeout
from kvxfer.types import Direction, MemKind


class FlagJob:
    """Done once ``finished`` is set; fails with ``error`` if one is given; counts its polls."""

    notifies = False

    def __init__(self, error=None):
        self.finished = threading.Event()
        self.error, self.polls, self.cancelled = error, 0, 0
        self.num_bytes, self.descriptors = 64, 1

    def poll(self) -> bool:
        self.polls += 1
        if not self.finished.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True

    def cancel(self) -> bool:
        self.cancelled += 1
        return True


def _engine(clock=None):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    return TransferEngine(me, MemKind.VRAM, clock=clock or ManualClock()), peer


def _submit(engine, rid, job, on_done=None, timeout=10):
    part = Part("peer", None, MemKind.VRAM, f"note-{rid}".encode(), job=job, on_done=on_done)
    return engine.submit(rid, Direction.READ, [part], timeout=timeout, mode="ipc")


def test_wait_completes_a_finished_request_with_no_progress_thread():
    engine, peer = _engine()
    job = FlagJob()
    handle = _submit(engine, "r", job)
    assert not handle.done()
    job.finished.set()
    stats = handle.wait(1.0)       # nobody calls engine.progress(): the waiter's own poll completes it
    assert (stats.mode, stats.num_bytes) == ("ipc", 64)
    assert peer.notifications() == [("me", b"note-r")]
    assert engine.in_flight() == 0


def test_done_polls_once_and_never_raises():
    engine, _ = _engine()
    job = FlagJob(error=TransferFailedError("copy failed"))
    handle = _submit(engine, "r", job)
    assert not handle.done() and job.polls == 1
    job.finished.set()
    assert not handle.done()       # the failure is recorded; the progress step drains it
    engine.progress()
    assert handle.done()
    with pytest.raises(TransferFailedError, match="copy failed"):
        handle.wait(0)
    assert job.cancelled == 1


def test_wait_still_times_out_when_the_request_does_not_finish():
    engine, _ = _engine()
    job = FlagJob()
    handle = _submit(engine, "r", job)
    with pytest.raises(WaitTimeout, match="not complete within 0.01 s") as info:
        handle.wait(0.01)
    assert not isinstance(info.value, TransferTimeoutError)  # only the wait ran out, not the transfer
    assert job.polls >= 1 and not handle.done()


def test_a_waiter_and_the_progress_thread_complete_each_request_exactly_once():
    engine, peer = _engine()
    stop = threading.Event()

    def progress():
        while not stop.is_set():
            engine.progress()

    thread = threading.Thread(target=progress)
    thread.start()
    try:
        dones: list[str] = []
        lock = threading.Lock()
        for i in range(300):
            job = FlagJob()

            def on_done(rid=f"r{i}"):
                with lock:
                    dones.append(rid)

            handle = _submit(engine, f"r{i}", job, on_done=on_done)
            job.finished.set()
            assert handle.wait(5.0).num_bytes == 64
    finally:
        stop.set()
        thread.join()
    assert dones == [f"r{i}" for i in range(300)]   # each part's completion ran once, in order
    assert peer.notifications() == []               # on_done replaces the backend notification
    assert engine.in_flight() == 0


def test_the_deadline_holds_for_a_waiter_too():
    clock = ManualClock()
    engine, _ = _engine(clock)
    job = FlagJob()
    handle = _submit(engine, "r", job, timeout=5)
    clock.advance(6)
    job.finished.set()
    # completed after its window, and past the drain's grace: the waiter's own poll ends it
    # (no progress pass needed), with the reason
    assert handle.done()
    with pytest.raises(TransferTimeoutError, match="after its window closed"):
        handle.wait(0)


def test_await_completes_a_finished_request_with_no_progress_thread():
    import asyncio

    engine, peer = _engine()
    job = FlagJob()
    handle = _submit(engine, "r", job)
    job.finished.set()

    async def main():
        return await handle

    assert asyncio.run(main()).num_bytes == 64
    assert peer.notifications() == [("me", b"note-r")]
