"""Agents joined by ``kvxfer.testing.MemoryTransport``: the real sessions and codec, no sockets, no ports.

The same agent code runs over it as over ZMQ (``Agent(..., transport=...)``): reads are
byte-exact, a closed listener is a lost peer, a new listener at the same address is a restarted
one, and the links heal as they do over ZMQ.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import AbortOutcome, Agent, AgentConfig, KVSpec, PeerLostError
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.testing import MemoryNetwork, MemoryTransport

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8, dtype="float16", model="m")


@pytest.fixture
def world():
    agents: list[Agent] = []
    fake, network = FakeWorld(), MemoryNetwork()

    def make(name: str, seed: int, port: int = 0, listen: bool = True):
        cfg = AgentConfig(side_channel_host="10.1.2.3", side_channel_port=port, handshake_timeout=1.0)
        agent = Agent(name, SPEC, cfg, backend=FakeBackend(name, fake), transport=MemoryTransport(network))
        cache = [np.random.default_rng(seed).integers(0, 1 << 16, size=s, dtype=np.uint16)
                 for s in SPEC.tensor_shapes()]
        agent.register(cache)
        if listen:
            agent.listen()
        agents.append(agent)
        return agent, cache

    yield make
    for agent in agents:
        agent.close()


def test_read_over_the_memory_transport_is_exact_and_binds_no_port(world):
    prod, pcache = world("p", 1)
    cons, ccache = world("c", 2, listen=False)
    assert prod.address == ("10.1.2.3", 20000)  # an address of the in-memory network, not a socket
    prod.hold("r", [1, 5])
    cons.read(prod.address, [0, 3], [1, 5], "r").wait(5)
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 3]], pcache[layer][:, [1, 5]])
    assert prod._server.counters()["sessions"] == 1


def test_a_restarted_peer_heals_the_link_and_abort_reports_its_outcome(world):
    prod, _ = world("p", 1)
    cons, ccache = world("c", 2, listen=False)
    address = prod.address
    prod.hold("a", [2])
    old = cons.connect(*address)
    prod.close()
    assert cons.abort("a", remote=address) is AbortOutcome.UNREACHABLE
    assert cons.keepalive(address, ["a"]).unreachable == (tuple(address),)   # never raises, like abort
    new, pcache = world("p2", 3, port=address[1])
    new.hold("b", [4])
    new.hold("c", [6])
    assert cons.keepalive(address, ["b", "a"]).gone == ("a",)
    assert cons.connect(*address).engine_id == new.engine_id != old.engine_id
    assert cons.abort("c", remote=address) is AbortOutcome.RELEASED and not new.holding("c")
    assert cons.abort("c", remote=address) is AbortOutcome.NOT_HELD
    cons.read(address, [7], [4], "b").wait(5)
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [7]], pcache[layer][:, [4]])


def test_done_heals_a_lost_session_but_never_tells_a_restarted_producer(world):
    """A ``Done`` whose session the producer forgot (evicted) gets one fresh handshake and is
    delivered; one whose producer restarted (another engine at the address) is not sent: the new
    engine never served that read, so it must not count it."""
    from agent_helpers_memory import wait_for

    prod, _ = world("p", 1)
    cons, _ = world("c", 2, listen=False)
    prod.hold("r", [1])
    link = cons.connect(*prod.address)
    prod._server._sessions.clear()          # the producer forgot every session (evicted)
    cons._done.send(link, "r")
    assert wait_for(lambda: not prod.holding("r"))
    address = prod.address
    prod.close()
    new, _ = world("p2", 3, port=address[1])
    new.hold("r", [1])
    seen: list = []
    handle = new._service.handle
    new._service.handle = lambda message, peer: (seen.append(message), handle(message, peer))[1]
    cons._done.send(link, "r")              # the link's engine is gone
    cons._done.send(cons.connect(*address), "other")   # and the queue keeps going
    assert wait_for(lambda: any(getattr(m, "request_id", "") == "other" for m in seen))
    assert [m.request_id for m in seen] == ["other"] and new.holding("r")
