"""A producer's HeartbeatAck speaks only for the requests the heartbeat named."""

from __future__ import annotations

from types import SimpleNamespace

from kvxfer.agent.heartbeats import send_keepalive
from kvxfer.protocol import HeartbeatAck


class _Peers:
    def __init__(self, ack: HeartbeatAck) -> None:
        self.ack, self.beats = ack, []

    def call(self, host, port, fn):
        link = SimpleNamespace(ask=lambda beat, timeout: (self.beats.append(beat), self.ack)[1])
        return fn(link)


def _agent(ack: HeartbeatAck):
    link = SimpleNamespace(host="127.0.0.1", port=1, engine_id="producer")
    return SimpleNamespace(engine_id="consumer", config=SimpleNamespace(handshake_timeout=1.0),
                           links_for=lambda remote: [[link]], peers=_Peers(ack))


def test_ids_the_heartbeat_did_not_name_are_not_reported_gone():
    agent = _agent(HeartbeatAck(["a"], ["b", "someone-elses", "a-typo"]))
    result = send_keepalive(agent, ("127.0.0.1", 1), ["a", "b"])
    assert agent.peers.beats[0].request_ids == ["a", "b"]
    assert result.gone == ("b",) and result.unreachable == ()


def test_an_honest_ack_is_reported_as_it_came():
    agent = _agent(HeartbeatAck(["a"], ["b"]))
    assert send_keepalive(agent, ("127.0.0.1", 1), ["a", "b"]).gone == ("b",)
