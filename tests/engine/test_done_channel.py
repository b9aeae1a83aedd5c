"""``Done`` notices travel on a side-channel session of their own, never on the link's.

A notice on the link's session would hold the link's lock for a round trip exactly when the
next request's claim wants it (back-to-back reads then claim only after the previous read's notice).
"""

from kvxfer.protocol import Heartbeat, HeartbeatAck

from agent_helpers import spec, wait_for


def _seen(agent):
    """Record the type name of every side-channel message ``agent`` handles."""
    seen = []
    handle = agent._service.handle
    agent._service.handle = lambda message, peer: (seen.append(type(message).__name__), handle(message, peer))[1]
    return seen


def test_done_is_delivered_while_the_links_session_is_busy(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    prod.hold("r", [1, 2])
    seen = _seen(prod)
    with link.lock:  # as if a claim were waiting for its reply on the link's session
        cons._done.send(link, "r")
        assert wait_for(lambda: "Done" in seen), "the notice waited for the link's session"
    # the link's own session still answers afterwards
    assert isinstance(link.ask(Heartbeat(["r"], cons.engine_id), 2.0), HeartbeatAck)


def test_notice_channel_is_dropped_when_its_link_closes(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    seen = _seen(prod)
    cons._done.send(link, "r")
    assert wait_for(lambda: "Done" in seen)
    assert wait_for(lambda: len(cons._done._channels) == 1)
    link.close()
    assert wait_for(lambda: not cons._done._channels), "the closed link's notice channel was kept"


def test_a_notice_channel_opens_its_own_server_session(harness):
    """Two sessions from the one consumer: the link's and the notices' (one extra Hello, no NIXL)."""
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    before = [p.engine_id for p in prod._server.peers()]
    cons._done.send(link, "r")
    assert wait_for(lambda: len(prod._server.peers()) == len(before) + 1)
    assert {p.engine_id for p in prod._server.peers()} == {cons.engine_id}
