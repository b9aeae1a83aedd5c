"""Helpers for the side-channel tests: producer ranks in their own processes over real NIXL + ZMQ.

``Peer`` runs one producer rank in a spawned process (``kvxfer.testing.ProducerProcess``) that
answers, besides ``serve_commands``' own commands: ``engine_id``, ``rss`` (its resident set in
bytes), ``stderr`` (bytes written to its stderr so far, when ``stderr_path`` redirects it),
``counters`` (the side-channel server's counters), ``holding`` (every request it holds) and
``("hold", rid, engine)`` (hold ``rid`` of ``HOLD_BLOCKS`` for the consumer engine named ``engine``).
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import ProducerProcess, free_port_block

COMMON = dict(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=48,
              dtype="bfloat16", model="sctest")
HOLD_BLOCKS = [3, 9, 10, 27]


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(agent, holds: dict, cmd, out, commands: dict) -> None:
    """``serve_commands`` plus ``("hold", rid, engine)``: hold ``rid`` for that consumer engine."""
    known = set(holds)
    for rid, blocks in holds.items():
        agent.hold(rid, blocks)
    out.put(("ready", agent.address))
    while True:
        what = cmd.get(timeout=300)
        if what == "stop":
            return
        if isinstance(what, tuple) and what[0] == "hold":
            agent.hold(what[1], HOLD_BLOCKS, consumer_engines=[what[2]])
            known.add(what[1])
            out.put(True)
        elif what == "holding":
            out.put(sorted(rid for rid in known if agent.holding(rid)))
        else:
            out.put(commands[what](agent))


def _enter(host: str, netns: str | None) -> None:
    """Move this fresh child into ``netns`` and keep UCX off the shared-memory transports: two
    namespaces of one machine still share its memory, and real hosts do not (UCX's cma would
    move the bytes without touching the network)."""
    if netns is not None:
        from kvxfer.bench.hosts import Host

        Host(netns, host, "").enter()
        os.environ["UCX_TLS"] = "tcp"


def _producer(cmd, out, seed: int, host: str, port: int, holds: dict, cfg: dict,
              stderr_path: str | None = None, netns: str | None = None, spec_kwargs: dict | None = None) -> None:
    _enter(host, netns)
    if stderr_path is not None:
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    import logging

    logging.basicConfig(level=logging.WARNING)
    spec = KVSpec(**(spec_kwargs or COMMON))
    config = AgentConfig(side_channel_host=host, side_channel_port=port, nixl_progress_thread=False, **cfg)
    with Agent("producer", spec, config) as agent:
        agent.register(cache_for(spec, seed))
        agent.listen()
        _serve(agent, holds, cmd, out, dict(
            engine_id=lambda a: a.engine_id,
            finished=lambda a: (lambda fin: (sorted(fin.sent), sorted(fin.expired)))(a.finished()),
            rss=lambda a: _rss(),
            stderr=lambda a: os.fstat(2).st_size if stderr_path else 0,
            counters=lambda a: a._server.counters(),
        ))


class Peer(ProducerProcess):
    """A producer rank in a spawned process (see the module docstring)."""

    def __init__(self, seed: int, port: int, holds: dict, *, host: str = "127.0.0.1",
                 stderr_path: str | None = None, netns: str | None = None, spec_kwargs: dict | None = None,
                 **cfg) -> None:
        super().__init__(_producer, seed, host, port, holds, cfg, stderr_path, netns, spec_kwargs)

    def ask(self, what: str, timeout: float = 60.0):
        return super().ask(what, timeout)


def consumer(name: str = "consumer", seed: int = 99, **cfg) -> tuple[Agent, list[np.ndarray]]:
    """A consumer agent in this process (real NIXL), not listening."""
    cfg.setdefault("side_channel_host", "127.0.0.1")
    cfg.setdefault("side_channel_port", free_port_block(1))
    cfg.setdefault("nixl_progress_thread", False)
    spec = KVSpec(**COMMON)
    agent = Agent(name, spec, AgentConfig(**cfg))
    cache = cache_for(spec, seed)
    agent.register(cache)
    return agent, cache


def assert_read(cache, dst, seed: int, src) -> None:
    """The consumer's ``dst`` blocks hold the producer (of ``seed``)'s ``src`` blocks, byte for byte."""
    want = cache_for(KVSpec(**COMMON), seed)
    for layer in range(len(cache)):
        np.testing.assert_array_equal(cache[layer][:, dst], want[layer][:, src])


def poll(fn, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = fn()
    return got


# ---- hostile clients ------------------------------------------------------------------------

def hello_frame(engine_id: str, metadata: bytes = b"md", spec: KVSpec | None = None) -> bytes:
    """A valid keyless Hello frame (the producer's model) announcing ``engine_id``."""
    from kvxfer.layout.spec import CacheGeometry
    from kvxfer.protocol import Codec, Hello, compat_hash, make_peer_info

    spec = spec or KVSpec(**COMMON)
    info = make_peer_info(engine_id, "flood-" + engine_id, spec, CacheGeometry.contiguous(spec, 1 << 30), metadata)
    return Codec(compat_hash(spec), max_bytes=8 << 20).encode(Hello(info))


def send_hellos(address, frames, window: int = 300, timeout: float = 10.0) -> int:
    """Send each frame of ``frames`` from a fresh DEALER socket (a new client identity) and wait
    for its reply; at most ``window`` sockets stay open (the oldest closes first). Returns how many
    replies came back."""
    import collections

    import zmq

    ctx = zmq.Context.instance()
    open_socks: collections.deque = collections.deque()
    replies = 0
    try:
        for frame in frames:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            sock.send(frame)
            if sock.poll(int(timeout * 1000)):
                sock.recv()
                replies += 1
            open_socks.append(sock)
            while len(open_socks) > window:
                open_socks.popleft().close(0)
    finally:
        while open_socks:
            open_socks.popleft().close(0)
    return replies


# ---- a consumer in a process of its own (for the two-namespace tests) -------------------------

def _consumer(cmd, out, seed: int, host: str, netns: str | None, cfg: dict, spec_kwargs: dict | None) -> None:
    _enter(host, netns)
    from kvxfer.errors import KvxferError

    spec = KVSpec(**(spec_kwargs or COMMON))
    config = AgentConfig(side_channel_host=host, side_channel_port=free_port_block(1),
                         nixl_progress_thread=False, **cfg)
    handles: dict = {}
    with Agent("consumer", spec, config) as agent:
        cache = cache_for(spec, 99)
        agent.register(cache)
        out.put(("ready", None))
        while True:
            what = cmd.get(timeout=300)
            if what == "stop":
                return
            kind, args = what[0], what[1:]
            t0 = time.monotonic()
            try:
                if kind == "start":  # (address, rid, dst, src, timeout): claim and post, do not wait
                    address, rid, dst, src, timeout = args
                    handles[rid] = (agent.read(tuple(address), dst, src, rid, timeout=timeout), dst, src)
                    out.put(("started", time.monotonic() - t0))
                    continue
                rid, producer_seed = args  # ("wait", rid, producer seed): the outcome, bytes checked
                handle, dst, src = handles.pop(rid)
                handle.wait(600)
                want = cache_for(spec, producer_seed)
                exact = all(np.array_equal(cache[layer][:, dst], want[layer][:, src])
                            for layer in range(spec.num_layers))
                out.put(("ok", exact, time.monotonic() - t0))
            except KvxferError as exc:
                out.put(("error", type(exc).__name__, str(exc)[:300], time.monotonic() - t0))


class ConsumerProcess(ProducerProcess):
    """A consumer agent in a spawned process (optionally inside network namespace ``netns``).

    ``start(address, rid, dst, src, timeout)`` claims and posts a read and returns at once;
    ``wait(rid, producer_seed)`` returns ``("ok", exact, seconds)`` or ``("error", name, text, seconds)``.
    """

    def __init__(self, host: str = "127.0.0.1", netns: str | None = None, spec_kwargs: dict | None = None,
                 **cfg) -> None:
        super().__init__(_consumer, 99, host, netns, cfg, spec_kwargs)

    def start(self, address, rid: str, dst, src, timeout: float):
        return self.ask(("start", tuple(address), rid, list(dst), list(src), timeout), 120)

    def wait(self, rid: str, producer_seed: int):
        return self.ask(("wait", rid, producer_seed), 700)

    def read(self, address, rid: str, dst, src, producer_seed: int, timeout: float = 60.0):
        started = self.start(address, rid, dst, src, timeout)
        return started if started[0] != "started" else self.wait(rid, producer_seed)
