"""``read_many``: one claim message per producer rank for a step, each request judged alone; the
wire form of that message; a session refuses a batch naming another engine."""

import numpy as np
import pytest

from kvxfer import LeaseExpiredError, ReadRequest, RequestInFlightError
from kvxfer.protocol import Claim, ClaimBatch, Codec, Grant, Grants, Refuse, compat_hash

from agent_helpers import spec


def _record(agent) -> list:
    """The request messages ``agent``'s producer service handles, in order (wraps ``handle``)."""
    seen: list = []
    inner = agent._service.handle

    def handle(message, peer):
        seen.append(type(message).__name__)
        return inner(message, peer)

    agent._service.handle = handle
    return seen


def test_a_step_is_claimed_with_one_message_and_each_request_stands_alone(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("a", [1, 2])
    prod.hold("c", [5, 6])  # "b" is never held
    seen = _record(prod)
    handles = cons.read_many([ReadRequest(prod.address, [0, 3], [1, 2], "a", timeout=5),
                              ReadRequest(prod.address, [4], [3], "b", timeout=5),
                              ReadRequest(prod.address, [7, 8], [5, 6], "c", timeout=5)])
    handles[0].wait(5)
    handles[2].wait(5)
    with pytest.raises(LeaseExpiredError, match="'b' is not held"):
        handles[1].wait(5)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 3, 7, 8]], pcache[layer][:, [1, 2, 5, 6]])
    assert seen.count("ClaimBatch") == 1 and "Claim" not in seen, seen


def test_a_batch_naming_one_id_twice_is_refused_whole_and_sends_nothing(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("a", [1])
    seen = _record(prod)
    with pytest.raises(RequestInFlightError, match="'a'"):
        cons.read_many([ReadRequest(prod.address, [0], [1], "a"), ReadRequest(prod.address, [3], [1], "a")])
    assert cons.stats().in_flight == 0 and seen == []
    assert prod.status("a").value == "held"


def test_claim_batch_round_trips_and_grants_answer_in_order():
    c = Codec(compat_hash(spec()))
    claims = [Claim("r1", [], "eng", 2.0, np.arange(4, dtype="<u4").tobytes()), Claim("r2", [3, 4], "eng", 1.0)]
    assert c.decode(c.encode(ClaimBatch(claims))) == ClaimBatch(claims)
    replies = Grants([Grant("r1", 2.0), Refuse("r2", "request 'r2' is not held")])
    assert c.decode(c.encode(replies)) == replies


def test_a_batch_with_another_engines_claim_is_rejected_by_the_session(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("a", [1])
    link = cons.connect(*prod.address)
    batch = ClaimBatch([Claim("a", [1], cons.engine_id, 1.0), Claim("a", [1], "somebody-else", 1.0)])
    with pytest.raises(Exception, match="engine_id"):
        link.ask(batch, 2.0)
    assert prod.status("a").value == "held"  # nothing was claimed
