"""A GPU producer whose engine reuses blocks the moment ``finished()`` reports them free (tests only).

Commands (tuples): ``("hold", rid, blocks, lease)``, ``("hold_token", rid, blocks, lease)`` (answers
the hold's token as it travels, issue 35), ``("reset",)`` (the cache back to its seed), ``("release", rid)``, ``("reused",)`` (rids
overwritten so far), ``("stats",)`` (``Agent.stats()`` as a dict), ``"stop"``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from kvxfer.testing import ProducerProcess

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
        blocks: dict[str, list[int]] = {}
        reused: list[str] = []
        stop = threading.Event()

        def engine() -> None:  # the serving engine: reuse blocks as soon as they are free
            while not stop.is_set():
                fin = agent.finished()
                for rid in sorted(fin.freed):
                    ids = blocks.pop(rid, None)
                    if ids is not None:
                        for t in cache:
                            t[:, ids] = REUSED
                        torch.cuda.synchronize()
                        reused.append(rid)
                time.sleep(0.0005)

        thread = threading.Thread(target=engine, daemon=True)
        thread.start()
        out.put(("ready", agent.address))
        while True:
            what = cmd.get(timeout=300)
            if what == "stop":
                stop.set()
                thread.join(2)
                return
            op = what[0]
            if op == "hold":
                agent.hold(what[1], what[2], lease=what[3])
                blocks[what[1]] = list(what[2])
                out.put(True)
            elif op == "hold_token":  # issue 35: hold and answer the hold's token (``HoldToken.wire()``)
                agent.hold(what[1], what[2], lease=what[3])
                blocks[what[1]] = list(what[2])
                token = agent.hold_token(what[1])
                out.put(token.wire() if token is not None else None)
            elif op == "reset":  # the cache back to its seeded bytes (earlier trials reused blocks)
                for t, fresh in zip(cache, device_cache(spec, seed, device)):
                    t.copy_(fresh)
                torch.cuda.synchronize()
                out.put(True)
            elif op == "release":
                out.put(agent.release(what[1]))
            elif op == "reused":
                out.put(list(reused))
            elif op == "stats":
                out.put(dataclasses.asdict(agent.stats()))


class OwnerProducer(ProducerProcess):
    def __init__(self, spec, seed: int, port: int, device: int, **cfg) -> None:
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        super().__init__(_producer, kwargs, seed, port, device, cfg)

    def ask(self, what, timeout: float = 60.0):
        self.cmd.put(what)
        return self.out.get(timeout=timeout)
