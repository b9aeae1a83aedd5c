"""A consumer's staging slots quarantined behind a READ that did not end come back once it has ended.

Before (audit R2): a staged read whose READ was still pending when its pipeline's drain gave up
raised ``SlotsQuarantined`` and dropped its staging slots for good: nothing looked at the stuck
move again, its backend handle was never released, and the slots never came back after the move
had ended. With ``pipeline_slots=4`` one such read made every later staged read of the agent
wait for slots until its deadline. Now the slots are parked until the backend reports every
such move ended (each is released then), and go back to the pool at the next look.

FakeBackend copies when a transfer completes, so a transfer held with ``hold_transfers`` is a
READ still in flight; lifting the hold ends it.
"""

import numpy as np
import pytest

from kvxfer.errors import KvxferError

from agent_helpers import Harness, spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


def test_quarantined_consumer_slots_come_back_once_the_stuck_read_ended():
    h = Harness()
    try:
        s = spec()
        prod, pcache = h.agent(s, seed=1, **STAGED)
        cons, cache = h.agent(s, seed=2, listen=False, **STAGED)
        cons.connect(*prod.address)
        kit = cons._paths.kit
        prod.hold("A", [1, 2])
        prod.hold("B", [5, 6])
        cons._backend.hold_transfers(True)                  # A's READ does not end in time
        ha = cons.read(prod.address, [3, 4], [1, 2], "A", timeout=1.0)
        with pytest.raises(KvxferError):
            ha.wait(20)
        assert wait_for(lambda: kit.router.active() == 0, 10)  # its pipeline has ended
        assert kit.slots_in_use == kit.slots_per_transfer(1)   # quarantined: the READ may still land

        cons._backend.hold_transfers(False)                 # the stuck READ has ended now
        assert kit.slots_in_use == 0, "staging slots still out of the pool after the stuck move ended"
        cons.read(prod.address, [8, 9], [5, 6], "B", timeout=10).wait(20)
        assert all(np.array_equal(got[:, [8, 9]], want[:, [5, 6]]) for got, want in zip(cache, pcache))
        assert kit.slots_in_use == 0
    finally:
        h.close()
