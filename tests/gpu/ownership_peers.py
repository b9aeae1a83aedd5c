"""A GPU producer whose engine reuses blocks the moment ``finished()`` reports them free (tests only).

Commands (tuples): ``("hold", rid, blocks, lease)``, ``("hold_token", rid, blocks, lease)`` (answers
the hold's token as it travels, issue 35), ``("release", rid)``, ``("reused",)`` (rids overwritten so
far), ``("status", rid)``, ``("stats",)`` (``Agent.stats()`` as a dict): the token tests' shared
engine and commands (tests/token_faults.py); ``("reset",)`` (the cache back to its seed), ``"stop"``.
"""

from __future__ import annotations

from kvxfer.testing import ProducerProcess
from token_faults import NOT_MINE, ReusingEngine, token_command

from .agent_peers import device_cache

#: What the reusing engine writes into blocks it got back (an int16 pattern).
REUSED = 0x1DEA


def _producer(cmd, out, spec_kwargs, seed, port, device, cfg) -> None:
    import torch

    from kvxfer import Agent, AgentConfig, KVSpec

    torch.cuda.set_device(device)
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
    with Agent(f"gpu-owner{spec.tp_rank}", spec, config) as agent:
        cache = device_cache(spec, seed, device)
        torch.cuda.synchronize()
        agent.register(cache)
        agent.listen()

        def overwrite(ids: list[int]) -> None:  # the serving engine reuses blocks as soon as they are free
            for t in cache:
                t[:, ids] = REUSED
            torch.cuda.synchronize()

        engine = ReusingEngine(agent, overwrite)
        out.put(("ready", agent.address))
        while True:
            what = cmd.get(timeout=300)
            if what == "stop":
                engine.stop()
                return
            op = what[0]
            answer = token_command(agent, engine, op, what[1:])
            if answer is not NOT_MINE:
                out.put(answer)
            elif op == "reset":  # the cache back to its seeded bytes (earlier trials reused blocks)
                for t, fresh in zip(cache, device_cache(spec, seed, device)):
                    t.copy_(fresh)
                torch.cuda.synchronize()
                out.put(True)
            else:
                out.put(ValueError(f"unknown command {what!r}"))


class OwnerProducer(ProducerProcess):
    def __init__(self, spec, seed: int, port: int, device: int, **cfg) -> None:
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        super().__init__(_producer, kwargs, seed, port, device, cfg)

    def ask(self, what, timeout: float = 60.0):
        self.cmd.put(what)
        return self.out.get(timeout=timeout)
