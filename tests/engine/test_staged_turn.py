"""A staged read aborted while it waits its turn behind the batch's previous staged read never
starts its pipeline: its handle fails at the abort, and the blocks it would have written (which
the engine may reuse at once) are never written. Before, the pipeline started after the wait
anyway, outside ``posting``, and wrote the producer's bytes into blocks whose read had ended."""

import time

import numpy as np

from kvxfer import AbortedError, ReadRequest

from agent_helpers import spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)
REUSED = 0xDEAD


def test_a_staged_read_aborted_while_it_waits_its_turn_never_writes_its_blocks(harness):
    s = spec()
    prod, prod_cache = harness.agent(s, seed=1, **STAGED)
    cons, cache = harness.agent(s, seed=2, listen=False, **STAGED)
    cons.connect(*prod.address)
    prod.hold("A", [1, 2])
    prod.hold("B", [5, 6])
    flow = cons._parts.reads
    wait_turn = flow._wait_turn
    handles = {}

    def abort_b_while_it_waits(r, previous):
        if r.request_id == "B":
            cons.abort("B", wait=False)  # the engine aborts B as it waits behind A
            assert wait_for(lambda: handles["B"].done(), 3), "B's handle did not end at its abort"
            for layer in cache:           # and reuses B's destination blocks at once
                layer[:, [8, 9]] = REUSED
        return wait_turn(r, previous)

    flow._wait_turn = abort_b_while_it_waits
    paths = cons._parts.paths
    start = paths.start

    def slow_start(route, *args):  # a lane thread descheduled between a pipeline's start and its attach
        parts = start(route, *args)
        time.sleep(0.3)
        return parts

    paths.start = slow_start
    a, b = cons.read_many([ReadRequest(prod.address, [3, 4], [1, 2], "A", timeout=10),
                           ReadRequest(prod.address, [8, 9], [5, 6], "B", timeout=10)])
    handles["B"] = b
    assert a.wait(5).mode == "staged"
    for got, want in zip(cache, prod_cache):
        assert np.array_equal(got[:, [3, 4]], want[:, [1, 2]])
    assert wait_for(lambda: b.done(), 5) and isinstance(b.exception(), AbortedError)
    time.sleep(0.5)  # a pipeline started late would have written by now
    assert all((layer[:, [8, 9]] == REUSED).all() for layer in cache), "bytes landed after B's read ended"
    assert wait_for(lambda: cons.poll() == 0, 5)
