"""Helpers for agent tests: agents over the in-process FakeBackend (real bytes) whose side channel
is ``kvxfer.testing.MemoryTransport`` (real sessions and codec, no sockets, no ports); a test about
the ZMQ transport itself asks for it with ``zmq=True``."""

import itertools

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.testing import MemoryNetwork, MemoryTransport, wait_for  # noqa: F401 - tests import it from here

_names = itertools.count()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def spec(**kw) -> KVSpec:
    base = dict(num_layers=3, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=12,
                dtype="float16", model="tiny")
    base.update(kw)
    return KVSpec(**base)


def make_cache(s: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for shape in s.tensor_shapes()]


class Harness:
    """Builds agents that share one fake world and close them at the end."""

    def __init__(self) -> None:
        self.world = FakeWorld()
        self.network = MemoryNetwork()
        self.agents: list[Agent] = []

    def agent(self, s: KVSpec, *, port: int | None = None, seed: int = 0, listen: bool = True,
              clock=None, zmq: bool = False, **cfg) -> tuple[Agent, list[np.ndarray]]:
        """An agent (listening by default) with a seeded cache; ``zmq``: the real ZMQ side channel
        on a free loopback port instead of the in-memory one."""
        name = f"a{next(_names)}"
        if port is None:
            port = free_port() if zmq else 0
        config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port,
                             handshake_timeout=cfg.pop("handshake_timeout", 2.0), **cfg)
        transport = None if zmq else MemoryTransport(self.network)
        agent = Agent(name, s, config, backend=FakeBackend(name, self.world), clock=clock, transport=transport)
        cache = make_cache(s, seed)
        agent.register(cache)
        if listen:
            agent.listen()
        self.agents.append(agent)
        return agent, cache

    def close(self) -> None:
        for a in self.agents:
            a.close()


