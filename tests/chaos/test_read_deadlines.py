"""A read's deadline binds, and a read refused for its own arguments leaves the producer alone.

Real processes, real NIXL (UCX forced to TCP, see conftest.py), real ZMQ:

* A producer SIGKILLed right after it granted a step's claims: every handle of the step ends by
  its read's deadline plus ``BOUND``, whatever the step's size, with the bytes exact or a typed
  error (before, each read's claim was given back with a blocking abort to the dead producer
  before its handle failed: k reads took k x the handshake timeout).
* A read whose local and remote lists cover different token counts fails typed, and the
  producer still holds the request: the same request then reads exactly (before, the claim sent
  ahead of the check was given back with an abort, which ended the producer's hold).

docs/reliability.md lists them.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import BlockIdError, KvxferError, KVSpec, ReadRequest
from kvxfer.testing import free_port_block

from chaos_peers import BIG, Peer, blocks_of, consumer, idle, wait_until

SEED = 5
#: How long after its deadline a handle may end: the engine's drain grace (0.25 s) and scheduling.
BOUND = 0.5


def _stats(agent) -> dict:
    import dataclasses

    return dataclasses.asdict(agent.stats())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reads", [1, 3, 8])
@pytest.mark.parametrize("known", [True, False], ids=["connected", "fresh"])
def test_every_handle_of_a_step_ends_by_its_deadline_when_the_producer_dies_after_granting(reads, known):
    spec = KVSpec(**{**BIG, "num_blocks": 64})
    prod = Peer(spec, SEED)
    agent, cache = consumer(spec, handshake_timeout=10, side_channel_port=free_port_block(1))
    try:
        src = np.arange(reads * 4).reshape(reads, 4) + 2
        dst = np.arange(reads * 4).reshape(reads, 4) + 30
        for i in range(reads):
            prod.ask(("hold", f"r{i}", src[i].tolist(), None, False))
        want = [prod.ask(("blocks", src[i].tolist())) for i in range(reads)]
        if known:
            agent.connect(*prod.address)
        prod.ask(("die_after_grant", 0.002))
        timeout = 2.0
        started = time.monotonic()
        handles = agent.read_many([ReadRequest(prod.address, dst[i], src[i], f"r{i}", timeout=timeout)
                                   for i in range(reads)])
        ended = {}
        while len(ended) < reads and time.monotonic() - started < timeout + 15:
            for i, handle in enumerate(handles):
                if i not in ended and handle.done():
                    ended[i] = time.monotonic() - started
            time.sleep(0.002)
        late = {i: round(t, 2) for i, t in ended.items() if t > timeout + BOUND}
        assert len(ended) == reads and not late, \
            f"handles ended after {timeout} s + {BOUND} s: {late}; not ended: {reads - len(ended)}"
        for i, handle in enumerate(handles):
            error = handle.exception()
            if error is None:  # the bytes moved before the producer died: exact
                for got, exp in zip(blocks_of(cache, dst[i]), want[i]):
                    np.testing.assert_array_equal(got, exp)
            else:
                assert isinstance(error, KvxferError), repr(error)
        assert wait_until(lambda: idle(_stats(agent)), 5), _stats(agent)
    finally:
        agent.close()
        prod.stop()


@pytest.fixture(scope="module")
def producer():
    prod = Peer(KVSpec(**BIG), SEED)
    yield prod
    prod.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("known", [True, False], ids=["connected", "fresh"])
def test_a_read_refused_for_its_own_arguments_leaves_the_producers_hold_alone(producer, known):
    agent, cache = consumer(KVSpec(**BIG))
    rid = f"own-{known}"
    try:
        producer.ask(("hold", rid, [1, 2, 3, 4], None, False))
        want = producer.ask(("blocks", [1, 2, 3, 4]))
        if known:
            agent.connect(*producer.address)
        # local 4 blocks of 16 tokens, remote 3 blocks of 16: the lists cover different tokens
        with pytest.raises(BlockIdError, match="same tokens"):
            agent.read(producer.address, [10, 11, 12, 13], [1, 2, 3], rid, timeout=5).wait(10)
        assert producer.ask(("status", rid)) == "held"
        agent.read(producer.address, [10, 11, 12, 13], [1, 2, 3, 4], rid, timeout=5).wait(10)
        for got, exp in zip(blocks_of(cache, [10, 11, 12, 13]), want):
            np.testing.assert_array_equal(got, exp)
    finally:
        agent.close()
