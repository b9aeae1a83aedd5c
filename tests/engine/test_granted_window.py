"""A claimed read succeeds only inside the window its producer granted, not merely inside its own
timeout: a producer caps a claim's window (480 s by default), and frees the blocks once it has
passed, so a read asked with a longer timeout ends when the granted window ends. Before, the
consumer ignored the grant's ``lease_remaining``: such a read could still complete, and succeed,
after the producer had freed (and could have reused) its blocks."""

import pytest

from kvxfer.clock import ManualClock
from kvxfer.errors import TransferTimeoutError

from agent_helpers import spec, wait_for


def test_a_read_asking_more_than_the_producer_grants_ends_with_the_granted_window(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    clock = ManualClock()
    cons, _ = harness.agent(s, seed=2, listen=False, clock=clock)
    prod.hold("r", [1])                         # the default lease: a claim's window is capped at 480 s
    cons._backend.hold_transfers(True)          # the move is still running
    handle = cons.read(prod.address, [0], [1], "r", timeout=1000.0)
    assert wait_for(lambda: "r" in cons._parts.claims._granted)   # granted: 480 s, capped
    clock.advance(481)                          # past the 480 s the producer granted, inside the 1000 s asked
    try:
        with pytest.raises(TransferTimeoutError):
            handle.wait(5)
    finally:
        cons._backend.hold_transfers(False)     # the move ends (the consumer's close waits on its clock)
        clock.advance(10)


def test_a_read_inside_the_granted_window_still_succeeds(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    clock = ManualClock()
    cons, _ = harness.agent(s, seed=2, listen=False, clock=clock)
    prod.hold("r", [1])
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [0], [1], "r", timeout=1000.0)
    assert wait_for(lambda: "r" in cons._parts.claims._granted)
    clock.advance(470)
    cons._backend.hold_transfers(False)
    assert handle.wait(5).num_bytes > 0
