"""Giving a grant back never holds a read's handle past its deadline (FakeBackend, memory side channel).

A producer that dies right after it granted a step's claims, and whose answers to ``Abort`` then
hang (a frozen or dead peer: each abort waits out its round trip), must not delay the step's
handles: they fail at once, typed, and the grants go back afterwards on the producer's lane. The
reads of the step each had a grant to give back; before, each read's give-back ran before its
handle failed, so a step of k reads took k round-trip timeouts.
"""

import time

import pytest

from kvxfer import PeerLostError, ReadRequest
from kvxfer.protocol import Abort, ClaimBatch

from agent_helpers import spec

ABORT_STALL = 1.0  # seconds each Abort hangs at the producer


def test_a_step_whose_producer_dies_after_granting_fails_every_handle_by_its_deadline(harness):
    s = spec(num_blocks=16)
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    reads = 4
    for i in range(reads):
        prod.hold(f"r{i}", [i * 2, i * 2 + 1])
    service, handle = prod._service, prod._service.handle
    aborts = []

    def answer(message, peer):
        if isinstance(message, Abort):
            aborts.append(message.request_id)
            time.sleep(ABORT_STALL)  # a peer that no longer answers in time
        reply = handle(message, peer)
        if isinstance(message, ClaimBatch):
            with harness.world.lock:  # granted, then unreachable before the reads are posted
                harness.world.agents.pop(prod._backend.name, None)
        return reply

    service.handle = answer
    timeout = 1.0
    started = time.monotonic()
    handles = cons.read_many([ReadRequest(prod.address, [8 + i * 2, 9 + i * 2], [i * 2, i * 2 + 1], f"r{i}",
                                          timeout=timeout) for i in range(reads)])
    ended = []
    for h in handles:
        with pytest.raises(PeerLostError):
            h.wait(timeout + 5 * reads * ABORT_STALL)
        ended.append(time.monotonic() - started)
    assert max(ended) < timeout + 0.5, f"handles ended after {[round(t, 2) for t in ended]} s"
    # the grants still go back, later, on the lane (one stalled abort after another)
    deadline = time.monotonic() + reads * ABORT_STALL + 5
    while len(aborts) < reads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(aborts) == [f"r{i}" for i in range(reads)]
