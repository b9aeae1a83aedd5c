"""Helpers for integration tests: producer ranks in their own processes over real NIXL + ZMQ."""

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import ProducerProcess, serve_commands
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


def _producer(cmd, out, spec_kwargs: dict, seed: int, port: int, holds: dict, cfg: dict,
              stall_after: int | None = None) -> None:
    if stall_after is not None:
        _stall(stall_after)
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    with Agent(f"producer{spec.tp_rank}", spec, config) as agent:
        agent.register(cache_for(spec, seed))
        agent.listen()
        serve_commands(agent, holds, cmd, out, timeout=120,
                       # staged reads being served, staging slots in use
                       extra={"serving": lambda a: (a._paths.packer.serving(), a._paths.kit.slots_in_use)})


def spec_kwargs(spec: KVSpec) -> dict:
    return {k: getattr(spec, k) for k in spec.__dataclass_fields__}


class Producer(ProducerProcess):
    """A producer rank running in a spawned process; talk to it through queues.

    ``stall_after=n``: its staged pack stream stops completing after ``n`` pieces (see ``_stall``).
    """

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, stall_after: int | None = None,
                 *, target=_producer, wait: bool = True, **cfg) -> None:
        super().__init__(target, spec_kwargs(spec), seed, port, holds, cfg, stall_after, wait=wait)

    def ask(self, what: str, timeout: float = 60.0):
        return super().ask(what, timeout)
