"""Handshake and request state machines: two sessions joined by an in-memory link, no sockets."""

from __future__ import annotations

import msgspec
import pytest

from kvxfer.errors import (
    AuthenticationError,
    ConfigError,
    IncompatiblePeerError,
    LeaseExpiredError,
    PeerLostError,
    ProtocolError,
)
from kvxfer.protocol import (
    Abort,
    Ack,
    Claim,
    ClaimBatch,
    ClientSession,
    Grant,
    Grants,
    Heartbeat,
    HeartbeatAck,
    Hello,
    PackRequest,
    Refuse,
    Reject,
    ServerSession,
    SessionState,
)
from proto_helpers import KEY, codec, info, spec


class Producer:
    """A server session plus a log of the requests it applied (the 'state' hostile input must not touch)."""

    def __init__(self, engine_id="prod-1", key=None, handler=None, s=None):
        self.applied = []
        self.handler = handler or self.default
        self.session = ServerSession(codec(s, key), info(engine_id, s=s, base=1 << 44), self.on_request)

    def on_request(self, msg):
        self.applied.append(msg)
        return self.handler(msg)

    @staticmethod
    def default(msg):
        if isinstance(msg, Claim):
            return Grant(msg.request_id, 480.0)
        if isinstance(msg, Heartbeat):
            return HeartbeatAck(msg.request_ids, [])
        return Ack()


def connect(producer: Producer, client: ClientSession) -> None:
    client.receive_welcome(producer.session.receive(client.start()))


def consumer(engine_id="cons-1", key=None, s=None) -> ClientSession:
    return ClientSession(codec(s, key), info(engine_id, s=s))


def test_handshake_exchanges_identity_and_geometry():
    prod, cons = Producer(), consumer()
    assert (cons.state, prod.session.state) == (SessionState.IDLE, SessionState.AWAITING_HELLO)
    hello = cons.start()
    assert cons.state is SessionState.HELLO_SENT
    peer = cons.receive_welcome(prod.session.receive(hello))
    assert cons.state is prod.session.state is SessionState.READY
    assert peer.engine_id == "prod-1" and prod.session.peer.engine_id == "cons-1"
    assert cons.peer_geometry.bases.tolist() == info("prod-1", base=1 << 44).bases
    assert cons.peer_spec == spec() and prod.session.peer_spec == spec()
    assert not cons.restarted and not prod.session.restarted


def test_handshake_across_tp_and_layout_differences():
    prod = Producer(s=spec(tp_size=2, tp_rank=1, layout="HND", storage="packed", block_size=32))
    cons = consumer(s=spec(num_blocks=100))
    connect(prod, cons)
    assert cons.peer_spec.tp_rank == 1 and cons.peer_spec.layout.value == "HND"


def test_request_round_trip():
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    claim = Claim("req-1", [4, 5, 9], "cons-1")
    grant = cons.response(prod.session.receive(cons.request(claim)), claim)
    assert grant == Grant("req-1", 480.0)
    assert prod.applied == [claim]


def test_requests_before_handshake():
    prod, cons = Producer(), consumer()
    with pytest.raises(ProtocolError, match=r"request\(\): expected state in \['ready'\]; got 'idle'"):
        cons.request(Claim("req-1", [1], "cons-1"))
    with pytest.raises(ProtocolError, match="got 'idle'"):
        cons.receive_welcome(b"")
    assert cons.state is SessionState.IDLE
    # a raw Claim frame sent to a server that has not seen Hello
    reply = codec().decode(prod.session.receive(codec().encode(Claim("req-1", [1], "cons-1"))))
    assert isinstance(reply, Reject) and reply.code == "state" and "expected Hello first" in reply.detail
    assert "in state 'awaiting_hello' a client may not send Claim" in reply.detail  # the value, not the member
    assert prod.session.state is SessionState.AWAITING_HELLO and prod.applied == []


def test_peer_with_another_protocol_version():
    prod, cons = Producer(), consumer()
    hello = cons.start()
    v2 = hello[:4] + (2).to_bytes(2, "big") + hello[6:]
    reply = codec().decode(prod.session.receive(v2))
    assert reply.code == "version" and "expected 1; got 2" in reply.detail
    assert prod.session.state is SessionState.AWAITING_HELLO and prod.session.peer is None
    # and a client answered by a v2 server
    welcome = prod.session.receive(hello)
    with pytest.raises(IncompatiblePeerError, match="expected 1; got 2"):
        cons.receive_welcome(welcome[:4] + (2).to_bytes(2, "big") + welcome[6:])
    assert cons.state is SessionState.FAILED


def test_peer_with_another_model_gets_a_readable_reject():
    prod, cons = Producer(), consumer(s=spec(model="other-model"))
    with pytest.raises(IncompatiblePeerError, match=r"rejected it \(model\).*compat hash"):
        cons.receive_welcome(prod.session.receive(cons.start()))
    assert cons.state is SessionState.FAILED
    assert prod.session.state is SessionState.AWAITING_HELLO and prod.session.rejected == 1


def test_hello_whose_body_lies_about_its_model():
    prod = Producer()
    liar = Hello(info("cons-1", s=spec(model="other-model")))  # envelope hash says tiny-llama
    reply = codec().decode(prod.session.receive(codec().encode(liar)))
    assert reply.code == "model" and "other-model" in reply.detail
    assert prod.session.peer is None


@pytest.mark.parametrize("frame", [b"", b"garbage", b"KVXF\x00\x01" + b"\xff" * 60])
def test_garbage_changes_no_server_state(frame):
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    peer_before = prod.session.peer
    reply = codec().decode(prod.session.receive(frame))
    assert reply.code == "malformed"
    assert prod.session.state is SessionState.READY and prod.session.peer is peer_before and prod.applied == []
    claim = Claim("req-1", [1], "cons-1")
    assert isinstance(cons.response(prod.session.receive(cons.request(claim))), Grant)


def test_malformed_hello_while_ready_keeps_the_old_peer():
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    bad = Hello(msgspec.structs.replace(info("intruder"), bases=[[1, 2]]))
    reply = codec().decode(prod.session.receive(codec().encode(bad)))
    assert reply.code == "malformed" and "bases shape" in reply.detail
    assert prod.session.peer.engine_id == "cons-1"


@pytest.mark.parametrize("client_key", [b"another-key-of-32-bytes-length!!", None])
def test_wrong_or_missing_key(client_key):
    prod, cons = Producer(key=KEY), consumer(key=client_key)
    with pytest.raises(AuthenticationError):
        cons.receive_welcome(prod.session.receive(cons.start()))
    assert prod.session.state is SessionState.AWAITING_HELLO and prod.session.rejected == 1


def test_matching_keys_handshake():
    prod, cons = Producer(key=KEY), consumer(key=KEY)
    connect(prod, cons)
    assert cons.state is SessionState.READY


def test_restarted_producer_is_detected():
    prod, cons = Producer("prod-1"), consumer()
    connect(prod, cons)
    restarted = Producer("prod-2")  # same address, new process: it never saw our Hello
    with pytest.raises(PeerLostError, match="prod-1 no longer knows this session"):
        cons.response(restarted.session.receive(cons.request(Claim("req-1", [1], "cons-1"))))
    assert cons.state is SessionState.IDLE and restarted.applied == []
    connect(restarted, cons)
    assert cons.restarted and cons.peer.engine_id == "prod-2"
    connect(restarted, cons)  # a plain re-handshake with the same peer is not a restart
    assert not cons.restarted


def test_restarted_consumer_is_detected_by_the_server():
    prod = Producer()
    connect(prod, consumer("cons-1"))
    connect(prod, consumer("cons-1b"))
    assert prod.session.restarted and prod.session.peer.engine_id == "cons-1b"


def test_request_claiming_another_engine_is_rejected():
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    frame = cons.request(Abort("req-1", "someone-else"))
    reply = codec().decode(prod.session.receive(frame))
    assert reply.code == "state" and "expected 'cons-1'" in reply.detail and prod.applied == []


def test_handler_errors_become_rejects_and_the_session_survives():
    def handler(msg):
        if msg.request_id == "boom":
            raise RuntimeError("bug")
        if msg.request_id == "gone":
            raise LeaseExpiredError("lease of 'gone' expired")
        return Refuse(msg.request_id, "unknown request")

    prod, cons = Producer(handler=handler), consumer()
    connect(prod, cons)
    with pytest.raises(ProtocolError, match="internal error: RuntimeError"):
        cons.response(prod.session.receive(cons.request(Claim("boom", [1], "cons-1"))))
    with pytest.raises(ProtocolError, match="lease of 'gone' expired"):
        cons.response(prod.session.receive(cons.request(Claim("gone", [1], "cons-1"))))
    claim = Claim("req-3", [1], "cons-1")
    assert cons.response(prod.session.receive(cons.request(claim)), claim) == Refuse("req-3", "unknown request")
    assert cons.state is SessionState.READY


def test_bad_pack_request_and_mismatched_replies():
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    reply = codec().decode(prod.session.receive(cons.request(PackRequest("r", [1], 4, 4))))
    assert reply.code == "malformed" and prod.applied == []
    claim = Claim("req-1", [1], "cons-1")
    with pytest.raises(ProtocolError, match=r"expected one of \['Grant', 'Refuse'\]; got HeartbeatAck"):
        cons.response(codec().encode(HeartbeatAck([], [])), claim)
    with pytest.raises(ProtocolError, match="request_id: expected 'req-1'; got 'req-2'"):
        cons.response(codec().encode(Grant("req-2", 1.0)), claim)
    with pytest.raises(ProtocolError, match="expected one of"):
        cons.request(Grant("req-1", 1.0))
    assert cons.state is SessionState.READY


def test_a_claim_batch_answer_must_name_each_claims_request_in_order():
    prod, cons = Producer(), consumer()
    connect(prod, cons)
    batch = ClaimBatch([Claim("req-1", [1], "cons-1"), Claim("req-2", [2], "cons-1")])
    right = Grants([Grant("req-1", 1.0), Refuse("req-2", "not held")])
    assert cons.response(codec().encode(right), batch) == right
    swapped = Grants([Grant("req-2", 1.0), Grant("req-1", 1.0)])
    with pytest.raises(ProtocolError, match="reply 0 of a ClaimBatch: request_id: expected 'req-1'; got 'req-2'"):
        cons.response(codec().encode(swapped), batch)
    with pytest.raises(ProtocolError, match="ClaimBatch of 2 claims was answered with 1 replies"):
        cons.response(codec().encode(Grants([Grant("req-1", 1.0)])), batch)
    assert cons.state is SessionState.READY


def test_local_info_must_match_the_codec():
    with pytest.raises(ConfigError, match="compat hash"):
        ClientSession(codec(), info(s=spec(model="other-model")))
