"""Per-request work must not grow with the number of blocks in Python (issue: small requests at
link speed). Counts the Python calls the calling thread and the producer's lane thread (where the
claim and the post run) make for one ``read`` + ``wait`` at 64 and at 4,096 fragmented blocks: numpy does the per-block work, so the counts must be equal
within a small margin. A count, not a timing. Waiting code that polls (the side channel's
reply, locks, events) makes more calls on a slow machine and is left out; each size takes the
least of three reads, with the garbage collector off (a collection runs other objects'
finalizers on this thread). ``wait`` polls the request once instead of for up to
``SPIN_SECONDS``, whose number of polls also follows the clock."""

import gc
import itertools
import sys
import threading
import time

import numpy as np

import kvxfer.engine.handles as handles
from agent_helpers import spec


#: Waiting code whose call count follows the clock, not the request: the side channel's reply
#: polling and the standard library's locks and events.
_WAITING = ("/kvxfer/transport/", "/threading.py", "/selectors.py", "/zmq/")


def _calls(fn) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "call" and not any(part in frame.f_code.co_filename for part in _WAITING):
            n += 1

    sys.setprofile(prof)
    threading.setprofile(prof)  # the lane thread the read starts (see the test) is counted too
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return n


def test_read_makes_as_many_calls_for_4096_blocks_as_for_64(harness, monkeypatch):
    monkeypatch.setattr(handles, "SPIN_SECONDS", 0.0)
    s = spec(num_blocks=8192, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    rng = np.random.default_rng(0)
    cons._lanes._idle = 0.0  # each read's lane thread starts anew, under the profile hook
    ids = itertools.count()

    def least_calls(n: int, reads: int = 3) -> int:
        best = None
        for i in range(reads):
            src, dst = rng.permutation(s.num_blocks)[:n], rng.permutation(s.num_blocks)[:n]
            rid = f"r{n}-{next(ids)}"
            prod.hold(rid, src)
            until = time.monotonic() + 5
            while cons._lanes.busy() and time.monotonic() < until:
                time.sleep(0.001)
            gc.collect()
            gc.disable()
            try:
                calls = _calls(lambda: cons.read(prod.address, dst, src, rid, timeout=10).wait(10))
            finally:
                gc.enable()
            best = calls if best is None else min(best, calls)
        return best

    least_calls(64, 1)  # warms the link and the plan's per-peer tables
    small, big = least_calls(64), least_calls(4096)
    assert big <= small * 1.1 + 20, f"{small} calls for 64 blocks, {big} for 4096: per-block Python work"


def _lines(fn) -> int:
    """Python lines executed by ``fn`` (a loop in Python over blocks or holds shows here even
    when it calls nothing)."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        if event == "line":
            n += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def test_the_producers_claim_and_expire_run_as_many_lines_for_any_size():
    """The producer's side of a request: a claim of 4,096 held blocks runs as many Python lines as
    one of 64 (the ids are checked in C), and ``expire()`` with 5,000 idle holds as many as with
    10 (it looks only at holds that are due)."""
    from kvxfer.clock import ManualClock
    from kvxfer.engine.leases import LeaseTable

    def claim_calls(n: int) -> int:
        table = LeaseTable(480)
        ids = np.random.default_rng(n).permutation(8192)[:n]
        table.hold("r", ids, 8192)
        wanted = ids.tolist()  # a decoded Claim: the held ids in the consumer's order
        return _lines(lambda: table.claim("r", "consumer", wanted, 1, 5.0))

    def expire_calls(holds: int) -> int:
        clock = ManualClock()
        table = LeaseTable(480, clock=clock)
        for i in range(holds):
            table.hold(f"r{i}", [i % 1024], 1024)
        clock.advance(1.0)  # none is due
        return _lines(table.expire)

    small, large = claim_calls(64), claim_calls(4096)
    assert large <= small + 2, (small, large)
    few, many = expire_calls(10), expire_calls(5000)
    assert many <= few + 2, (few, many)
