"""GPU producer ranks for the Agent GPU-path tests: spawned processes with torch CUDA caches (tests only)."""

from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np


def free_port_block(n: int = 4) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                socks.append(t)
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no block of free ports")


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


def logical(spec, cache: list[np.ndarray], ids) -> np.ndarray:
    """Oracle: ``[layers, K/V, tokens, heads_per_rank, head_dim]`` of ``ids`` (split storage)."""
    out = []
    for t in cache:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)
        sel = t[:, list(ids)]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def expect_read(consumer, c_cache0, c_ids, producers, p_ids) -> np.ndarray:
    want = logical(consumer, c_cache0, c_ids).copy()
    c0 = consumer.first_head
    for spec, cache in producers:
        src = logical(spec, cache, p_ids)
        p0 = spec.first_head
        lo, hi = max(p0, c0), min(p0 + spec.heads_per_rank, c0 + consumer.heads_per_rank)
        want[:, :, :, lo - c0:hi - c0] = src[:, :, :, lo - p0:hi - p0]
    return want
