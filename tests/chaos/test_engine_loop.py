"""Reads as an engine drives them: its own thread busy, stepping, polling once per step.

Real processes, real NIXL (UCX forced to TCP, or UCX's defaults with KVXFER_CHAOS_TLS=default),
real ZMQ. Every byte is checked; nothing here is timed (the busy-engine figures are in
``kvxfer bench --busy-engine``, docs/benchmarks.md):

* a producer whose main thread runs Python the whole time still serves every read exactly;
* a consumer that steps (a slice of Python, then ``Agent.poll()`` and ``handle.done()``) sees
  every read of its steps complete exactly, with no ``wait``;
* an aborted read fails with ``AbortedError``, the engine's own abort, not a producer's loss.

docs/reliability.md lists them.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvxfer import AbortedError, KVSpec, ReadRequest
from kvxfer.testing import free_port_block, spin_python

from chaos_peers import BIG, Peer, blocks_of, consumer, fill, freeze, idle, threads_now, wait_until

SEED = 21


def _stats(agent) -> dict:
    import dataclasses

    return dataclasses.asdict(agent.stats())


@pytest.fixture(scope="module")
def producer():
    prod = Peer(KVSpec(**BIG), SEED)
    yield prod
    prod.stop()


@pytest.mark.timeout(180)
def test_a_producer_whose_engine_thread_is_busy_serves_every_read_exactly(producer):
    agent, cache = consumer(KVSpec(**BIG), side_channel_port=free_port_block(1))
    rng = np.random.default_rng(1)
    n = 12
    src = rng.permutation(BIG["num_blocks"])[: n * 4].reshape(n, 4)
    dst = rng.permutation(BIG["num_blocks"])[: n * 4].reshape(n, 4)
    try:
        producer.ask(("hold_many", [(f"busy{i}", src[i].tolist()) for i in range(n)]))
        want = [producer.ask(("blocks", src[i].tolist())) for i in range(n)]
        agent.read(producer.address, dst[0], src[0], "busy0", timeout=10).wait(15)  # warm
        producer.cmd.put(("spin", 3.0))  # its main thread runs Python from now on
        time.sleep(0.05)
        for i in range(1, n):
            agent.read(producer.address, dst[i], src[i], f"busy{i}", timeout=10).wait(15)
        assert producer.out.get(timeout=30) is not None  # the spin ended: it was busy throughout
        for i in range(n):
            for got, exp in zip(blocks_of(cache, dst[i]), want[i]):
                np.testing.assert_array_equal(got, exp)
        assert wait_until(lambda: idle(_stats(agent)), 5), _stats(agent)
    finally:
        agent.close()


@pytest.mark.timeout(180)
def test_a_consumer_that_steps_and_polls_sees_every_read_exact(producer):
    agent, cache = consumer(KVSpec(**BIG), side_channel_port=free_port_block(1))
    rng = np.random.default_rng(2)
    steps, per_step = 6, 4
    n = steps * per_step
    src = rng.permutation(BIG["num_blocks"])[: n * 3].reshape(n, 3)
    dst = rng.permutation(BIG["num_blocks"])[: n * 3].reshape(n, 3)
    try:
        producer.ask(("reset",))
        producer.ask(("hold_many", [(f"step{i}", src[i].tolist()) for i in range(n)]))
        want = [producer.ask(("blocks", src[i].tolist())) for i in range(n)]
        agent.connect(*producer.address)
        fill(cache, dst.reshape(-1))
        pending: dict[int, object] = {}
        for s in range(steps):  # each step submits its loads, then polls the earlier ones
            batch = range(s * per_step, (s + 1) * per_step)
            handles = agent.read_many([ReadRequest(producer.address, dst[i], src[i], f"step{i}", timeout=10)
                                       for i in batch])
            pending.update(zip(batch, handles))
            spin_python(0.004)
            agent.poll()
            pending = {i: h for i, h in pending.items() if not h.done()}
        deadline = time.monotonic() + 15
        while pending and time.monotonic() < deadline:  # the engine keeps stepping until all are in
            spin_python(0.004)
            agent.poll()
            pending = {i: h for i, h in pending.items() if not h.done()}
        assert not pending, (f"reads not done after 15 s of steps (their timeout is 10 s): "
                             f"{ {f'step{i}': agent.status(f'step{i}').value for i in sorted(pending)} }, "
                             f"{_stats(agent)}\n{threads_now()}")
        received = agent.finished().received
        assert received == {f"step{i}" for i in range(n)}
        for i in range(n):
            for got, exp in zip(blocks_of(cache, dst[i]), want[i]):
                np.testing.assert_array_equal(got, exp)
    finally:
        agent.close()


@pytest.mark.timeout(120)
def test_an_aborted_read_fails_with_its_own_error_type(producer):
    agent, cache = consumer(KVSpec(**BIG), side_channel_port=free_port_block(1))
    try:
        producer.ask(("hold", "ab", [5, 6, 7], None, False))
        agent.connect(*producer.address)
        freeze(producer.pid)  # its claim stays unanswered until the abort
        try:
            handle = agent.read(producer.address, [1, 2, 3], [5, 6, 7], "ab", timeout=10)
            agent.abort("ab", wait=False)
            with pytest.raises(AbortedError, match="aborted by the consumer"):
                handle.wait(10)
        finally:
            os.kill(producer.pid, signal.SIGCONT)
        assert wait_until(lambda: producer.ask(("status", "ab")) == "aborted", 10)
        assert wait_until(lambda: idle(_stats(agent)), 5), _stats(agent)
    finally:
        agent.close()
