"""Per-request work must not grow with the number of blocks in Python (issue: small requests at
link speed). Counts Python and C calls made by the calling thread for one ``read`` + ``wait`` at
64 and at 4,096 fragmented blocks: numpy does the per-block work, so the counts must be equal
within a small margin. A count, not a timing: it is exact on any machine, loaded or not."""

import sys

import numpy as np

from agent_helpers import spec


def _calls(fn) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
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
    counts = {}
    for n in (64, 64, 4096):  # the first read warms the link and the plan's per-peer tables
        src, dst = rng.permutation(s.num_blocks)[:n], rng.permutation(s.num_blocks)[:n]
        rid = f"r{n}-{len(counts)}"
        prod.hold(rid, src)
        counts[rid] = (n, _calls(lambda: cons.read(prod.address, dst, src, rid, timeout=10).wait(10)))
    (_, small), (_, big) = list(counts.values())[1:]
    assert big <= small * 1.1 + 20, f"{small} calls for 64 blocks, {big} for 4096: per-block Python work"
