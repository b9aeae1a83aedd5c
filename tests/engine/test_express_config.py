"""Where an agent's express lane listens (AgentConfig.express_port), over FakeBackend and real ZMQ + TCP."""

import socket

import pytest

from kvxfer import ConfigError
from kvxfer.testing import free_port_block

from agent_helpers import spec


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_fixed_express_port_is_offset_by_rank_announced_and_used(harness):
    base = free_port_block(4)
    side = free_port_block(4)
    producers = [harness.agent(spec(tp_size=2, tp_rank=r), port=side, seed=r, express_port=base, zmq=True)[0]
                 for r in range(2)]
    assert [p._server.express_port for p in producers] == [base, base + 1]
    assert all(_listening(p) for p in (base, base + 1))
    consumer, _ = harness.agent(spec(tp_size=2, tp_rank=0), listen=False, zmq=True)
    link = consumer.connect("127.0.0.1", side + 1)
    assert link.info.express_port == base + 1 and link.client.express


def test_a_taken_express_port_is_a_config_error_naming_it(harness):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"express lane cannot listen on 127.0.0.1:{port}"):
            harness.agent(spec(), express_port=port, zmq=True)


def test_express_off_announces_no_port_and_opens_none(harness):
    producer, _ = harness.agent(spec(), express_port=None, zmq=True)
    assert producer._server.express_port == 0
    consumer, _ = harness.agent(spec(), listen=False, zmq=True)
    link = consumer.connect(*producer.address)
    assert link.info.express_port == 0 and not link.client.express


def test_with_a_key_the_lane_carries_signed_requests_and_a_forged_one_changes_nothing(harness):
    from kvxfer.protocol import Abort, Codec, Reject
    from kvxfer.transport.express import ATTACH, ATTACHED, HEADER, FrameReader, frame

    key = b"a-shared-key-of-32-bytes-length!"
    producer, pcache = harness.agent(spec(), seed=1, auth_key=key, zmq=True)
    consumer, cache = harness.agent(spec(), seed=2, listen=False, auth_key=key, zmq=True)
    producer.hold("r", [1, 2])
    producer.hold("kept", [3])
    consumer.read(producer.address, [5, 6], [1, 2], "r").wait(5)
    assert [t[:, [5, 6]].tobytes() for t in cache] == [t[:, [1, 2]].tobytes() for t in pcache]
    link = consumer.connect(*producer.address)
    assert link.client.express and producer.stats().express_lanes == 1
    # Someone who learned the session's routing id attaches a second lane and sends an Abort
    # signed with another key: the session refuses it and the hold stays.
    forged = Codec(consumer._codec.compat, key=b"another-key-of-32-bytes-length!!").encode(Abort("kept", consumer.engine_id))
    with socket.create_connection(("127.0.0.1", link.info.express_port), timeout=5) as s:
        s.settimeout(5)
        s.sendall(frame(0, ATTACH + link.client._identity))
        reader = FrameReader(1 << 20)
        got = []
        while not got:
            got = reader.feed(s.recv(1 << 16))
        assert got[0][1] == ATTACHED
        s.sendall(frame(9, forged))
        got = []
        while not got:
            got = reader.feed(s.recv(1 << 16))
    rid, reply = got[0]
    assert rid == 9 and isinstance(Codec(consumer._codec.compat, key=key).decode(reply), Reject)
    assert producer.holding("kept")
