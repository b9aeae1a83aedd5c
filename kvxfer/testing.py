"""Test support for engines built on kvxfer (layer: testing; imports backend.fake and transport.memory, never nixl or zmq).

``FakeBackend`` really copies bytes between registered buffers of agents in one process, with
fault injection (``fail_next``, ``hold_transfers``, ``kill``); see ``kvxfer.backend.fake``.
``MemoryTransport`` joins agents of one process without sockets or ports (``Agent(...,
transport=MemoryTransport(network))``; see ``kvxfer.transport.memory``). ``free_port_block`` finds
free side-channel ports; ``logical_kv`` and ``expected_read`` are a
tensor-level oracle for split-storage caches (what a read must leave in the consumer's blocks).
``ProducerProcess`` and ``serve_commands`` run a producer rank in a spawned process that a test
drives through two queues. ``collector_off`` and ``cycle_garbage`` tell whether what ran between
them left kvxfer objects that only Python's cycle collector would free.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import random
import socket
import time
from typing import Any, Callable

import numpy as np

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.layout import KVSpec
from kvxfer.transport.memory import MemoryNetwork, MemoryTransport

__all__ = ["FakeBackend", "FakeWorld", "MemoryNetwork", "MemoryTransport", "ProducerProcess", "collector_off",
           "cycle_garbage", "expected_read", "free_port_block", "logical_kv", "run_reporting", "serve_commands",
           "wait_for"]


def collector_off() -> bool:
    """Collect once, then turn Python's cycle collector off (in this process) until
    ``cycle_garbage``: what becomes unreachable meanwhile stays for it to find. Returns True."""
    gc.collect()
    gc.disable()
    return True


def cycle_garbage(prefix: str = "kvxfer") -> dict[str, int]:
    """The objects of modules under ``prefix`` that the cycle collector finds unreachable (which
    reference counting never freed: they sit in cycles), counted by type name; the collector is
    on again afterwards and they are freed."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found: dict[str, int] = {}
        for obj in gc.garbage:
            kind = type(obj)
            if str(kind.__module__).startswith(prefix):
                found[kind.__qualname__] = found.get(kind.__qualname__, 0) + 1
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def spin_python(seconds: float) -> int:
    """Keep this thread busy in Python for ``seconds`` (no sleep, no C call that lets go of the
    interpreter): a serving engine's busy main thread, which kvxfer's own threads must win the
    interpreter from. Returns a number so that the loop is not optimised away."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i
    return x


def wait_for(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll ``pred`` every ``interval`` seconds until it holds (True) or ``timeout`` seconds pass
    (then its last answer): for tests waiting on another thread or process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def _ephemeral_low() -> int:
    """The first port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def free_port_block(n: int = 4) -> int:
    """A base port with ``n`` consecutive ports free on 127.0.0.1 right now (best effort).

    Ports come from below the kernel's ephemeral range, so that sockets other processes open
    meanwhile (UCX's TCP listeners, outgoing connections) cannot take them before the agent
    that was given them binds; a port is never handed out twice in one process."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, max(10001, low - n))
        span = range(base, base + n)
        if any(port in _handed_out for port in span):
            continue
        socks = []
        try:
            for port in span:
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
        _handed_out.update(span)
        return base
    raise RuntimeError(f"no run of {n} free ports found below {low}")


def logical_kv(spec: KVSpec, tensors: list[np.ndarray], ids) -> np.ndarray:
    """``[layers, K/V, tokens, heads_per_rank, head_dim]`` of blocks ``ids`` (token order) of a
    split-storage cache given as host arrays shaped ``spec.tensor_shapes()``."""
    out = []
    for t in tensors:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)   # [2, blocks, heads, bs, hd] -> [2, blocks, bs, heads, hd]
        sel = t[:, list(ids)]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def expected_read(consumer: KVSpec, before: list[np.ndarray], c_ids,
                  producers: list[tuple[KVSpec, list[np.ndarray]]], p_ids) -> np.ndarray:
    """The consumer's ``logical_kv`` of ``c_ids`` after reading ``p_ids`` from every producer rank
    (``before``: its cache before the read; each rank supplies the heads it shares)."""
    want = logical_kv(consumer, before, c_ids).copy()
    c0 = consumer.first_head
    for spec, cache in producers:
        src = logical_kv(spec, cache, p_ids)
        p0 = spec.first_head
        lo, hi = max(p0, c0), min(p0 + spec.heads_per_rank, c0 + consumer.heads_per_rank)
        want[:, :, :, lo - c0:hi - c0] = src[:, :, :, lo - p0:hi - p0]
    return want


def serve_commands(agent, holds: dict, cmd, out, timeout: float = 300.0,
                   extra: dict[str, Callable[[Any], Any]] | None = None) -> None:
    """The body of a ``ProducerProcess`` once ``agent`` is registered and listening.

    Holds ``holds`` (request id -> block ids), reports ``("ready", address)``, then answers
    commands until ``"stop"``: ``"holding"`` (the ids of ``holds`` still held), ``"finished"``
    (``(sent, expired, aborted)`` since the last call) and any name in ``extra`` (``fn(agent)``)."""
    for rid, blocks in holds.items():
        agent.hold(rid, blocks)
    out.put(("ready", agent.address))
    answers: dict[str, Callable[[Any], Any]] = {
        "holding": lambda a: sorted(rid for rid in holds if a.holding(rid)),
        "finished": lambda a: (lambda fin: (sorted(fin.sent), sorted(fin.expired), sorted(fin.aborted)))(a.finished()),
        **(extra or {}),
    }
    while True:
        what = cmd.get(timeout=timeout)
        if what == "stop":
            return
        out.put(answers[what](agent))


class ProducerProcess:
    """A producer rank in a spawned process: ``target(cmd, out, *args)`` ends in ``serve_commands``.

    ``wait=False`` returns at once (start several, then ``ready()`` each)."""

    def __init__(self, target: Callable[..., None], *args: Any, wait: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(self.cmd, self.out, *args), daemon=True)
        self.proc.start()
        if wait:
            self.ready()

    def ready(self) -> "ProducerProcess":
        deadline = time.monotonic() + 300  # generous: CI hosts can be loaded
        while True:
            try:
                tag, self.address = self.out.get(timeout=1)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"producer process exited with code {self.proc.exitcode} "
                                       "before it was ready (its stderr says why)") from None
                if time.monotonic() > deadline:
                    raise
        if tag != "ready":
            raise RuntimeError(f"producer process answered {tag!r} before it was ready")
        return self

    def ask(self, what: str, timeout: float = 120.0):
        self.cmd.put(what)
        return self.out.get(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(20)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.cmd.put("stop")
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


def run_reporting(target: Callable[..., None], *args: Any, timeout: float = 180.0) -> Any:
    """Run ``target(out, *args)`` in a spawned process and return the one thing it puts on ``out``.

    The process is joined (killed after 30 s) whatever happens. Raises ``queue.Empty`` when it
    reported nothing within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(out, *args), daemon=True)
    proc.start()
    try:
        return out.get(timeout=timeout)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
