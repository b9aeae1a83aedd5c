"""Per-request work must not grow with the number of blocks in Python (issue: small requests at
link speed). Counts the Python calls the calling thread makes for one ``read`` + ``wait`` at 64
and at 4,096 fragmented blocks: numpy does the per-block work, so the counts must be equal
within a small margin. A count, not a timing. Waiting code that polls (the side channel's
reply, locks, events) makes more calls on a slow machine and is left out; each size takes the
least of three reads, with the garbage collector off (a collection runs other objects'
finalizers on this thread)."""

import gc
import sys

import numpy as np

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
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_read_makes_as_many_calls_for_4096_blocks_as_for_64(harness):
    s = spec(num_blocks=8192, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    rng = np.random.default_rng(0)

    def least_calls(n: int, reads: int = 3) -> int:
        best = None
        for i in range(reads):
            src, dst = rng.permutation(s.num_blocks)[:n], rng.permutation(s.num_blocks)[:n]
            rid = f"r{n}-{i}"
            prod.hold(rid, src)
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
