"""Helpers for integration tests: producer ranks in their own processes over real NIXL + ZMQ."""

import multiprocessing as mp
import socket

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec


def free_port_block(n: int = 4) -> int:
    """A base port with ``n`` consecutive free ports after it (best effort)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                socks.append(t)
            for t in socks:
                t.close()
            return base
        except OSError:
            for t in socks:
                t.close()
    raise RuntimeError("no block of free ports")


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _producer(spec_kwargs: dict, seed: int, port: int, holds: dict, cmd, out, cfg: dict) -> None:
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    with Agent(f"producer{spec.tp_rank}", spec, config) as agent:
        agent.register(cache_for(spec, seed))
        agent.listen()
        for rid, blocks in holds.items():
            agent.hold(rid, blocks)
        out.put(("ready", agent.address))
        while True:
            what = cmd.get(timeout=120)
            if what == "stop":
                return
            if what == "finished":
                fin = agent.finished()
                out.put((sorted(fin.sent), sorted(fin.expired)))
            elif what == "holding":
                out.put(sorted(rid for rid in holds if agent.holding(rid)))


class Producer:
    """A producer rank running in a spawned process; talk to it through queues."""

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, **cfg) -> None:
        ctx = mp.get_context("spawn")
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        self.proc = ctx.Process(target=_producer, args=(kwargs, seed, port, holds, self.cmd, self.out, cfg),
                                daemon=True)
        self.proc.start()
        tag, self.address = self.out.get(timeout=120)
        assert tag == "ready"

    def ask(self, what: str):
        self.cmd.put(what)
        return self.out.get(timeout=60)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.cmd.put("stop")
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
