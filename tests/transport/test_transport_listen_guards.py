"""What ``Agent.listen`` promises about its side-channel listener, over real ZMQ sockets and agents on
the FakeBackend: one warning when it binds a non-loopback address without a key, and ZMQ's
``MAXMSGSIZE`` set from ``AgentConfig.max_message_bytes`` (a bigger frame drops its sender, never
the listener)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.backend.fake import FakeBackend, FakeWorld

SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=8, dtype="float16", model="tiny")
KEY = b"listen-guard-test-key-0123456789"


@pytest.fixture
def agents():
    """Builds registered, not yet listening agents on one fake world; closes them at the end."""
    world, made = FakeWorld(), []

    def make(name: str, **cfg) -> Agent:
        cfg.setdefault("side_channel_host", "127.0.0.1")
        agent = Agent(name, SPEC, AgentConfig(side_channel_port=0, handshake_timeout=2.0, **cfg),
                      backend=FakeBackend(name, world))
        agent.register([np.zeros(shape, dtype=np.uint16) for shape in SPEC.tensor_shapes()])
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


@pytest.mark.parametrize("host,key,warned", [
    ("0.0.0.0", None, True),       # reachable from other hosts, unauthenticated: warn
    ("0.0.0.0", KEY, False),       # a key authenticates every frame
    ("127.0.0.1", None, False),    # loopback: only this host can reach it
])
def test_a_non_loopback_listener_without_a_key_logs_exactly_one_warning(agents, caplog, host, key, warned):
    caplog.set_level(logging.WARNING)
    agent = agents("producer", side_channel_host=host, auth_key=key)
    _, port = agent.listen()
    agent.listen()  # idempotent: no second line
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if not warned:
        assert warnings == []
        return
    assert len(warnings) == 1, warnings
    [line] = warnings
    for says in (f"0.0.0.0:{port}", "without a shared key", "AgentConfig.auth_key", "KVXFER_AUTH_KEY"):
        assert says in line


def _next_event(monitor: zmq.Socket, timeout_ms: int = 5000) -> int | None:
    return recv_monitor_message(monitor)["event"] if monitor.poll(timeout_ms) else None


def test_a_frame_over_max_message_bytes_drops_its_sender_and_the_agent_keeps_serving(agents):
    producer = agents("producer", max_message_bytes=64 << 10)
    host, port = producer.listen()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RECONNECT_IVL, 60_000)  # once dropped, stay away for the rest of the test
    monitor = raw.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        raw.connect(f"tcp://{host}:{port}")
        assert _next_event(monitor) == zmq.EVENT_CONNECTED
        raw.send(b"KVXF" + b"\x00" * (1 << 20))
        assert _next_event(monitor) == zmq.EVENT_DISCONNECTED   # ZMQ dropped the sender ...
        assert not raw.poll(200)                                 # ... answering nothing
        assert producer._server.counters()["frames"] == 0       # the frame never reached the server
    finally:
        raw.disable_monitor()
        monitor.close(0)
        raw.close(0)
    consumer = agents("consumer")
    consumer.connect(host, port)                                 # the listener still serves handshakes
    assert producer.stats().sessions == 1 and producer.stats().rejected_frames == {}
