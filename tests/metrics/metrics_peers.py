"""A producer rank with metrics on, in its own process (real NIXL + ZMQ), for the metrics tests."""

from __future__ import annotations

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import ProducerProcess, serve_commands


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _producer(cmd, out, spec_kwargs: dict, seed: int, port: int, holds: dict) -> None:
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, metrics_port=0)
    with Agent("producer", spec, config) as agent:
        agent.register(cache_for(spec, seed))
        agent.listen()
        serve_commands(agent, holds, cmd, out, timeout=120,
                       extra={"metrics_address": lambda a: a.metrics_address})


class MetricsProducer(ProducerProcess):
    """A producer holding ``holds`` (request id -> block ids), serving metrics on a free port."""

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict) -> None:
        super().__init__(_producer, {k: getattr(spec, k) for k in spec.__dataclass_fields__}, seed, port, holds)
        self.metrics_address = self.ask("metrics_address")
