"""Refusals a peer can cause at will (claims of requests not held, aborts of holds naming other
engines) are logged at most once per kind per interval, with a count: a client looping on them
cannot flood the producer's log."""

import logging

from kvxfer.protocol import Abort, Claim, Refuse

from agent_helpers import spec


def test_two_hundred_refused_claims_and_aborts_write_one_line_each(harness, caplog):
    prod, _ = harness.agent(spec(), seed=1)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("theirs", [1, 2], consumer_engines=["somebody-else"])
    link = cons.connect(*prod.address)
    with caplog.at_level(logging.INFO, logger="kvxfer"):
        for i in range(200):
            assert isinstance(link.ask(Claim(f"nope-{i}", [1], cons.engine_id, 1.0), 2.0), Refuse)
            assert isinstance(link.ask(Abort("theirs", cons.engine_id), 2.0), Refuse)
    claims = [r for r in caplog.records if "refused claim" in r.getMessage()]
    aborts = [r for r in caplog.records if "refused abort" in r.getMessage()]
    assert len(claims) == 1 and len(aborts) == 1, [r.getMessage() for r in caplog.records][:5]
    assert claims[0].levelno == logging.INFO and "nope-0" in claims[0].getMessage()
    assert prod.holding("theirs")  # still held: the refusals changed nothing
