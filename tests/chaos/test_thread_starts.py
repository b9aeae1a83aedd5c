"""The engine's thread never waits for one of kvxfer's threads to start (real processes, real NIXL).

``Thread.start()`` waits until the new thread has run, and with another thread busy in Python
that costs the caller a switch interval (5 ms) or more. A read whose producer's lane or
prepared lists need a new thread hands it to ``kvxfer.starter`` instead. Here every
``Thread.start`` call is recorded with the thread that made it: none may come from the thread
that calls ``read``/``read_many``/``wait``: reads from a fresh producer (its lane starts) and
from one connected before (its reads are routed on the caller's thread), whose first reads
start the preparation of their lists.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer import KVSpec, ReadRequest, starter
from kvxfer.testing import free_port_block

from chaos_peers import BIG, Peer, blocks_of, consumer, fill

SEED = 21


@pytest.fixture()
def starts(monkeypatch):
    """Records (starting thread's ident, new thread's name) for every ``Thread.start``."""
    seen: list[tuple[int, str]] = []
    real = threading.Thread.start

    def start(self):
        seen.append((threading.get_ident(), self.name))
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return seen


def test_reads_start_no_thread_on_the_callers_thread(starts):
    prods = [Peer(KVSpec(**BIG), SEED + k, wait=False) for k in range(2)]
    for prod in prods:
        prod.ready()
    agent, cache = consumer(KVSpec(**BIG), side_channel_port=free_port_block(1))
    me = threading.get_ident()
    try:
        rng = np.random.default_rng(4)
        src = rng.permutation(BIG["num_blocks"])[:64].reshape(16, 4)
        dst = rng.permutation(BIG["num_blocks"])[:64].reshape(16, 4)
        want = []
        for i in range(16):
            prod = prods[i // 8]
            prod.ask(("hold", f"t{i}", src[i].tolist(), None, False))
            fill(cache, dst[i])
            want.append(prod.ask(("blocks", src[i].tolist())))
        agent.connect(*prods[1].address)  # known before its first read: routed on this thread
        mine_before = sum(1 for ident, _ in starts if ident == me)
        for k, prod in enumerate(prods):  # a fresh link (its lane starts), a known one; then their lists
            first = 8 * k
            for i in range(first, first + 4):
                agent.read(prod.address, dst[i], src[i], f"t{i}", timeout=10).wait(15)
            handles = agent.read_many([ReadRequest(prod.address, dst[i], src[i], f"t{i}", timeout=10)
                                       for i in range(first + 4, first + 8)])
            for handle in handles:
                handle.wait(15)
        for i in range(16):
            for got, exp in zip(blocks_of(cache, dst[i]), want[i]):
                np.testing.assert_array_equal(got, exp)
        mine = [name for ident, name in starts if ident == me][mine_before:]
        assert mine == [], f"the caller's thread started {mine}"
        names = [name for _, name in starts]
        assert any(name.startswith("kvxfer-peer") for name in names), starts  # started, by the starter
        assert sum(1 for name in names if name.startswith("kvxfer-prepare")) == 2, starts
    finally:
        agent.close()
        for prod in prods:
            prod.stop()


def test_start_soon_runs_the_thread_and_join_started_waits_for_it():
    starter.ready()
    ran = threading.Event()
    thread = threading.Thread(target=ran.set, daemon=True)
    starter.start_soon(thread)
    starter.join_started(thread, 10)
    assert ran.is_set() and not thread.is_alive()
    never = threading.Thread(target=lambda: None)
    started = time.monotonic()
    starter.join_started(never, 0.05)  # never started: returns by its timeout, no error
    assert time.monotonic() - started < 5
