"""A producer's side-channel sessions free their peer's ``PeerInfo`` as soon as they are dropped,
without the cyclic garbage collector (``ProducerService.make_session``, ``SessionTable.remove``)."""

import gc
import weakref

import pytest

from kvxfer.layout.spec import CacheGeometry
from kvxfer.protocol import (ClientSession, Codec, Heartbeat, HeartbeatAck, SessionState, compat_hash,
                             make_peer_info)
from kvxfer.transport.sessions import SessionTable

from agent_helpers import spec


@pytest.fixture
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _handshaken(harness, metadata: bytes):
    """A producer service's session after a real Hello (and one request) from a consumer."""
    s = spec()
    producer, _ = harness.agent(s, listen=False)
    session = producer._service.make_session()
    client = ClientSession(Codec(compat_hash(s)),
                           make_peer_info("cons-1", "consumer", s, CacheGeometry.contiguous(s, 1 << 30), metadata))
    client.receive_welcome(session.receive(client.start()))
    ask = Heartbeat([], "cons-1")
    assert client.response(session.receive(client.request(ask)), ask) == HeartbeatAck([], [])
    return session


def test_a_dropped_session_is_freed_without_the_cyclic_collector(harness, collector_off):
    session = _handshaken(harness, b"\x07" * (500 << 10))
    table = SessionTable()
    assert table.add(b"client-1", "127.0.0.1", session, fd=7)
    gone = weakref.ref(session)
    del session
    assert table.disconnect(7) == 1
    assert gone() is None, f"still referred to by {[type(r).__name__ for r in gc.get_referrers(gone())]}"


def test_removing_a_session_drops_its_peer_info_even_while_it_is_still_referenced(harness):
    session = _handshaken(harness, b"\x07" * (500 << 10))
    table = SessionTable()
    assert table.add(b"client-1", "127.0.0.1", session)
    assert session.peer is not None and session.state is SessionState.READY
    assert table.remove(b"client-1")
    assert session.peer is None and session.peer_geometry is None and session.state is SessionState.AWAITING_HELLO
