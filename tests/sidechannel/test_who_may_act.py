"""Who may act on a hold (issue 13, Found 5): a hold may name its consumer engines; then only
they may claim, heartbeat or abort it, and ``abort()`` reports what happened.

On the old code any client's ``Abort('victim')`` released another consumer's hold and ``abort()``
returned nothing.
"""

import numpy as np
import pytest

from kvxfer import AbortOutcome, Agent, AgentConfig, KVSpec, LeaseExpiredError
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.testing import MemoryNetwork, MemoryTransport

from sidechannel_peers import HOLD_BLOCKS, Peer, assert_read, consumer, free_port_block


@pytest.fixture
def peers():
    started = []
    yield started
    for p in started:
        p.stop()


def test_an_abort_from_another_engine_is_refused_and_the_named_consumer_still_reads(peers):
    """Real processes: the producer holds 'victim' for the consumer named "consumer"; an agent
    named "intruder" aborts it: REFUSED, still held; the named consumer's read is exact."""
    prod = Peer(1, free_port_block(1), {})
    peers.append(prod)
    assert prod.ask(("hold", "victim", "consumer")) is True
    intruder, _ = consumer("intruder")
    cons, cache = consumer("consumer")
    with intruder, cons:
        assert intruder.abort("victim", remote=prod.address) is AbortOutcome.REFUSED
        assert prod.ask("holding") == ["victim"]
        with pytest.raises(LeaseExpiredError, match="other consumer"):
            intruder.read(prod.address, [0, 1, 2, 3], HOLD_BLOCKS, "victim").wait()
        cons.read(prod.address, [4, 5, 6, 7], HOLD_BLOCKS, "victim").wait(30)
        assert_read(cache, [4, 5, 6, 7], 1, HOLD_BLOCKS)


SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8, dtype="float16", model="m")


@pytest.fixture
def agents():
    made: list[Agent] = []
    fake, network = FakeWorld(), MemoryNetwork()

    def make(name: str, listen: bool = False) -> Agent:
        cfg = AgentConfig(side_channel_host="10.9.9.9", side_channel_port=0, handshake_timeout=1.0)
        agent = Agent(name, SPEC, cfg, backend=FakeBackend(name, fake), transport=MemoryTransport(network))
        agent.register([np.zeros(s, np.uint16) for s in SPEC.tensor_shapes()])
        if listen:
            agent.listen()
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def test_only_named_engines_may_claim_heartbeat_or_abort(agents):
    prod, named, other = agents("prod", listen=True), agents("decode-a"), agents("decode-b")
    prod.hold("r", [1, 2], consumer_engines=["decode-a"])
    prod.hold("s", [3], consumer_engines=[named.engine_id])      # an exact engine id names one start only
    prod.hold("open", [4])                                        # names nobody: anyone may act
    assert other.keepalive(prod.address, ["r", "s", "open"]).gone == ("r", "s")   # not extended for it
    with pytest.raises(LeaseExpiredError, match="other consumer"):
        other.read(prod.address, [0, 1], [1, 2], "r").wait()
    assert other.abort("s", remote=prod.address) is AbortOutcome.REFUSED
    assert prod.holding("r") and prod.holding("s")
    assert named.keepalive(prod.address, ["r", "s"]).gone == ()
    named.read(prod.address, [0], [3], "s").wait(5)
    assert named.abort("r", remote=prod.address) is AbortOutcome.RELEASED
    assert other.abort("open", remote=prod.address) is AbortOutcome.RELEASED
    assert not prod.holding("r") and not prod.holding("open")
