"""Helpers for integration tests: producer ranks in their own processes over real NIXL + ZMQ."""

import multiprocessing as mp

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import free_port_block  # noqa: F401 - the tests import it from here


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _stall(after: int) -> None:
    """Make the host pair kernel's events stop completing after ``after`` launches (the staged
    pack stream then stalls mid-transfer, so a test can act while a transfer is surely under way)."""
    import kvxfer.gpu.host as host

    count = [0]

    def record(self, stream=None):
        count[0] += 1
        self.done = count[0] <= after

    host._Event.record = record


def _producer(spec_kwargs: dict, seed: int, port: int, holds: dict, cmd, out, cfg: dict,
              stall_after: int | None = None) -> None:
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


class Producer:
    """A producer rank running in a spawned process; talk to it through queues.

    ``stall_after=n``: its staged pack stream stops completing after ``n`` pieces (see ``_stall``).
    """

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, stall_after: int | None = None,
                 **cfg) -> None:
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
