"""``Done`` notices travel on the link's own session, multiplexed: never a second session, and a
notice never waits for (nor holds up) a request in flight on the same link.

A notice queued behind the link's pending claim would delay back-to-back reads; before requests
carried ids, a second session per producer rank (a second ZMQ connection and Hello) avoided that.
"""

from kvxfer.protocol import Claim, Grant, Heartbeat, HeartbeatAck

from agent_helpers import spec, wait_for


def _seen(agent):
    """Record the type name of every side-channel message ``agent`` handles."""
    seen = []
    handle = agent._service.handle
    agent._service.handle = lambda message, peer: (seen.append(type(message).__name__), handle(message, peer))[1]
    return seen


def test_done_is_delivered_while_a_request_on_the_link_awaits_its_answer(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    prod.hold("r", [1, 2])
    prod.hold("q", [3])
    seen = _seen(prod)
    claim = Claim("q", [3], cons.engine_id)
    pending = link.send(claim, 2.0)  # a claim in flight, its answer not taken yet
    cons._done.send(link, "r")
    assert wait_for(lambda: "Done" in seen), "the notice waited for the link's pending request"
    assert wait_for(lambda: not prod.holding("r"))
    assert isinstance(pending.answer(), Grant)
    assert isinstance(link.ask(Heartbeat(["q"], cons.engine_id), 2.0), HeartbeatAck)


def test_notices_open_no_second_session(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    seen = _seen(prod)
    for i in range(3):
        cons._done.send(link, f"r{i}")
    assert wait_for(lambda: seen.count("Done") == 3)
    assert [p.engine_id for p in prod._server.peers()] == [cons.engine_id]
    assert prod._server.counters()["sessions"] == 1
