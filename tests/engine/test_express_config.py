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
    producers = [harness.agent(spec(tp_size=2, tp_rank=r), port=side, seed=r, express_port=base)[0]
                 for r in range(2)]
    assert [p._server.express_port for p in producers] == [base, base + 1]
    assert all(_listening(p) for p in (base, base + 1))
    consumer, _ = harness.agent(spec(tp_size=2, tp_rank=0), listen=False)
    link = consumer.connect("127.0.0.1", side + 1)
    assert link.info.express_port == base + 1 and link.client.express


def test_a_taken_express_port_is_a_config_error_naming_it(harness):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"express lane cannot listen on 127.0.0.1:{port}"):
            harness.agent(spec(), express_port=port)


def test_express_off_announces_no_port_and_opens_none(harness):
    producer, _ = harness.agent(spec(), express_port=None)
    assert producer._server.express_port == 0
    consumer, _ = harness.agent(spec(), listen=False)
    link = consumer.connect(*producer.address)
    assert link.info.express_port == 0 and not link.client.express
