"""Helpers for the chaos tests: kvxfer agents in their own processes over real NIXL + ZMQ,
driven by tuple commands, whose engine *reuses* blocks the moment ``finished()`` says they are free.

``Peer`` runs one agent (registered, listening) in a spawned process; its engine and the hold and
token commands are the token tests' shared ones (tests/token_faults.py). Commands (``ask``):

* ``("hold", rid, blocks, lease, reuse)``: hold ``blocks``; with ``reuse`` the agent's engine
  overwrites them with ``REUSED`` as soon as ``finished()`` reports ``rid`` sent or expired
  (what a serving engine does with freed blocks); ``("token", rid)``: ``hold_token(rid).wire()`` or None;
  ``("hold_token", rid, blocks, lease, reuse)``: ``hold`` answering the token;
* ``("reset",)``: refill the cache from its seed; ``("hold_many", [(rid, blocks), ...])``; ``("release", rid)``; ``("stats",)`` (``Agent.stats()``
  as a dict); ``("rss",)``; ``("reused",)`` (rids overwritten so far, in order);
* ``("blocks", ids)``: the cache's blocks ``ids`` (per layer arrays) as they are now;
* ``("read", address, local, remote, rid, timeout)``: start a read and answer at once;
* ``("write", address, local, remote, rid, timeout)``: write and wait; answers "ok" or the error's type name;
* ``("status", rid)``: ``Agent.status(rid)``'s value;
* ``("spin", seconds)``: the main thread (the engine) runs Python for ``seconds`` before it answers
  (a busy engine thread: kvxfer's threads must win the interpreter from it);
* ``("seize", seconds, marker)``: C code holds this process's interpreter (the GIL) for whole
  ``seconds``, so none of its Python threads runs, kvxfer's included; ``marker`` (a path) is
  written at its start; answers (start, end) in ``time.time()``;
* ``("die_after_grant", delay)``: from now on, the process SIGKILLs itself ``delay`` seconds after it
  first answers a claim with a grant (a producer that dies between the grant and the read's move).
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KvxferError, KVSpec
from kvxfer.testing import ProducerProcess, free_port_block, spin_python
# freeze and wait_until are re-exported for the chaos modules
from token_faults import NOT_MINE, ReusingEngine, freeze, token_command, wait_until  # noqa: F401

#: The value a reusing engine writes into blocks it got back.
REUSED = 0xDEAD
#: The value a consumer's destination holds before a read (to see late bytes).
SENTINEL = 0x5A5A

# 4 layers x 8 heads x 128 dim x 16 tokens, bf16: 256 KiB per block over all layers and K/V.
BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=640,
           dtype="bfloat16", model="chaos")


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(cmd, out, spec_kwargs: dict, seed: int, port: int, cfg: dict) -> None:
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(**{"side_channel_host": "127.0.0.1", **cfg}, side_channel_port=port)
    with Agent(f"chaos{spec.tp_rank}", spec, config) as agent:
        cache = cache_for(spec, seed)
        agent.register(cache)
        agent.listen()
        engine = ReusingEngine(agent, lambda ids: _overwrite(cache, ids))
        engine.cache, engine.seed = cache, seed
        handles = []
        out.put(("ready", agent.address))
        while True:
            what = cmd.get(timeout=600)
            if what == "stop":
                engine.stop()
                return
            out.put(_answer(agent, engine, handles, what))


def _overwrite(cache: list[np.ndarray], ids: list[int]) -> None:
    for t in cache:
        t[:, ids] = REUSED


def _answer(agent: Agent, engine: ReusingEngine, handles: list, what: tuple):
    op, args = what[0], what[1:]
    answer = token_command(agent, engine, op, args)
    if answer is not NOT_MINE:
        return answer
    if op == "reset":  # the cache back to its seeded bytes (after earlier cases reused blocks)
        for t, fresh in zip(engine.cache, cache_for(agent.spec, engine.seed)):
            t[...] = fresh
        return True
    if op == "hold_many":
        for rid, blocks in args[0]:
            agent.hold(rid, blocks)
        return True
    if op == "rss":
        return rss()
    if op == "spin":
        return spin_python(args[0])
    if op == "seize":
        return _seize(*args)
    if op == "die_after_grant":
        _die_after_grant(agent, args[0])
        return True
    if op == "blocks":
        return [t[:, list(args[0])].copy() for t in engine.cache]
    if op == "read":
        address, local, remote, rid, timeout = args
        handles.append(agent.read(tuple(address), local, remote, rid, timeout=timeout))
        return "started"
    if op == "outcome":  # the last read's handle: "pending", "exact" or its error's type
        handle = handles[-1]
        if not handle.done():
            return "pending"
        error = handle.exception()
        return "exact" if error is None else type(error).__name__
    if op == "write":
        address, local, remote, rid, timeout = args
        try:
            agent.write(tuple(address), local, remote, rid, timeout=timeout).wait(timeout + 5)
        except KvxferError as exc:
            return type(exc).__name__
        return "ok"
    raise ValueError(f"unknown command {what!r}")


def _seize(seconds: int, marker: str) -> tuple[float, float]:
    """Sleep in libc through ``PyDLL`` (whose calls keep the GIL): no Python runs here meanwhile."""
    libc = ctypes.PyDLL(None)
    start = time.time()
    with open(marker, "w") as f:
        f.write("seized")
    libc.sleep(ctypes.c_uint(int(seconds)))
    return start, time.time()


def _die_after_grant(agent: Agent, delay: float) -> None:
    """Wrap the producer's answer to claims: the first grant arms a SIGKILL of this process."""
    import os
    import signal

    from kvxfer.protocol import Grant, Grants

    service = agent._service
    handle = service.handle
    armed = []

    def answer(message, peer):
        reply = handle(message, peer)
        granted = isinstance(reply, Grant) or (
            isinstance(reply, Grants) and any(isinstance(r, Grant) for r in reply.replies))
        if granted and not armed:
            armed.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)))
            armed[0].start()
        return reply

    service.handle = answer


class Peer(ProducerProcess):
    """An agent in a spawned process (see the module doc); ``pid`` for signals."""

    def __init__(self, spec: KVSpec, seed: int, port: int | None = None, *, wait: bool = True, **cfg) -> None:
        self.spec = spec
        port = port if port is not None else free_port_block(1)
        kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        super().__init__(_serve, kwargs, seed, port, cfg, wait=wait)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, what, timeout: float = 60.0):
        self.cmd.put(what)
        return self.out.get(timeout=timeout)


def start_all(spec: KVSpec, seeds, **cfg) -> list[Peer]:
    """Several peers started side by side (spawning is the slow part), each ready."""
    peers = [Peer(spec, seed, wait=False, **cfg) for seed in seeds]
    for peer in peers:
        peer.ready()
    return peers


def consumer(spec: KVSpec, seed: int = 99, **cfg) -> tuple[Agent, list[np.ndarray]]:
    """A consumer agent in this process (not listening), its cache filled from ``seed``."""
    cfg.setdefault("side_channel_host", "127.0.0.1")
    cfg.setdefault("side_channel_port", free_port_block(1))
    agent = Agent("consumer", spec, AgentConfig(**cfg))
    cache = cache_for(spec, seed)
    agent.register(cache)
    return agent, cache


def fill(cache: list[np.ndarray], ids, value: int = SENTINEL) -> None:
    for t in cache:
        t[:, list(ids)] = value


def threads_now() -> str:
    """Every thread's stack in this process now (for a failure's message: where a read is stuck)."""
    import faulthandler
    import tempfile

    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def blocks_of(cache: list[np.ndarray], ids) -> list[np.ndarray]:
    return [t[:, list(ids)].copy() for t in cache]


def idle(stats: dict) -> bool:
    """Nothing held, claimed, in flight or quarantined."""
    keys = ("held_requests", "held_blocks", "claimed_requests", "ending_requests", "in_flight",
            "draining", "quarantined_blocks")
    return all(stats[k] == 0 for k in keys)
