"""``AgentConfig.peer_idle_ttl`` (vLLM's ``engine_ttl``): a producer's link unused that long is
forgotten, and the next read handshakes afresh, exact; a link a read may still use is kept."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer import AgentConfig, ConfigError, KVSpec
from kvxfer.agent.peers import PeerDirectory

from nixl_peers import Producer, cache_for, free_port_block
from test_agent_nixl import COMMON, consumer


def test_an_idle_producer_is_forgotten_and_the_next_read_handshakes_afresh(producers):
    spec = KVSpec(**COMMON)
    src, dst = [31, 2, 17, 18], [3, 4, 20, 47]
    prod = Producer(spec, seed=1, port=free_port_block(), holds={"r1": src, "r2": src})
    producers.append(prod)
    cons, cache = consumer(spec, peer_idle_ttl=0.4)
    with cons:
        cons.read(prod.address, dst, src, "r1").wait(30)
        first = cons._peers.cached(*prod.address)
        assert first is not None
        deadline = time.monotonic() + 10
        while not first.closed and time.monotonic() < deadline:  # looking does not use the link
            time.sleep(0.05)
        assert first.closed, "the idle link was kept"
        assert cons._peers.cached(*prod.address) is None
        cache[0][:, dst] = 0
        cons.read(prod.address, dst, src, "r2").wait(30)  # a fresh handshake, then the read
        assert cons._peers.cached(*prod.address) is not first
        want = cache_for(spec, 1)
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cache[layer][:, dst], want[layer][:, src])


def _directory(now):
    return PeerDirectory(codec=None, local_info=None, add_peer=None, remove_peer=lambda name: None,
                         timeout=1.0, now=lambda: now[0])


def _link(port):
    link = SimpleNamespace(host="h", port=port, agent_name=f"peer-{port}", closed=False, engine_id=f"e{port}",
                           healthy=lambda: True)
    link.close = lambda: setattr(link, "closed", True)
    return link


def test_forget_idle_keeps_links_used_within_the_ttl_and_links_in_use():
    now = [100.0]
    peers = _directory(now)
    links = {port: _link(port) for port in (1, 2, 3)}
    for port, link in links.items():
        peers._links[("h", port)] = link
        peers._used[("h", port)] = 100.0
    now[0] = 105.0
    peers.cached("h", 3)                                    # handed out again: fresh
    now[0] = 110.5
    gone = peers.forget_idle(10.0, busy=lambda link: link.port == 2)
    assert gone == [links[1]] and links[1].closed
    assert not links[2].closed and not links[3].closed      # in use; used 5.5 s ago
    assert peers.cached("h", 1) is None and peers.cached("h", 2) is links[2]


@pytest.mark.parametrize("bad", [-1, True, "soon", float("nan"), float("inf")])
def test_a_bad_peer_idle_ttl_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="peer_idle_ttl"):
        AgentConfig(peer_idle_ttl=bad)


def test_zero_means_never():
    assert AgentConfig(peer_idle_ttl=0).peer_idle_ttl is None
