"""One session, many requests in flight: the multiplexed ZMQ client over real sockets on 127.0.0.1.

Requests carry an 8-byte id after ``MUX_MAGIC`` in their ZMQ frame; the server echoes it; replies are matched
by id whatever their order. A peer that did not announce ``multiplexed`` (an older release) is
sent one bare frame at a time, as before.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvxfer.errors import PeerLostError, TransferTimeoutError
from kvxfer.protocol import Claim, Grant, Heartbeat, HeartbeatAck
from kvxfer.transport.zmq import SideChannelClient
from kvxfer.transport.zmq_client import MUX_MAGIC

from test_transport_zmq import handshake, producer


@pytest.fixture
def router():
    """A bare ROUTER the test answers by hand, and a multiplexed client of it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    client = SideChannelClient("127.0.0.1", sock.bind_to_random_port("tcp://127.0.0.1"))
    client.multiplexed = True
    try:
        yield sock, client
    finally:
        client.close()
        sock.close()
        ctx.term()


def recv(sock) -> tuple[bytes, bytes, bytes]:
    """(identity, request id, frame) of the next multiplexed request."""
    ident, data = sock.recv_multipart()
    assert data[:4] == MUX_MAGIC
    return ident, data[4:12], data[12:]


def answer(sock, ident: bytes, rid: bytes, frame: bytes) -> None:
    sock.send_multipart([ident, MUX_MAGIC + rid + frame])


def test_replies_out_of_order_each_reach_their_own_request(router):
    sock, client = router
    pending = [client.send(f"q{i}".encode(), timeout=10) for i in range(5)]  # all sent, none answered
    got = [recv(sock) for _ in range(5)]
    assert [frame for _, _, frame in got] == [f"q{i}".encode() for i in range(5)]
    assert len({rid for _, rid, _ in got}) == 5 and all(len(rid) == 8 for _, rid, _ in got)
    for ident, rid, frame in reversed(got):
        answer(sock, ident, rid, b"re:" + frame)
    assert [p.reply() for p in pending] == [f"re:q{i}".encode() for i in range(5)]


def test_a_slow_request_does_not_hold_up_the_next_one(router):
    """The Found case behind the second Done session: a request waiting for its reply (another
    thread leading the poll) must not delay a later request's send or reply."""
    sock, client = router
    slow = client.send(b"slow", timeout=10)
    waiter = threading.Thread(target=lambda: results.append(slow.reply()))
    results: list = []
    waiter.start()
    time.sleep(0.05)  # the waiter now polls the socket
    t0 = time.monotonic()
    fast = client.send(b"fast", timeout=5)
    ident, rid_slow, _ = recv(sock)
    ident, rid_fast, frame = recv(sock)
    assert frame == b"fast"
    answer(sock, ident, rid_fast, b"fast done")
    assert fast.reply() == b"fast done"
    assert time.monotonic() - t0 < 2.0 and results == []  # answered while 'slow' still waits
    answer(sock, ident, rid_slow, b"slow done")
    waiter.join(10)
    assert results == [b"slow done"]


def test_a_cancelled_or_timed_out_request_never_answers_another(router):
    sock, client = router
    gone = client.send(b"gone", timeout=10)
    gone.cancel()
    with pytest.raises(TransferTimeoutError):
        client.request(b"late", timeout=0.3)
    first = [recv(sock) for _ in range(2)]
    for ident, rid, frame in first:
        answer(sock, ident, rid, b"stale " + frame)  # late answers: dropped by id
    nxt = client.send(b"next", timeout=10)
    ident, rid, frame = recv(sock)
    assert frame == b"next" and ident == first[0][0]  # same session: a timeout no longer resets it
    answer(sock, ident, rid, b"fresh")
    assert nxt.reply() == b"fresh"


def test_a_drop_fails_every_request_in_flight(router):
    sock, client = router
    pending = [client.send(b"x", timeout=10) for _ in range(3)]
    sock.recv_multipart()
    sock.close(linger=0)  # the server goes away with three requests unanswered
    for p in pending:
        with pytest.raises(PeerLostError):
            p.reply()


def test_claim_done_abort_and_heartbeat_run_concurrently_on_one_session():
    """Against the real server: many threads share one handshaken multiplexed client; every
    reply matches its request (type and request id)."""
    server = producer()
    try:
        client, session = handshake(server.port)
        client.multiplexed = True
        errors: list = []

        def worker(n: int) -> None:
            try:
                for i in range(20):
                    rid = f"w{n}-{i}"
                    msgs = [Claim(rid, list(range(i % 5)), "cons-1"), Heartbeat([rid], "cons-1")]
                    pending = [(m, client.send(session.request(m), 10)) for m in msgs]
                    for m, p in reversed(pending):
                        reply = session.response(p.reply(), m)
                        want = Grant(rid, 100.0 + i % 5) if isinstance(m, Claim) else HeartbeatAck([rid], [])
                        assert reply == want
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        client.close()
    finally:
        server.close()


def test_an_older_peer_gets_one_bare_frame_at_a_time():
    """Not multiplexed (the peer did not announce it): frames go without an id, one at a time."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    client = SideChannelClient("127.0.0.1", sock.bind_to_random_port("tcp://127.0.0.1"))
    try:
        first = client.send(b"one", timeout=10)
        ident, frame = sock.recv_multipart()
        assert frame == b"one"  # no id
        with pytest.raises(TransferTimeoutError, match="held the channel"):
            client.send(b"two", timeout=0.2)
        sock.send_multipart([ident, b"ok"])
        assert first.reply() == b"ok"
    finally:
        client.close()
        sock.close()
        ctx.term()


def test_agents_talk_to_a_producer_that_does_not_multiplex_one_request_at_a_time():
    """A producer that announces no ``multiplexed`` (the release before): the consumer's link
    stays one-at-a-time; reads, heartbeats, Done and abort all work over it."""
    import msgspec
    import numpy as np

    from kvxfer import AbortOutcome, Agent, AgentConfig, KVSpec
    from kvxfer.backend.fake import FakeBackend, FakeWorld

    from agent_helpers_memory import wait_for

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8, dtype="float16", model="m")
    world = FakeWorld()
    agents = []
    try:
        for name in ("old-producer", "consumer"):
            cfg = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0, handshake_timeout=2.0)
            agent = Agent(name, spec, cfg, backend=FakeBackend(name, world))
            agent.register([np.random.default_rng(len(agents)).integers(0, 1 << 16, size=s, dtype=np.uint16)
                            for s in spec.tensor_shapes()])
            agents.append(agent)
        prod, cons = agents
        current = prod._peer_info
        prod._peer_info = lambda: msgspec.structs.replace(current(), multiplexed=False)
        prod.listen()
        prod.hold("r", [1, 2])
        prod.hold("q", [3])
        link = cons.connect(*prod.address)
        assert link.info.multiplexed is False and link.client.multiplexed is False
        assert cons.keepalive(prod.address, ["r", "q"]).gone == ()
        cons.read(prod.address, [5, 6], [1, 2], "r").wait(5)
        assert wait_for(lambda: not prod.holding("r"))
        cons._done.send(link, "q")             # a Done on the one-at-a-time session
        assert wait_for(lambda: not prod.holding("q"))
        prod.hold("z", [4])
        assert cons.abort("z", remote=prod.address) is AbortOutcome.RELEASED
    finally:
        for agent in agents:
            agent.close()
