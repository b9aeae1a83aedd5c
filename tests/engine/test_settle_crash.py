"""A bug while a step's claim answers are taken (``ReadStep.advance`` settling them, on whichever
thread polls) fails the step's reads that were not posted, typed and at once, and is logged; it
never escapes into the caller's ``done()`` (which never raises) nor leaves reads unsettled until
their deadline. Before, the reads after the failing point were in neither the step's open list
nor posted: they ended only by their timeout, as "not posted in time". A crash anywhere a read
is driven fails only the reads it left stranded (a read granted and posted goes on)."""

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


def test_a_crash_fails_only_the_reads_that_cannot_move_on_by_themselves(harness):
    """A bug-exception while reads are driven fails the reads it left stranded, typed, and no
    other: a read granted and posted completes as its transfer does."""
    from kvxfer.agent.reads import PendingRead, stranded
    from kvxfer.engine.transfers import Part
    from kvxfer.types import Direction, MemKind

    s = spec()
    cons, _ = harness.agent(s, seed=2, listen=False)
    engine = cons._parts.engine
    reqs = engine.reserve_many([(rid, time.monotonic() + 30, [i + 1]) for i, rid in enumerate("abc")],
                               Direction.READ, granted=False)

    class Moving:
        notifies, moves_itself, num_bytes, descriptors = False, True, 64, 1

        def poll(self):
            return False

        def cancel(self):
            return True

    with engine.posting(reqs[:2]):
        for req in reqs[:2]:
            engine.attach(req, [Part("p", None, MemKind.VRAM, b"", job=Moving())], mode="ipc", started=True)
    engine.grant(reqs[0])  # a: granted and posted; b: posted, never granted; c: neither
    reads = [PendingRead(q, ("h", 1), None, None, q.handle.request_id, None, None, ("e", b""), 0.0) for q in reqs]
    assert [stranded(r) for r in reads] == [False, True, True]
    cons._parts.reads.crashed(reads, RuntimeError("a bug"))
    assert [q.error is not None for q in reqs] == [False, True, True]
