"""``PeerLanes``: work queued per peer runs on that peer's own thread, in order, batched while the
lane is busy; a lane stuck on its peer never holds up another's work; a raising batch is failed
through ``crashed`` and the lane lives on."""

import threading
import time

import pytest

from kvxfer.agent.lanes import PeerLanes
from kvxfer.errors import ClosedError


def test_each_peers_work_runs_in_order_on_its_own_thread_and_batches_while_busy():
    seen: list = []
    gate = threading.Event()

    def run(key, items):
        seen.append((key, threading.current_thread().name, list(items)))
        if items == ["a0"]:
            gate.wait(5)  # busy: what is queued meanwhile comes as one batch

    lanes = PeerLanes("t", run)
    try:
        lanes.put("a", "a0")
        time.sleep(0.05)
        lanes.put_many("a", ["a1", "a2"])
        lanes.put("a", "a3")
        gate.set()
        deadline = time.monotonic() + 5
        while sum(len(items) for _, _, items in seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [items for _, _, items in seen] == [["a0"], ["a1", "a2", "a3"]]
        assert {name for _, name, _ in seen} == {"t-a"}
    finally:
        lanes.close()


def test_a_lane_stuck_on_its_peer_never_delays_another_lanes_work():
    stuck, done = threading.Event(), threading.Event()

    def run(key, items):
        if key == "frozen":
            stuck.wait(10)
        else:
            done.set()

    lanes = PeerLanes("t", run)
    try:
        lanes.put("frozen", 1)
        time.sleep(0.02)
        started = time.monotonic()
        lanes.put("healthy", 2)
        assert done.wait(1) and time.monotonic() - started < 0.5
        assert lanes.busy() == 2
    finally:
        stuck.set()
        lanes.close()


def test_a_batch_that_raises_is_failed_through_crashed_and_the_lane_goes_on():
    failed, ran = [], threading.Event()

    def run(key, items):
        if "boom" in items:
            raise RuntimeError("bug")
        ran.set()

    lanes = PeerLanes("t", run, crashed=lambda items, exc: failed.append((items, type(exc).__name__)))
    try:
        lanes.put("a", "boom")
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == [(["boom"], "RuntimeError")]
        lanes.put("a", "fine")
        assert ran.wait(5)
    finally:
        lanes.close()


def test_work_queued_after_close_is_a_closed_error():
    """A call that queues work on a lane as the agent closes under it (``abort(wait=False)``, a
    write, an announce) raises ``ClosedError``, as its docs say; kvxfer's own callers that drop
    such work still catch it as before."""
    lanes = PeerLanes("t", lambda key, items: None)
    lanes.close()
    with pytest.raises(ClosedError, match="closed"):
        lanes.put(("h", 1), object())
    with pytest.raises(RuntimeError):
        lanes.put_many(("h", 1), [object()])
