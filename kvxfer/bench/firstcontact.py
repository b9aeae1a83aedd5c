"""``kvxfer bench`` methods for first contact as users meet it: no ``connect()`` first (layer: bench app).

Same contract as ``kvxfer.bench.methods`` (consumer halves return ``{"times", "verified",
"failed", ...}``; every timed read is verified byte for byte). In both methods the producer
starts a *new* ``Agent`` per iteration (a new NIXL agent, so a new UCX context and worker, a
new side channel and a new registration of its cache, on the same port), says so over a
plain TCP control socket once it listens and holds the iteration's two reads, and closes that
agent when the consumer says both reads are done:

* ``kvxfer-fresh-pair``: per iteration also a *new* consumer ``Agent`` (registered before the
  producer's go, not timed); its first ``read`` goes out without ``connect()``, so the row's
  time includes the handshake, the transport's set-up and everything else a first read pays;
  then a second read of the same size (``warm_ms``); ``gap_ms`` is first minus warm, per
  iteration. The first iteration's producer is also a new process's first agent (``fresh_ms``).
* ``kvxfer-restart``: one consumer ``Agent`` for the whole run; it reads once from the first
  producer agent (not timed), then per iteration the producer restarts (closes its agent and
  opens a new one on the same address) and the consumer's first read after that is timed, then
  a warm one. The consumer learns of the restart only through the read (the old link's session
  is gone, so kvxfer handshakes afresh).

The first read's stats are kept per iteration under ``phases_ms``: ``setup`` (from the call to
the post: handshake, claim, plan), the handshake's own phases (``handshake_*``), ``claim`` and
``post_to_done``, so a row says where a slow first read spent its time.
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.bench.agentmethods import _agent_config
from kvxfer.bench.methods import DEADLINE, timed_loop

__all__ = ["CONSUMER", "PREPARE", "PRODUCER"]

_CONTROL_PORT_OFFSET = 8      # the control socket: "r" + port (producer ready), "d" (both reads done)
_PORT = struct.Struct("<H")
_CONSUMER_PORT_OFFSET = 105


def _rids(options: dict, it: int) -> tuple[str, str]:
    return f"bench-{options['run']}-{it}-first", f"bench-{options['run']}-{it}-warm"


def control_listen(w, consumer, request, tokens, rounds, options):
    """Producer, before ``measure``: listen for the consumer's control connection."""
    server = socket.create_server((options["producer_host"], options["port"] + _CONTROL_PORT_OFFSET))
    server.settimeout(DEADLINE)
    w.extra["first-contact-control"] = server
    return {"listening": True}


def serve_fresh(w, consumer, request, tokens, rounds, options):
    """Producer half of ``kvxfer-fresh-pair``: ``rounds`` new agents, one per iteration."""
    return _serve_restarts(w, request, rounds, options, start=0)


def serve_restart(w, consumer, request, tokens, rounds, options):
    """Producer half of ``kvxfer-restart``: one more agent than iterations (the consumer's
    untimed first read, iteration -1, is served by the first)."""
    return _serve_restarts(w, request, rounds, options, start=-1)


def _serve_restarts(w, request, rounds: int, options: dict, start: int) -> dict:
    """Per iteration a new ``Agent`` on the same port, holding that iteration's two reads."""
    from kvxfer import Agent  # noqa: PLC0415

    server = w.extra.pop("first-contact-control")
    try:
        conn, _ = server.accept()
    finally:
        server.close()
    port = _free_port(options["producer_host"])
    config = _agent_config(options, port, options["producer_host"], options.get("producer_path"))
    with conn:
        conn.settimeout(DEADLINE)
        for it in range(start, rounds):
            agent = Agent(f"{w.name}-gen{it + 1}", w.cache.spec, config)
            try:
                agent.register(w.cache.tensors)
                agent.listen()
                for rid in _rids(options, it):
                    agent.hold(rid, request["ids"], consumers=1)
                conn.sendall(b"r" + _PORT.pack(port))
                if conn.recv(1) != b"d":
                    raise ConnectionError("the consumer closed the control socket early")
            finally:
                agent.close()
    return {"rounds": rounds, "agents": rounds - start}


def _free_port(host: str) -> int:
    """A port free on ``host`` now, in the producer's own namespace (a fixed offset from the run's
    base port can meet a port UCX's listeners took there)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _wait_ready(sock: socket.socket) -> int:
    """Wait for the producer's go; returns the port its new agent listens on."""
    message = b""
    while len(message) < 1 + _PORT.size:
        chunk = sock.recv(1 + _PORT.size - len(message))
        if not chunk:
            raise ConnectionError("the producer closed the control socket early")
        message += chunk
    if message[:1] != b"r":
        raise ConnectionError(f"the producer sent {message!r} on the control socket, not a go")
    return _PORT.unpack(message[1:])[0]


@dataclass
class _Consumer:
    """Both consumer halves' shared part: the request's ids, the consumer agents' config, the
    control socket to the producer, and per timed iteration the warm read's time and the first
    read's phases."""

    w: Any
    options: dict
    local_ids: Any
    remote_ids: Any
    config: Any
    sock: socket.socket
    warm: list[float] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)

    @classmethod
    def open(cls, w, requests, options: dict, method: str) -> "_Consumer | dict":
        """Connect to the producer's control socket; a ``{"skipped": ...}`` row where ``method``
        cannot run (several producer ranks, or one host)."""
        if len(requests) != 1 or not options.get("producer_host"):
            return {"skipped": f"{method} needs one producer rank and two hosts (--two-hosts)"}
        config = _agent_config(options, options["port"] + _CONSUMER_PORT_OFFSET, options["consumer_host"])
        sock = socket.create_connection((options["producer_host"], options["port"] + _CONTROL_PORT_OFFSET),
                                        timeout=DEADLINE)
        return cls(w, options, requests[0]["local_ids"], requests[0]["ids"], config, sock)

    def remote(self) -> tuple[str, int]:
        """Wait for the producer's go; the address its new agent listens on."""
        return self.options["producer_host"], _wait_ready(self.sock)

    def done(self) -> None:
        """Tell the producer both reads of this iteration are done (it closes its agent)."""
        self.sock.sendall(b"d")

    def first_then_warm(self, agent, remote, it: int, keep: bool = True) -> float:
        """Time the first read of iteration ``it`` (returned), then a warm one; ``keep``: record
        the warm time and the first read's phases."""
        w, first_rid, warm_rid = self.w, *_rids(self.options, it)
        t0 = time.perf_counter()
        stats = agent.read(remote, self.local_ids, self.remote_ids, first_rid, timeout=DEADLINE).wait()
        first = time.perf_counter() - t0
        if not w.verify():
            raise AssertionError("the first read did not leave the expected bytes")
        link = agent.connect(*remote)  # the link the read handshook (cached: no I/O)
        phases = {"setup": round(stats.setup_seconds * 1e3, 1), "claim": round(stats.claim_seconds * 1e3, 1),
                  "post_to_done": round(stats.seconds * 1e3, 1),
                  **{f"handshake_{k}": round(v * 1e3, 1) for k, v in link.timings.items()}}
        w.poison()
        t1 = time.perf_counter()
        agent.read(remote, self.local_ids, self.remote_ids, warm_rid, timeout=DEADLINE).wait()
        if keep:
            self.warm.append(time.perf_counter() - t1)
            self.phases.append(phases)
        return first

    def summarise(self, result: dict) -> dict:
        """The row: first and warm medians, first - warm per iteration and its median, phases."""
        n = len(result["times"])
        warm = self.warm[-n:]
        result["warm_ms"] = statistics.median(warm) * 1e3
        result["warm_times"] = warm
        result["first_ms"] = statistics.median(result["times"]) * 1e3
        result["gap_ms"] = statistics.median(f - s for f, s in zip(result["times"], warm)) * 1e3
        result["gaps_ms"] = [round((f - s) * 1e3, 1) for f, s in zip(result["times"], warm)]
        result["phases_ms"] = self.phases[-n:]
        return result


def fresh_pair(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-fresh-pair`` (see the module docstring)."""
    from kvxfer import Agent  # noqa: PLC0415

    run = _Consumer.open(w, requests, options, "kvxfer-fresh-pair")
    if isinstance(run, dict):
        return run

    def body(it):
        agent = Agent(f"{w.name}-fresh-{it}", w.cache.spec, run.config)
        try:
            agent.register(w.cache.tensors)
            return run.first_then_warm(agent, run.remote(), it)
        finally:
            agent.close()
            run.done()

    try:
        result = run.summarise(timed_loop(w, iters, warmup, body))
    finally:
        run.sock.close()
    result["fresh_ms"] = result["times"][0] * 1e3 if not warmup else None
    return result


def restart(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-restart`` (see the module docstring)."""
    from kvxfer import Agent  # noqa: PLC0415

    run = _Consumer.open(w, requests, options, "kvxfer-restart")
    if isinstance(run, dict):
        return run
    agent = Agent(f"{w.name}-restart", w.cache.spec, run.config)
    try:
        agent.register(w.cache.tensors)
        remote = run.remote()
        w.poison()
        run.first_then_warm(agent, remote, -1, keep=False)
        run.done()

        def body(it):
            if run.remote() != remote:  # the producer's previous agent is closed, the new one listens
                raise AssertionError("the restarted producer listens on another port")
            try:
                return run.first_then_warm(agent, remote, it)
            finally:
                run.done()

        return run.summarise(timed_loop(w, iters, warmup, body))
    finally:
        agent.close()
        run.sock.close()


CONSUMER = {"kvxfer-fresh-pair": fresh_pair, "kvxfer-restart": restart}
PREPARE = {"kvxfer-fresh-pair": control_listen, "kvxfer-restart": control_listen}
PRODUCER = {"kvxfer-fresh-pair": serve_fresh, "kvxfer-restart": serve_restart}
