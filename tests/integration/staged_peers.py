"""Producer ranks for the staged-path tests: spawned processes over real NIXL (UCX) + ZMQ, in DRAM.

Like ``nixl_peers.Producer``, plus a view of the producer's staged-read state and a stall:
``stall_after=n`` makes the producer's pack stream stop completing after ``n`` pieces (the host
kernel's events never complete again), so a test can act while a transfer is surely mid-way.
"""

import multiprocessing as mp

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

from nixl_peers import cache_for


def _stall(after: int) -> None:
    import kvxfer.gpu.host as host

    count = [0]

    def record(self, stream=None):
        count[0] += 1
        self.done = count[0] <= after

    host._Event.record = record


def _producer(spec_kwargs: dict, seed: int, port: int, holds: dict, cmd, out, cfg: dict,
              stall_after: int | None) -> None:
    if stall_after is not None:
        _stall(stall_after)
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
            elif what == "serving":  # staged reads being served, staging slots in use
                out.put((agent._packer.serving(), agent._kit.slots_in_use))


class StagedProducer:
    """A producer rank (``transfer_path="staged"`` by default) in a spawned process."""

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, stall_after: int | None = None,
                 **cfg) -> None:
        cfg.setdefault("transfer_path", "staged")
        cfg.setdefault("pipeline_slot_bytes", 16 << 10)
        cfg.setdefault("pipeline_slots", 4)
        ctx = mp.get_context("spawn")
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        self.proc = ctx.Process(target=_producer,
                                args=(kwargs, seed, port, holds, self.cmd, self.out, cfg, stall_after),
                                daemon=True)
        self.proc.start()
        tag, self.address = self.out.get(timeout=300)  # generous: CI hosts can be loaded
        assert tag == "ready"

    def ask(self, what: str):
        self.cmd.put(what)
        return self.out.get(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(20)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.cmd.put("stop")
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


def logical(spec: KVSpec, cache: list[np.ndarray], ids) -> np.ndarray:
    """Oracle: ``[layers, K/V, tokens, heads_per_rank, head_dim]`` of ``ids`` from split-storage tensors."""
    out = []
    for t in cache:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)   # [2, blocks, heads, bs, hd] -> [2, blocks, bs, heads, hd]
        sel = t[:, list(ids)]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def expect_read(consumer: KVSpec, c_cache0: list[np.ndarray], c_ids, producers: list[tuple[KVSpec, list]],
                p_ids) -> np.ndarray:
    """The consumer's logical view of ``c_ids`` after reading ``p_ids`` from every producer rank."""
    want = logical(consumer, c_cache0, c_ids).copy()
    c0 = consumer.first_head
    for spec, cache in producers:
        src = logical(spec, cache, p_ids)
        p0 = spec.first_head
        lo, hi = max(p0, c0), min(p0 + spec.heads_per_rank, c0 + consumer.heads_per_rank)
        want[:, :, :, lo - c0:hi - c0] = src[:, :, :, lo - p0:hi - p0]
    return want
