"""A staged read that fails on the consumer mid-pipeline gives the producer its staging slots back at once.

Before (audit R4): a staged read that failed after its pipeline started (here one piece's READ
FAILED) told the producer nothing: its serve job kept its staging slots, waiting for FREEs that
never came, until its own deadline (the read's whole timeout, 120 s by default). Every other
staged read served by that producer, the consumer's retry of the same request included, waited
for slots meanwhile and failed by its deadline. Now the consumer, once its drain confirmed that
none of its READs of the producer's slots still runs, sends the pipeline message STOP; the
producer's serve ends and its slots go back to the pool. A serve already cancelled (the consumer
aborted) with a slot lent keeps listening on its route and gives the slot back on that STOP,
not only when the consumer's window has passed.

The producer runs on a ``ManualClock`` that the test never moves: its serve cannot end by its
deadline, only by the consumer's word.
"""

import threading

import numpy as np
import pytest

from kvxfer.clock import ManualClock
from kvxfer.errors import KvxferError, TransferFailedError

from agent_helpers import Harness, spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


def test_a_failed_staged_read_gives_the_producer_its_slots_back_and_the_retry_is_exact():
    h = Harness()
    try:
        s = spec()
        prod, pcache = h.agent(s, seed=1, clock=ManualClock(), **STAGED)
        cons, cache = h.agent(s, seed=2, listen=False, **STAGED)
        cons.connect(*prod.address)
        kit, packer = prod._paths.kit, prod._paths.packer
        prod.hold("A", [1, 2])
        cons._backend.fail_next(1)                         # the piece's READ fails
        with pytest.raises(TransferFailedError):
            cons.read(prod.address, [3, 4], [1, 2], "A", timeout=30).wait(10)

        assert wait_for(lambda: packer.serving() == 0 and kit.slots_in_use == 0, 10), \
            "the producer still holds staging slots for a read the consumer has failed"
        cons.read(prod.address, [3, 4], [1, 2], "A", timeout=10).wait(10)   # the retry
        assert all(np.array_equal(got[:, [3, 4]], want[:, [1, 2]]) for got, want in zip(cache, pcache))
        assert wait_for(lambda: kit.slots_in_use == 0 and kit.router.active() == 0, 10)
    finally:
        h.close()


def test_a_serve_cancelled_with_a_slot_lent_gets_it_back_by_the_consumers_stop():
    h = Harness()
    try:
        s = spec()
        prod, _ = h.agent(s, seed=1, clock=ManualClock(), **STAGED)
        cons, _ = h.agent(s, seed=2, listen=False, **STAGED)
        cons.connect(*prod.address)
        kit = prod._paths.kit
        prod.hold("A", [1, 2])
        cons._backend.hold_transfers(True)                 # the READ of the announced slot stays in flight
        ha = cons.read(prod.address, [3, 4], [1, 2], "A", timeout=30)
        assert wait_for(lambda: len(cons._backend._held) >= 1, 10), "no READ posted"
        cons.abort("A")                                    # the producer's serve is cancelled, the slot lent
        assert wait_for(lambda: not any(t.name == "kvxfer-serve-A" for t in threading.enumerate()), 10)
        assert kit.slots_in_use == kit.slots_per_transfer(1)   # parked: the READ may still run

        cons._backend.hold_transfers(False)                # the READ ends; the consumer's drain confirms it
        with pytest.raises(KvxferError):
            ha.wait(10)
        assert wait_for(lambda: kit.slots_in_use == 0 and kit.router.active() == 0, 10), \
            "the producer kept slots its consumer said it no longer reads"
    finally:
        h.close()
