"""GPU producer ranks for the Agent GPU-path tests: spawned processes with torch CUDA caches (tests only)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

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


def _producer(spec_kwargs, seed, port, device, holds, cmd, out, cfg) -> None:
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
        for rid, blocks in holds.items():
            agent.hold(rid, blocks)
        out.put(("ready", agent.address))
        while True:
            what = cmd.get(timeout=300)
            if what == "stop":
                return
            if what == "holding":
                out.put(sorted(rid for rid in holds if agent.holding(rid)))
            elif what == "finished":
                fin = agent.finished()
                out.put((sorted(fin.sent), sorted(fin.expired)))


class GpuProducer:
    def __init__(self, spec, seed: int, port: int, device: int, holds: dict, **cfg) -> None:
        ctx = mp.get_context("spawn")
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        self.proc = ctx.Process(target=_producer, args=(kwargs, seed, port, device, holds, self.cmd, self.out, cfg),
                                daemon=True)
        self.proc.start()
        tag, self.address = self.out.get(timeout=300)
        assert tag == "ready"

    def ask(self, what: str):
        self.cmd.put(what)
        return self.out.get(timeout=120)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.cmd.put("stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
