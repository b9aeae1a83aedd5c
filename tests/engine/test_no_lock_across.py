"""The engine holds no request lock across a post, a launch or a callback (issue 34, rule 5).

A poster marks the request (``TransferEngine.posting``) instead of holding its lock: while one
request's post is stuck inside the backend, its grant, other requests' polls and completions go
on; and a handle's done-callbacks run with no lock of the engine held, so a callback may call
back into the agent (poll, read again) from any thread.
"""

import threading

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.types import Direction, MemKind


class Job:
    num_bytes, descriptors, notifies, moves_itself = 100, 1, False, True

    def __init__(self):
        self.finished = threading.Event()

    def poll(self) -> bool:
        return self.finished.is_set()

    def cancel(self) -> bool:
        return True


def _engine():
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    return TransferEngine(me, MemKind.VRAM, clock=ManualClock())


def _run(fn, timeout=5.0) -> bool:
    """Run ``fn`` on another thread; True if it returned within ``timeout``."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_a_stuck_post_blocks_neither_its_grant_nor_other_requests():
    engine = _engine()
    stuck, other = engine.reserve_many([("stuck", None, [1]), ("other", None, [2])], Direction.READ, granted=False)
    inside, back = threading.Event(), threading.Event()
    job = Job()

    def poster():  # inside a backend call that has not returned yet
        with engine.posting([stuck]):
            inside.set()
            back.wait(10)
            engine.attach(stuck, [Part("peer", None, MemKind.VRAM, b"", job=job)], started=True)

    thread = threading.Thread(target=poster)
    thread.start()
    try:
        assert inside.wait(5)
        assert _run(lambda: engine.grant(stuck))  # the claim's answer is taken meanwhile
        other_job = Job()
        other_job.finished.set()
        assert _run(lambda: engine.attach(other, [Part("peer", None, MemKind.VRAM, b"", job=other_job)],
                                          started=True))
        assert _run(lambda: engine.grant(other))
        assert _run(engine.progress)
        assert other.handle.done() and not stuck.handle.done()
    finally:
        back.set()
        thread.join(5)
    job.finished.set()
    engine.progress()
    assert stuck.handle.done()
    stuck.handle.wait(0)


def test_done_callbacks_run_with_no_engine_lock_held():
    engine = _engine()
    (req,) = engine.reserve_many([("r", None, [1])], Direction.READ, granted=False)
    job = Job()
    with engine.posting([req]):
        engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=job)], started=True)
    seen = []

    def callback(handle):
        # another thread must be able to take the request's lock while the callback runs
        seen.append(_run(lambda: (req.lock.acquire(), req.lock.release()), timeout=2))

    req.handle.add_done_callback(callback)
    engine.grant(req)
    job.finished.set()
    engine.progress()
    assert req.handle.done() and seen == [True]


def test_a_reads_seconds_include_a_post_that_moves_the_bytes_itself():
    """UCX over TCP may move a warm read's bytes inside the post call: the handle's
    ``stats.seconds`` must count from before the post (the post now runs unlocked, before the
    parts are attached; the stats once started at the attach and read ~0 s)."""
    import time

    import numpy as np

    from kvxfer.types import Region

    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    peer.register([Region(src.ctypes.data, src.nbytes, 0, MemKind.DRAM)])
    me.register([Region(dst.ctypes.data, dst.nbytes, 0, MemKind.DRAM)])
    real_post = me.post

    def slow_post(*args, **kwargs):  # a post that spends 50 ms moving the bytes
        time.sleep(0.05)
        return real_post(*args, **kwargs)

    me.post = slow_post
    engine = TransferEngine(me, MemKind.DRAM, clock=ManualClock())

    class Plan:  # one descriptor: the whole buffer
        staging_bytes = 0
        num_bytes = 4096
        local = np.array([[dst.ctypes.data, 4096, 0]], dtype=np.uint64)
        remote = np.array([[src.ctypes.data, 4096, 0]], dtype=np.uint64)

    handle = engine.submit("r", Direction.READ, [Part("peer", Plan(), MemKind.DRAM, b"")])
    engine.progress()
    stats = handle.wait(5)
    assert np.array_equal(dst, src)
    assert stats.seconds >= 0.05
