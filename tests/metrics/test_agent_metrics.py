"""Agent metrics over the in-process FakeBackend (real bytes, real ZMQ, a real HTTP server and client):
counters and histograms from done handles, gauges read at scrape time, the server's lifecycle."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest

from kvxfer import Agent, AgentConfig, ConfigError, KVSpec, TransferFailedError
from kvxfer.testing import FakeBackend, FakeWorld, free_port_block

from metrics_scrape import scrape, scrape_until

SPEC = dict(num_layers=3, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=12, dtype="float16",
            model="tiny")
_names = itertools.count()


class World:
    """Agents over one FakeWorld, each with metrics on a free port; all closed at the end."""

    def __init__(self) -> None:
        self.world = FakeWorld()
        self.agents: list[Agent] = []

    def agent(self, *, listen: bool = True, seed: int = 0, spec: dict | None = None,
              **cfg) -> tuple[Agent, FakeBackend, list]:
        name = f"m{next(_names)}"
        cfg.setdefault("metrics_port", 0)
        cfg.setdefault("side_channel_port", free_port_block(1))
        config = AgentConfig(side_channel_host="127.0.0.1", handshake_timeout=2.0, **cfg)
        backend = FakeBackend(name, self.world)
        agent = Agent(name, KVSpec(**{**SPEC, **(spec or {})}), config, backend=backend)
        self.agents.append(agent)
        rng = np.random.default_rng(seed)
        cache = [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in agent.spec.tensor_shapes()]
        agent.register(cache)
        if listen:
            agent.listen()
        return agent, backend, cache


@pytest.fixture
def world():
    w = World()
    yield w
    for a in w.agents:
        a.close()


def test_reads_are_counted_by_path_and_outcome_with_their_bytes_and_latencies(world):
    prod, _, src = world.agent(seed=1)
    cons, backend, dst = world.agent(listen=False, seed=2)
    for rid, blocks in (("a", [1, 2, 3]), ("b", [4]), ("c", [5, 6])):
        prod.hold(rid, blocks)
    moved = cons.read(prod.address, [7, 8, 9], [1, 2, 3], "a").wait(5).num_bytes
    moved += cons.read(prod.address, [10], [4], "b").wait(5).num_bytes
    np.testing.assert_array_equal(dst[0][:, [7, 8, 9, 10]], src[0][:, [1, 2, 3, 4]])
    backend.fail_next(1)
    failed = cons.read(prod.address, [0, 1], [5, 6], "c")
    with pytest.raises(TransferFailedError):
        failed.wait(5)
    got = scrape_until(cons.metrics_address, lambda g: g.total("kvxfer_agent_transfers_total") >= 3)
    assert moved == 4 * 2 * 3 * 4 * 4 * 16 * 2   # blocks x K/V x layers x tokens x heads x dim x 2 bytes
    assert got.value("kvxfer_agent_transfer_bytes_total", direction="read", path="direct") == moved
    assert got.value("kvxfer_agent_transfers_total", direction="read", path="direct", outcome="ok") == 2
    assert got.value("kvxfer_agent_transfers_total", direction="read", path="direct",
                     outcome="TransferFailedError") == 1
    assert got.total("kvxfer_agent_transfers_total") == 3
    for hist in ("kvxfer_agent_transfer_seconds", "kvxfer_agent_setup_seconds"):
        assert got.value(f"{hist}_count", direction="read", path="direct") == 2
        assert got.value(f"{hist}_sum", direction="read", path="direct") > 0
        assert got.families[hist] == "histogram"
    assert got.value("kvxfer_agent_claim_seconds_count", path="direct") == 2
    assert got.value("kvxfer_agent_claim_seconds_bucket", path="direct", le="+Inf") == 2
    assert got.value("kvxfer_agent_info", engine_id=cons.engine_id, rank="0") == 1
    # the producer moved nothing itself: its transfer counters stay at zero
    assert scrape(prod.metrics_address).total("kvxfer_agent_transfers_total") == 0


def test_writes_are_counted_as_direct_writes(world):
    cons, _, dst = world.agent(seed=3)
    writer, _, src = world.agent(listen=False, seed=4)
    num_bytes = writer.write(cons.address, [2, 3], [5, 6], "w").wait(5).num_bytes
    np.testing.assert_array_equal(dst[1][:, [5, 6]], src[1][:, [2, 3]])
    got = scrape_until(writer.metrics_address, lambda g: g.total("kvxfer_agent_transfers_total") >= 1)
    assert got.value("kvxfer_agent_transfers_total", direction="write", path="direct", outcome="ok") == 1
    assert got.value("kvxfer_agent_transfer_bytes_total", direction="write", path="direct") == num_bytes > 0
    assert got.value("kvxfer_agent_claim_seconds_count", path="direct") == 0   # writes claim nothing


def test_gauges_show_what_the_agent_holds_at_scrape_time(world):
    prod, _, _ = world.agent(seed=5)
    cons, _, _ = world.agent(listen=False, seed=6)
    got = scrape(prod.metrics_address)
    assert got.families["kvxfer_agent_held_requests"] == "gauge"
    assert (got.value("kvxfer_agent_held_requests"), got.value("kvxfer_agent_sessions")) == (0, 0)
    prod.hold("x", [1, 2, 3])
    prod.hold("y", [4, 5])
    got = scrape(prod.metrics_address)
    assert (got.value("kvxfer_agent_held_requests"), got.value("kvxfer_agent_held_blocks")) == (2, 5)
    cons.read(prod.address, [1, 2, 3], [1, 2, 3], "x").wait(5)
    got = scrape_until(prod.metrics_address, lambda g: g.value("kvxfer_agent_held_requests") == 1)
    assert (got.value("kvxfer_agent_held_requests"), got.value("kvxfer_agent_held_blocks")) == (1, 2)  # y
    assert got.value("kvxfer_agent_sessions") == 1
    assert got.value("kvxfer_agent_express_lanes") == 1 == prod.stats().express_lanes  # the consumer's lane
    prod.release("y")
    got = scrape(prod.metrics_address)
    assert (got.value("kvxfer_agent_held_requests"), got.value("kvxfer_agent_held_blocks")) == (0, 0)
    assert got.value("kvxfer_agent_in_flight_transfers") == 0


def test_rejected_frames_are_counted_by_reason(world):
    import zmq

    prod, _, _ = world.agent(seed=7)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{prod.address[0]}:{prod.address[1]}")
    try:
        for _ in range(3):
            sock.send_multipart([b"a", b"b", b"c"])   # a message of the wrong shape
        sock.send(b"garbage" * 10)
        assert sock.poll(5000)   # the garbage frame is answered: every earlier frame was handled
        sock.recv()
    finally:
        sock.close(0)
    got = scrape(prod.metrics_address)
    assert got.families["kvxfer_agent_rejected_frames"] == "counter"
    assert got.value("kvxfer_agent_rejected_frames_total", reason="parts") == 3
    assert got.total("kvxfer_agent_rejected_frames_total") == 4
    assert got.total("kvxfer_agent_rejected_frames_total") == sum(prod.stats().rejected_frames.values())


def test_metrics_are_off_by_default_and_each_agent_has_its_own_port(world):
    off, _, _ = world.agent(metrics_port=None)
    assert off.metrics_address is None
    a, _, _ = world.agent()
    b, _, _ = world.agent()
    assert a.metrics_address[0] == "127.0.0.1" and a.metrics_address[1] != b.metrics_address[1]
    assert a.metrics_address[1] > 0
    assert scrape(a.metrics_address).total("kvxfer_agent_info", engine_id=a.engine_id) == 1
    assert scrape(b.metrics_address).total("kvxfer_agent_info", engine_id=a.engine_id) == 0


def test_ranks_serve_on_consecutive_ports_from_the_base(world):
    base = free_port_block(4)
    sides = free_port_block(4)
    ranks = [world.agent(metrics_port=base, dp_rank=1, side_channel_port=sides,
                         spec={"tp_size": 2, "tp_rank": r})[0] for r in range(2)]
    assert [a.metrics_address for a in ranks] == [("127.0.0.1", base + 2), ("127.0.0.1", base + 3)]
    for rank, agent in zip((2, 3), ranks):
        assert scrape(agent.metrics_address).value("kvxfer_agent_info", engine_id=agent.engine_id,
                                                   rank=str(rank)) == 1


def test_close_stops_the_server(world):
    agent, _, _ = world.agent()
    address = agent.metrics_address
    scrape(address)
    agent.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{address[0]}:{address[1]}/metrics", timeout=2)


def test_a_port_in_use_is_a_config_error(world):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            world.agent(metrics_port=port)


def test_missing_prometheus_client_is_a_config_error_naming_it(world, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)   # import now raises ImportError
    with pytest.raises(ConfigError, match="prometheus-client is not installed"):
        world.agent()
    off, _, _ = world.agent(metrics_port=None)   # metrics off: the package is not needed
    assert off.metrics_address is None


def test_prometheus_client_is_imported_only_when_metrics_are_on():
    code = ("import sys; from kvxfer import Agent, AgentConfig, KVSpec\n"
            "from kvxfer.testing import FakeBackend, FakeWorld\n"
            f"spec = KVSpec(**{SPEC!r})\n"
            "with Agent('a', spec, AgentConfig(), backend=FakeBackend('a', FakeWorld())):\n"
            "    pass\n"
            "print('prometheus_client' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
