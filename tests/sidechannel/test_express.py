"""The express lane (kvxfer.transport.express) with real agents: real NIXL, real ZMQ, real TCP.

A consumer's claims, Done, aborts and heartbeats travel on one plain TCP connection to the
producer's express port, attached to its ZMQ session by the session's routing id. These tests
check that reads use it and stay byte-exact, that either side can turn it off (requests then
stay on ZMQ), that hostile connections on the express port are closed and counted without
disturbing a real consumer, that a cut lane or a restarted producer heals with one fresh
handshake (and a fresh lane), that threads sharing one lane each get their own replies, and
that a lane whose server went away fails with PeerLostError instead of hanging.
"""

import socket
import threading
import time

import pytest

from kvxfer import AgentConfig
from kvxfer.errors import PeerLostError
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.protocol import ClientSession, Codec, Heartbeat, HeartbeatAck, ServerSession, compat_hash, make_peer_info
from kvxfer.transport.express import ATTACH, ATTACHED, HEADER, ExpressLane, frame
from kvxfer.transport.express_server import _ATTACH_BYTES as ATTACH_BYTES
from kvxfer.transport.zmq import SideChannelClient, SideChannelServer

from sidechannel_peers import HOLD_BLOCKS, Peer, assert_read, consumer, free_port_block, poll

HOLDS = {f"r{i}": HOLD_BLOCKS for i in range(8)} | {"hb": HOLD_BLOCKS}
MAX_BYTES = AgentConfig().max_message_bytes
SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16, num_blocks=8, model="m")


@pytest.fixture(scope="module")
def prod():
    """One producer (express lane on, ephemeral port) shared by the tests that only read from it."""
    p = Peer(1, free_port_block(1), HOLDS)
    yield p
    p.stop()


def _read(cons, cache, address, rid: str, dst, seed: int = 1) -> None:
    cons.read(address, dst, HOLD_BLOCKS, rid).wait(30)
    assert_read(cache, dst, seed, HOLD_BLOCKS)


def _only_link(cons):
    links = cons._peers.links()
    assert len(links) == 1
    return links[0]


def _express_count(p) -> int:
    return p.ask("counters")["express"]


def _run_all(threads, timeout: float) -> bool:
    """Start ``threads``; whether all ended within ``timeout`` s."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` s (nothing else may arrive)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


# ---- 1. reads use the lane; either side can turn it off ------------------------------------

def test_a_read_travels_on_the_lane_and_is_exact(prod):
    cons, cache = consumer()
    with cons:
        _read(cons, cache, prod.address, "r0", [0, 1, 2, 3])
        link = _only_link(cons)
        assert link.info.express_port > 0 and link.client.express is True
        assert poll(lambda: _express_count(prod), 1) == 1
    assert poll(lambda: _express_count(prod), 0) == 0   # the consumer closed: so did its lane


def test_a_consumer_with_the_lane_off_reads_exactly_over_zmq(prod):
    cons, cache = consumer(express_port=None)
    with cons:
        _read(cons, cache, prod.address, "r1", [4, 5, 6, 7])
        link = _only_link(cons)
        assert link.info.express_port > 0            # offered by the producer, not taken
        assert link.client.express is False
        assert cons.keepalive(prod.address, ["hb", "gone-1"]).gone == ("gone-1",)
        assert _express_count(prod) == 0


def test_a_producer_with_the_lane_off_is_read_exactly_over_zmq():
    p = Peer(2, free_port_block(1), {"z1": HOLD_BLOCKS}, express_port=None)
    try:
        cons, cache = consumer()
        with cons:
            _read(cons, cache, p.address, "z1", [8, 9, 10, 11], seed=2)
            link = _only_link(cons)
            assert link.info.express_port == 0 and link.client.express is False
            assert p.ask("counters")["express"] == 0
    finally:
        p.stop()


# ---- 2. hostile connections on the express port --------------------------------------------

def test_hostile_express_connections_are_closed_counted_and_harmless(prod):
    cons, cache = consumer()
    with cons:
        _read(cons, cache, prod.address, "r2", [12, 13, 14, 15])
        link = _only_link(cons)
        assert link.client.express
        address = (prod.address[0], link.info.express_port)
        before = prod.ask("counters")["rejected"]

        def connect() -> socket.socket:
            return socket.create_connection(address, timeout=5)

        # control: an attach naming the real session is answered ATTACHED (so the refusals
        # below are due to what the frames say, not to how this test frames them) ...
        with connect() as good:
            good.sendall(frame(0, ATTACH + link.client._identity))
            good.settimeout(5)
            assert good.recv(64) == HEADER.pack(len(ATTACHED), 0) + ATTACHED
            # ... and a frame over max_message_bytes closes even an attached connection
            good.sendall(HEADER.pack(MAX_BYTES + 1, 7))
            assert _closed_by_peer(good)
        with connect() as s:   # (a) an attach naming an identity no session has
            s.sendall(frame(0, ATTACH + b"\x01" + bytes(15)))
            assert _closed_by_peer(s)
        with connect() as s:   # (b) a header announcing more than max_message_bytes, before attaching
            s.sendall(HEADER.pack(MAX_BYTES + 1, 0))
            assert _closed_by_peer(s)
        with connect() as s:   # (b') before attaching, a frame longer than any attach (a crowd of such
            s.sendall(HEADER.pack(ATTACH_BYTES + 1, 0))  # connections must not buffer max_bytes each)
            assert _closed_by_peer(s)
        with connect() as s:   # (d) a first frame that is not an attach
            s.sendall(frame(5, b"hello, not an attach"))
            assert _closed_by_peer(s)
        with connect() as s:   # (d') an attach frame under a non-zero request id
            s.sendall(frame(3, ATTACH + link.client._identity))
            assert _closed_by_peer(s)

        after = prod.ask("counters")["rejected"]
        assert after.get("express-attach", 0) - before.get("express-attach", 0) == 3
        assert after.get("express-size", 0) - before.get("express-size", 0) == 3
        assert poll(lambda: _express_count(prod), 1) == 1   # none of them is left open
        # the real consumer's lane was never touched: the same link, still on the lane, reads exactly
        _read(cons, cache, prod.address, "r3", [16, 17, 18, 19])
        assert _only_link(cons) is link and link.client.express


def _info(engine_id: str):
    return make_peer_info(engine_id, "agent-" + engine_id, SPEC, CacheGeometry.contiguous(SPEC, 1 << 30), b"md")


def _server() -> SideChannelServer:
    """An in-process side channel with an express port, answering heartbeats (alive: ids given)."""
    codec, info = Codec(compat_hash(SPEC)), _info("prod-x")
    server = SideChannelServer("127.0.0.1", 0, lambda: ServerSession(
        codec, info, lambda m: HeartbeatAck(m.request_ids, [])), express_port=0)
    server.start()
    return server


def _attached_client(server: SideChannelServer):
    """A real client, handshaken on ZMQ and attached to ``server``'s express port."""
    client = SideChannelClient("127.0.0.1", server.port)
    session = ClientSession(Codec(compat_hash(SPEC)), _info("cons-x"))
    info = session.receive_welcome(client.request(session.start(), timeout=10))
    client.multiplexed = info.multiplexed
    client.attach_express(server.express_port, 5)
    return client, session


def _beat(client, session, ids, timeout: float = 10.0):
    msg = Heartbeat(ids, "cons-x")
    return session.response(client.request(session.request(msg), timeout), msg)


def test_a_connection_that_never_attaches_is_closed_after_the_attach_timeout(monkeypatch):
    server = _server()
    try:
        monkeypatch.setattr(server._express, "_attach_timeout", 0.4)
        client, session = _attached_client(server)
        with client, socket.create_connection(("127.0.0.1", server.express_port), timeout=5) as silent:
            started = time.monotonic()
            assert _closed_by_peer(silent, timeout=5)
            assert time.monotonic() - started >= 0.3
            assert server.counters()["rejected"] == {"express-attach": 1}
            # the attached lane is older than the timeout too, and is kept: it attached
            assert client.express and _beat(client, session, ["a", "b"]) == HeartbeatAck(["a", "b"], [])
            assert server.counters()["express"] == 1
    finally:
        server.close()


# ---- 3. self-healing -----------------------------------------------------------------------

def test_a_cut_lane_heals_with_a_fresh_handshake_and_a_fresh_lane(prod):
    cons, cache = consumer()
    with cons:
        _read(cons, cache, prod.address, "r4", [20, 21, 22, 23])
        old = _only_link(cons)
        old.client._lane._sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(PeerLostError):               # the lane's failure is seen on first use ...
            old.ask(Heartbeat(["hb"], cons.engine_id), 10.0)
        assert not old.healthy()                         # ... and the link is never handed out again
        assert cons.keepalive(prod.address, ["hb", "gone-2"]).gone == ("gone-2",)
        new = _only_link(cons)
        assert new is not old and old.closed
        assert new.client.express and new.client._identity != old.client._identity
        _read(cons, cache, prod.address, "r5", [24, 25, 26, 27])
        assert _only_link(cons) is new
        assert poll(lambda: _express_count(prod), 1) == 1


def test_a_restarted_producer_is_reached_on_its_new_lane():
    port = free_port_block(1)
    p1 = Peer(1, port, {"a1": HOLD_BLOCKS})
    p2 = None
    try:
        cons, cache = consumer(handshake_timeout=2.0)
        with cons:
            _read(cons, cache, p1.address, "a1", [0, 1, 2, 3])
            old = _only_link(cons)
            assert old.client.express
            p1.kill()
            p2 = Peer(2, port, {"a2": HOLD_BLOCKS, "a3": HOLD_BLOCKS})
            assert cons.keepalive(p2.address, ["a2", "a1"]).gone == ("a1",)
            new = _only_link(cons)
            assert new is not old and new.engine_id == p2.ask("engine_id") != old.engine_id
            assert new.client.express and p2.ask("counters")["express"] == 1
            _read(cons, cache, p2.address, "a3", [4, 5, 6, 7], seed=2)
    finally:
        p1.stop()
        if p2 is not None:
            p2.stop()


# ---- 4. threads sharing one lane ------------------------------------------------------------

def test_threads_sharing_one_lane_each_get_their_own_replies(prod):
    cons, _ = consumer()
    with cons:
        assert cons.keepalive(prod.address, ["hb"]).gone == ()
        link = _only_link(cons)
        lane = link.client._lane
        assert lane is not None
        first = next(lane._ids)
        wrong: list = []

        def worker(k: int) -> None:
            try:
                for i in range(50):
                    mine = [f"t{k}-{i}-a", f"t{k}-{i}-b"]
                    ack = link.ask(Heartbeat([mine[0], "hb", mine[1]], cons.engine_id), 10.0)
                    if ack != HeartbeatAck(["hb"], mine):
                        wrong.append((k, i, ack))
            except Exception as exc:  # surfaced below
                wrong.append((k, exc))

        assert _run_all([threading.Thread(target=worker, args=(k,)) for k in range(8)], 60)
        assert wrong == []
        assert next(lane._ids) - first == 8 * 50 + 1   # every request went on this lane
        assert _only_link(cons) is link and link.client._lane is lane and not lane.dead


# ---- 5. a lane whose server went away ----------------------------------------------------------

def test_a_request_on_a_lane_whose_server_closed_raises_peer_lost():
    server = _server()
    client, session = _attached_client(server)
    with client:
        assert client.express and _beat(client, session, ["x"]) == HeartbeatAck(["x"], [])
        server.close()
        started = time.monotonic()
        with pytest.raises(PeerLostError):
            _beat(client, session, ["y"], timeout=30)
        assert time.monotonic() - started < 5
        assert client.stale()                           # so a PeerDirectory handshakes again
        with pytest.raises(PeerLostError):               # and every later request fails at once
            _beat(client, session, ["z"], timeout=30)


def test_requests_in_flight_when_the_server_drops_the_lane_all_raise_peer_lost():
    """A server that attaches, then reads requests and closes without answering: every waiting
    thread gets PeerLostError at once (none waits for its 30 s deadline)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port, got = listener.getsockname()[1], threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            received = conn.recv(HEADER.size + len(ATTACH) + 16)       # the attach
            conn.sendall(frame(0, ATTACHED))
            while received.count(b"ping") < 4 and (more := conn.recv(4096)):
                received += more
            got.set()
            time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    lane = ExpressLane("127.0.0.1", port, b"\x01" + bytes(15), MAX_BYTES, 5.0)
    errors: list = []

    def ask() -> None:
        try:
            lane.send(b"ping", 30.0).reply()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    try:
        started = time.monotonic()
        assert _run_all([threading.Thread(target=ask) for _ in range(4)], 10)
        assert got.is_set() and time.monotonic() - started < 5
        assert [type(e) for e in errors] == [PeerLostError] * 4 and lane.dead
        with pytest.raises(PeerLostError):
            lane.send(b"ping", 30.0)
    finally:
        lane.close()
        listener.close()
    with pytest.raises(PeerLostError):   # nobody listens there now
        ExpressLane("127.0.0.1", port, b"\x01" * 16, MAX_BYTES, 2.0)


def test_try_send_never_waits_on_a_peer_that_stopped_reading_and_never_leaves_half_a_frame():
    """``try_send`` (a claim sent from ``read_many``'s own thread) writes a frame only into a
    socket with room for all of it: against a server that attached and then stopped reading it
    returns None, at once, once the socket is half full, and every frame it did write arrives
    whole when the server reads again. Meanwhile ``send`` from another thread is not disturbed."""
    listener = socket.create_server(("127.0.0.1", 0))
    port, reading, frames = listener.getsockname()[1], threading.Event(), []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = conn.recv(HEADER.size + len(ATTACH) + 16)           # the attach
            conn.sendall(frame(0, ATTACHED))
            reading.wait(30)                                          # stops reading until told
            buf = b""
            while chunk := conn.recv(1 << 20):
                buf += chunk
                while len(buf) >= HEADER.size:
                    size, rid = HEADER.unpack_from(buf)
                    if len(buf) < HEADER.size + size:
                        break
                    frames.append((rid, buf[HEADER.size:HEADER.size + size]))
                    buf = buf[HEADER.size + size:]
                if frames and frames[-1][1] == b"last":
                    return

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    lane = ExpressLane("127.0.0.1", port, b"\x02" + bytes(15), MAX_BYTES, 5.0)
    payload = bytes(range(256)) * 256                                 # 64 KiB frames
    sent, slowest = [], 0.0
    try:
        for i in range(2000):
            started = time.monotonic()
            pending = lane.try_send(payload + i.to_bytes(4, "big"), 30.0)
            slowest = max(slowest, time.monotonic() - started)
            if pending is None:
                break
            sent.append(i)
            pending.cancel()
        assert pending is None and sent, "the socket never filled"
        assert slowest < 0.5 and not lane.dead  # blocked on the full socket, it would wait its 30 s timeout
        reading.set()
        lane.send(b"last", 30.0).cancel()
        server.join(30)
        assert [p[-4:] for _, p in frames[:-1]] == [i.to_bytes(4, "big") for i in sent]
        assert all(p[:-4] == payload for _, p in frames[:-1]) and frames[-1][1] == b"last"
    finally:
        lane.close()
        listener.close()
