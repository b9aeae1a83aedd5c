"""No handle outlives its deadline for want of a progress pass: a waiter's own polls end it.

The engine's progress pass fails and drains a request past its deadline; a caller's ``done()``
(and ``wait``) reaches the same end on its own once the deadline and the drain's grace passed,
so a handle polled by an engine that never runs a pass (or a pass that somehow skips it) still
fails typed, its blocks quarantined until its transfer has ended."""

import time

import pytest

from kvxfer import TransferTimeoutError

from agent_helpers import spec


def test_a_polled_handle_fails_by_its_deadline_without_any_progress_pass(harness, monkeypatch):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("r", [5, 1])
    engine = cons._parts.engine
    monkeypatch.setattr(engine, "progress", lambda: None)  # no pass ever reaches the request
    cons._backend.hold_transfers(True)                      # its bytes never land
    handle = cons.read(prod.address, [0, 3], [5, 1], "r", timeout=0.3)
    start = time.monotonic()
    while not handle.done() and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert handle.done(), "the handle outlived its deadline with its waiter polling"
    assert time.monotonic() - start < 2
    with pytest.raises(TransferTimeoutError):
        handle.wait(0)
    # the move never ended: its destination blocks stay quarantined until it does
    assert engine.quarantined().get("r") == [0, 3]
    cons._backend.hold_transfers(False)
