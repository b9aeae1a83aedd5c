"""ZMQ side channel over real sockets on 127.0.0.1: round trips, dead and silent peers, restarts, limits."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from kvxfer.errors import (
    AuthenticationError,
    ClosedError,
    ConfigError,
    IncompatiblePeerError,
    PeerLostError,
    ProtocolError,
    TransferTimeoutError,
)
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.protocol import (
    Claim,
    ClientSession,
    Codec,
    Grant,
    Heartbeat,
    HeartbeatAck,
    ServerSession,
    compat_hash,
    make_peer_info,
)
from kvxfer.transport.zmq import SideChannelClient, SideChannelServer

KEY = b"transport-test-key-0123456789abc"
SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16, num_blocks=8, model="m")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_info(engine_id: str, s: KVSpec = SPEC, metadata: bytes = b"md"):
    return make_peer_info(engine_id, "agent-" + engine_id, s, CacheGeometry.contiguous(s, 1 << 30), metadata)


def producer(engine_id="prod-1", key=KEY, port=0, **kw) -> SideChannelServer:
    codec = Codec(compat_hash(SPEC), key=key)

    def on_request(msg):
        if isinstance(msg, Claim):
            return Grant(msg.request_id, 100.0 + len(msg.block_ids))
        return HeartbeatAck(msg.request_ids, [])

    server = SideChannelServer("127.0.0.1", port, lambda: ServerSession(codec, peer_info(engine_id), on_request), **kw)
    server.start()
    return server


def handshake(port: int, engine_id="cons-1", key=KEY, s: KVSpec = SPEC):
    client = SideChannelClient("127.0.0.1", port)
    session = ClientSession(Codec(compat_hash(s), key=key), peer_info(engine_id, s))
    session.receive_welcome(client.request(session.start(), timeout=10))
    return client, session


def ask(client, session, msg, timeout=10):
    return session.response(client.request(session.request(msg), timeout), msg)


def test_round_trip_between_threads():
    server = producer()
    try:
        results, errors = {}, []

        def consumer(name: str) -> None:
            try:
                client, session = handshake(server.port, name)
                with client:
                    results[name] = [ask(client, session, Claim(f"{name}-{i}", list(range(i)), name))
                                     for i in range(5)]
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=consumer, args=(f"cons-{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        for name, grants in results.items():
            assert grants == [Grant(f"{name}-{i}", 100.0 + i) for i in range(5)]
        # the clients closed their sockets: their sessions are forgotten (memory returned)
        deadline = time.monotonic() + 10
        while server.counters()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.peers() == [] and server.counters()["disconnected"] == 3
    finally:
        server.close()


def test_one_client_shared_by_threads():
    server = producer()
    client, session = handshake(server.port)
    try:
        lock = threading.Lock()  # the session is sans-IO: callers pair request and response under a lock
        out: list = []

        def worker(k: int) -> None:
            for i in range(10):
                msg = Heartbeat([f"r{k}-{i}"], "cons-1")
                with lock:
                    out.append(ask(client, session, msg) == HeartbeatAck([f"r{k}-{i}"], []))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert out == [True] * 30
    finally:
        client.close()
        server.close()


def test_dead_server_times_out_with_a_typed_error_within_its_deadline():
    client = SideChannelClient("127.0.0.1", free_port())
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="no connection within 0.5 s"):
        client.request(b"hello", timeout=0.5)
    # generous bound: the point is that the call returns near its deadline, not a benchmark
    assert time.monotonic() - started < 5.0
    client.close()


@pytest.fixture
def silent_router():
    """A bare ROUTER socket that answers only when the test says so, and a client of it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    client = SideChannelClient("127.0.0.1", router.bind_to_random_port("tcp://127.0.0.1"))
    try:
        yield router, client
    finally:
        client.close()
        router.close()
        ctx.term()


def answers_next_request(router, client, stale_ident: bytes, frame: bytes) -> bool:
    """Send ``frame`` from another thread: it must arrive on a fresh socket (not ``stale_ident``)
    and get the answer meant for it, whatever late replies the old socket was sent."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(client.request(frame, timeout=10)))
    t.start()
    assert router.poll(10_000)
    ident, got = router.recv_multipart()
    assert got == frame and ident != stale_ident
    router.send_multipart([ident, b"answer to " + frame])
    t.join(10)
    return result == [b"answer to " + frame]


def test_silent_server_times_out_and_the_socket_is_reset(silent_router):
    router, client = silent_router
    with pytest.raises(TransferTimeoutError, match="no reply within 0.3 s"):
        client.request(b"first", timeout=0.3)
    ident, first = router.recv_multipart()
    assert first == b"first"
    router.send_multipart([ident, b"late answer to first"])  # must never reach the next request
    assert answers_next_request(router, client, ident, b"second")


def test_port_taken_is_a_config_error_naming_the_address():
    server = producer()
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}.*in use"):
            producer(port=server.port)
    finally:
        server.close()
        server.close()  # idempotent
    with pytest.raises(ClosedError):
        server.start()


def test_restarted_server_is_detected_and_rehandshaken():
    server = producer("prod-1")
    port = server.port
    client, session = handshake(port)
    assert session.peer.engine_id == "prod-1"
    server.close()
    deadline = time.monotonic() + 10
    while True:  # the old socket releases the port asynchronously
        try:
            server = producer("prod-2", port=port)
            break
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        with pytest.raises(PeerLostError):
            ask(client, session, Claim("req-1", [1], "cons-1"))
        session.receive_welcome(client.request(session.start(), timeout=10))
        assert session.restarted and session.peer.engine_id == "prod-2"
        assert ask(client, session, Claim("req-1", [1], "cons-1")) == Grant("req-1", 101.0)
    finally:
        client.close()
        server.close()


def test_wrong_key_and_wrong_model_over_the_wire():
    server = producer()
    try:
        with pytest.raises(AuthenticationError):
            handshake(server.port, key=b"some-other-key-0123456789abcdef!")
        with pytest.raises(AuthenticationError):
            handshake(server.port, key=None)
        other = KVSpec(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16, num_blocks=8, model="x")
        with pytest.raises(IncompatiblePeerError, match=r"rejected it \(model\)"):
            handshake(server.port, s=other)
        assert server.peers() == []  # hostile handshakes leave no session behind
        client, session = handshake(server.port)  # and the server still serves good peers
        client.close()
    finally:
        server.close()


def test_oversized_frame_drops_the_sender_not_the_server():
    server = producer(max_bytes=64 << 10)
    try:
        big = SideChannelClient("127.0.0.1", server.port, max_bytes=4 << 20)
        with pytest.raises(PeerLostError, match="dropped"):
            big.request(b"KVXF" + b"\x00" * (1 << 20), timeout=2)
        big.close()
        client, session = handshake(server.port)
        assert ask(client, session, Claim("req-1", [1, 2], "cons-1")) == Grant("req-1", 102.0)
        client.close()
    finally:
        server.close()


def test_client_limits_and_close():
    client = SideChannelClient("127.0.0.1", free_port(), max_bytes=1024)
    with pytest.raises(ProtocolError, match="frame too large: expected <= 1024 bytes; got 2048"):
        client.request(b"x" * 2048, timeout=1)
    with pytest.raises(ConfigError, match="timeout"):
        client.request(b"x", timeout=0)
    client.close()
    client.close()
    with pytest.raises(ClosedError):
        client.request(b"x", timeout=1)
    with pytest.raises(ConfigError, match="port"):
        SideChannelClient("127.0.0.1", 70000)


def test_send_returns_before_the_reply_and_holds_the_channel_until_it_is_taken(silent_router):
    """``send`` lets the caller work while the request travels; the channel stays held meanwhile,
    and a cancelled request's late reply never answers the next one."""
    router, client = silent_router
    pending = client.send(b"one", timeout=10)   # returns although nobody answered yet
    ident, frame = router.recv_multipart()
    assert frame == b"one"
    with pytest.raises(TransferTimeoutError, match="another request held the channel"):
        client.request(b"meanwhile", timeout=0.2)
    router.send_multipart([ident, b"answer to one"])
    assert pending.reply() == b"answer to one"
    with pytest.raises(ProtocolError, match="already taken"):
        pending.reply()
    cancelled = client.send(b"two", timeout=10)
    ident2, _ = router.recv_multipart()
    cancelled.cancel()
    router.send_multipart([ident2, b"late answer to two"])  # the socket it was meant for is gone
    assert answers_next_request(router, client, ident2, b"three")
