"""One read of a step aborted while its producer is frozen: the step's other reads, and every
other producer's, go on (per-peer independence).

Real processes, real NIXL (UCX forced to TCP, see conftest.py), real ZMQ and the express lane: a
step of two reads to a producer frozen by SIGSTOP, claimed on the caller's thread (one
``ClaimBatch``, one shared answer), then one read aborted. Its give-back takes the batch's answer
on the producer's lane and waits there for the frozen producer. Before the fix, the step's other
read then looked ready to every poller: the caller's ``done()`` and kvxfer's progress thread
queued behind the give-back until the claim's deadline, and a read from a healthy producer that
nobody polled completed only then (3.8 s in the audit's run, for a 4 s claim window). Now
``done()`` returns at once and the healthy read completes in milliseconds, its bytes exact.

docs/reliability.md lists it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from kvxfer import KVSpec, ReadRequest
from kvxfer.testing import free_port_block

from chaos_peers import BIG, Peer, blocks_of, consumer, freeze

TIMEOUT = 4.0


def test_an_abort_waiting_on_a_frozen_producer_holds_up_neither_the_step_nor_other_producers():
    spec = KVSpec(**BIG)
    healthy, frozen = Peer(spec, 1, wait=False), Peer(spec, 2, wait=False)
    healthy.ready(), frozen.ready()
    agent, cache = consumer(spec, side_channel_port=free_port_block(1), handshake_timeout=TIMEOUT)
    try:
        for peer, rid in ((frozen, "a"), (frozen, "b"), (healthy, "h"), (frozen, "w"), (healthy, "w2")):
            ids = {"a": [1, 2], "b": [3, 4], "h": [5, 6], "w": [7], "w2": [7]}[rid]
            peer.ask(("hold", rid, ids, None, False))
        agent.read(frozen.address, [100], [7], "w", timeout=10).wait(10)    # both peers known
        agent.read(healthy.address, [101], [7], "w2", timeout=10).wait(10)
        want = healthy.ask(("blocks", [5, 6]))
        freeze(frozen.pid)
        try:
            _, other = agent.read_many([ReadRequest(frozen.address, [10, 11], [1, 2], "a", timeout=TIMEOUT),
                                        ReadRequest(frozen.address, [12, 13], [3, 4], "b", timeout=TIMEOUT)])
            issued = time.monotonic()
            threading.Thread(target=agent.abort, args=("a",), daemon=True).start()  # abort may block: its API
            time.sleep(0.2)
            done_at: list[float] = []
            read = agent.read(healthy.address, [20, 21], [5, 6], "h", timeout=30)  # nobody polls it
            asked = time.monotonic()
            read.add_done_callback(lambda h: done_at.append(time.monotonic()))
            longest = 0.0
            while time.monotonic() - issued < 1.5:   # the caller polls its step's other read each step
                t0 = time.monotonic()
                other.done()
                longest = max(longest, time.monotonic() - t0)
                time.sleep(0.005)
            while not done_at and time.monotonic() - asked < 10:
                time.sleep(0.01)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert longest < 1.0, f"done() of the step's other read waited {longest:.2f} s on the frozen producer"
        assert done_at and done_at[0] - asked < 2.0, "the healthy producer's read waited for the frozen one"
        read.wait(0)
        for got, expected in zip(blocks_of(cache, [20, 21]), want):
            assert np.array_equal(got, expected)
    finally:
        agent.close()
        healthy.stop(), frozen.stop()
