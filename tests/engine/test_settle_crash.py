"""A bug while a step's claim answers are taken (``ReadStep.advance`` settling them, on whichever
thread polls) fails the step's reads that were not posted, typed and at once, and is logged; it
never escapes into the caller's ``done()`` (which never raises) nor leaves reads unsettled until
their deadline. Before, the reads after the failing point were in neither the step's open list
nor posted: they ended only by their timeout, as "not posted in time"."""

import time

from kvxfer import ReadRequest, TransferFailedError

from agent_helpers import spec


def test_a_bug_while_settling_a_step_fails_its_unposted_reads_at_once(harness, monkeypatch, caplog):
    s = spec()
    prod, _ = harness.agent(s, seed=1, zmq=True)
    cons, _ = harness.agent(s, seed=2, listen=False, zmq=True)
    cons.connect(*prod.address)
    for i in range(3):
        prod.hold(f"c{i}", [i])
    flow = cons._parts.reads

    def broken(reads, grant=False):
        raise RuntimeError("a bug in the post")
    monkeypatch.setattr(flow, "_post_direct_many", broken)
    handles = cons.read_many([ReadRequest(prod.address, [4 + i], [i], f"c{i}", timeout=30) for i in range(3)])
    start = time.monotonic()
    while not all(h.done() for h in handles) and time.monotonic() - start < 10:
        cons.poll()
        time.sleep(0.001)
    assert all(h.done() for h in handles), "the step's reads were left to their 30 s deadline"
    assert all(isinstance(h.exception(), TransferFailedError) for h in handles)
    assert "a bug in the post" in str(handles[0].exception())
    assert "settling a step's reads raised" in caplog.text
    assert all(prod.holding(f"c{i}") for i in range(3))  # the holds stay for a retry
