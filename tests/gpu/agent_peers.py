"""GPU producer ranks for the Agent GPU-path tests: spawned processes with torch CUDA caches (tests only)."""

from __future__ import annotations

import numpy as np

from kvxfer.testing import ProducerProcess, serve_commands
from kvxfer.testing import expected_read as expect_read  # noqa: F401 - the tests import them from here
from kvxfer.testing import free_port_block  # noqa: F401
from kvxfer.testing import logical_kv as logical  # noqa: F401


def host_cache(spec, seed: int) -> list[np.ndarray]:
    """Seeded bytes of a cache (int16 stands for any 2-byte dtype: registration checks the itemsize)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-(1 << 15), 1 << 15, size=s, dtype=np.int16) for s in spec.tensor_shapes()]


def device_cache(spec, seed: int, device: int):
    import torch

    return [torch.from_numpy(a).to(f"cuda:{device}") for a in host_cache(spec, seed)]


def _producer(cmd, out, spec_kwargs, seed, port, device, holds, cfg) -> None:
    import torch

    from kvxfer import Agent, AgentConfig, KVSpec

    torch.cuda.set_device(device)
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    with Agent(f"gpu-producer{spec.tp_rank}", spec, config) as agent:
        cache = device_cache(spec, seed, device)
        torch.cuda.synchronize()
        agent.register(cache)
        agent.listen()
        serve_commands(agent, holds, cmd, out)


class GpuProducer(ProducerProcess):
    def __init__(self, spec, seed: int, port: int, device: int, holds: dict, **cfg) -> None:
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        super().__init__(_producer, kwargs, seed, port, device, holds, cfg)


def _host_producer(cmd, out, spec_kwargs, seed, port, holds, cfg) -> None:
    from kvxfer import Agent, AgentConfig, KVSpec

    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    with Agent(f"host-producer{spec.tp_rank}", spec, config) as agent:
        agent.register(host_cache(spec, seed))
        agent.listen()
        serve_commands(agent, holds, cmd, out)


class HostProducer(ProducerProcess):
    """A producer rank whose cache is host memory (numpy), e.g. a CPU offload tier."""

    def __init__(self, spec, seed: int, port: int, holds: dict, **cfg) -> None:
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        super().__init__(_host_producer, kwargs, seed, port, holds, cfg)
