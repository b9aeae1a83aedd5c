"""``kvxfer bench`` method ``kvxfer-new-process``: the first read between two new processes (layer: bench app).

A decode instance joining, or a prefill instance restarting, is a new *process*: its first
read is also that process's first use of kvxfer, NIXL and UCX (and the producer's first serve).
``kvxfer-fresh-pair`` makes new agents inside the bench's long-lived worker processes, which
already moved data; this method starts, per iteration, a new producer process and a new consumer
process (spawned by the bench's workers, so inside their hosts' namespaces and environment):

* the producer child fills a cache with the producer worker's seeded bytes, makes an ``Agent``,
  registers, listens and holds the iteration's two reads, and says so (the control socket of
  ``kvxfer.bench.firstcontact``);
* the consumer child builds the expected cache as the worker does (``Worker.expect``), makes its
  ``Agent`` and registers its cache (written first, as an engine's cache is), waits for the
  producer's go, then times its first ``read`` (no ``connect()``: the handshake is in it), checks
  every byte, writes the background back and times a second, warm read, checked too.

The row's ``times`` are the first reads; ``warm_ms``, ``gap_ms`` (first minus warm, median of
pairs) and ``phases_ms`` as in ``kvxfer.bench.firstcontact``. Starting the processes (imports,
the NIXL agent, filling caches) is not timed: a user's first read starts after its engine is up.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from kvxfer.bench.agentmethods import _agent_config
from kvxfer.bench.firstcontact import _CONSUMER_PORT_OFFSET, _PORT, _Consumer, _free_port, _rids, control_listen
from kvxfer.bench.methods import DEADLINE, timed_loop

__all__ = ["CONSUMER", "PREPARE", "PRODUCER"]

_METHOD = "kvxfer-new-process"
_START = 300.0  # seconds for a new process to come up (imports, NIXL, caches of up to GiBs filled)


def _producer_child(conn, name: str, spec, seed: int, ids, rids, options: dict, port: int) -> None:
    """A new producer process: cache, agent, holds; "ready" once listening, closes on "stop"."""
    from kvxfer import Agent  # noqa: PLC0415
    from kvxfer.bench.caches import fill_random, make_cache  # noqa: PLC0415

    cache = make_cache(spec, "cpu")
    fill_random(cache, seed)
    config = _agent_config(options, port, options["producer_host"], options.get("producer_path"))
    with Agent(name, spec, config) as agent:
        agent.register(cache.tensors)
        agent.listen()
        for rid in rids:
            agent.hold(rid, ids, consumers=1)
        conn.send("ready")
        try:
            conn.recv()  # "stop", or the end of the socket: either way this agent closes
        except EOFError:
            pass


def _consumer_child(conn, name: str, spec, seed: int, requests: list[dict], tokens: int, rids,
                    options: dict) -> None:
    """A new consumer process: first read and warm read of ``requests[0]``, both checked; sends
    ``{"first", "warm", "ok", "phases"}`` (seconds; phases in ms)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from kvxfer import Agent  # noqa: PLC0415
    from kvxfer.bench.caches import apply_expected, element_view, fill_random, make_cache  # noqa: PLC0415

    background = make_cache(spec, "cpu")
    fill_random(background, seed + 7)  # what Worker.expect/poison use
    expected = make_cache(spec, "cpu")
    for e, b in zip(expected.tensors, background.tensors):
        e.copy_(b)
    views = element_view(expected)
    for req in requests:
        replica = make_cache(req["spec"], "cpu")
        fill_random(replica, req["seed"])
        apply_expected(replica, np.asarray(req["ids"]), views, spec, np.asarray(req["local_ids"]), tokens)
        del replica
    cache = make_cache(spec, "cpu")

    def poison() -> None:
        for t, b in zip(cache.tensors, background.tensors):
            t.copy_(b)

    def exact() -> bool:
        return all(torch.equal(t.view(-1).view(torch.uint8), e.view(-1).view(torch.uint8))
                   for t, e in zip(cache.tensors, expected.tensors))

    poison()
    config = _agent_config(options, options["port"] + _CONSUMER_PORT_OFFSET, options["consumer_host"])
    local, remote_ids = requests[0]["local_ids"], requests[0]["ids"]
    with Agent(name, spec, config) as agent:
        agent.register(cache.tensors)
        conn.send("registered")
        remote = (options["producer_host"], conn.recv())
        t0 = time.perf_counter()
        stats = agent.read(remote, local, remote_ids, rids[0], timeout=DEADLINE).wait()
        first = time.perf_counter() - t0
        ok = exact()
        link = agent.connect(*remote)  # the link the read handshook (cached: no I/O)
        phases = {"setup": round(stats.setup_seconds * 1e3, 1), "claim": round(stats.claim_seconds * 1e3, 1),
                  "post_to_done": round(stats.seconds * 1e3, 1),
                  **{f"handshake_{k}": round(v * 1e3, 1) for k, v in link.timings.items()}}
        poison()
        t1 = time.perf_counter()
        agent.read(remote, local, remote_ids, rids[1], timeout=DEADLINE).wait()
        warm = time.perf_counter() - t1
        ok = ok and exact()
    conn.send({"first": first, "warm": warm, "ok": ok, "phases": phases})


def _child(role: str, *args) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -m kvxfer.bench.newprocess role`` (a new interpreter: the bench's workers
    are daemonic and may not fork children of ``multiprocessing``), in this process's namespace
    and environment; ``args`` go to it over a socket pair, as do later messages both ways."""
    mine, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", "kvxfer.bench.newprocess", role, str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),))
    conn = Connection(mine.detach())
    conn.send(args)
    return proc, conn


def _recv(conn: Connection, proc: subprocess.Popen, what: str):
    if not conn.poll(_START):
        raise TimeoutError(f"the new {what} process said nothing in {_START} s")
    try:
        return conn.recv()
    except EOFError:
        raise ConnectionError(f"the new {what} process ended early (exit code {proc.poll()})") from None


def _reap(proc: subprocess.Popen, conn: Connection) -> None:
    conn.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def serve(w, consumer, request, tokens, rounds, options):
    """Producer half: per iteration a new producer process on a free port of this host."""
    server = w.extra.pop("first-contact-control")
    try:
        sock, _ = server.accept()
    finally:
        server.close()
    with sock:
        sock.settimeout(_START)  # the consumer's new process comes up between our go and its "done"
        for it in range(rounds):
            port = _free_port(options["producer_host"])
            proc, conn = _child("producer", f"{w.name}-proc{it}", w.cache.spec, w.seed, request["ids"],
                                _rids(options, it), options, port)
            try:
                if _recv(conn, proc, "producer") != "ready":
                    raise ConnectionError("the new producer process did not get ready")
                sock.sendall(b"r" + _PORT.pack(port))
                if sock.recv(1) != b"d":
                    raise ConnectionError("the consumer closed the control socket early")
                conn.send("stop")
            finally:
                _reap(proc, conn)
    return {"rounds": rounds, "processes": rounds}


def new_process(w, requests, tokens, iters, warmup, options):
    """Consumer half (see the module docstring)."""
    run = _Consumer.open(w, requests, options, _METHOD)
    if isinstance(run, dict):
        return run
    run.sock.settimeout(_START)  # the producer's new process comes up before its go
    verified: list[bool] = []

    def body(it):
        proc, conn = _child("consumer", f"{w.name}-proc{it}", w.cache.spec, w.seed, requests, tokens,
                            _rids(options, it), options)
        try:
            if _recv(conn, proc, "consumer") != "registered":
                raise ConnectionError("the new consumer process did not register its cache")
            conn.send(run.remote()[1])
            got = _recv(conn, proc, "consumer")
        finally:
            run.done()
            _reap(proc, conn)
        verified.append(got["ok"])
        run.warm.append(got["warm"])
        run.phases.append(got["phases"])
        return got["first"]

    try:
        result = timed_loop(w, iters, warmup, body, poison=lambda: None, verify=lambda: verified[-1])
        return run.summarise(result)
    finally:
        run.sock.close()


CONSUMER = {_METHOD: new_process}
PREPARE = {_METHOD: control_listen}
PRODUCER = {_METHOD: serve}


if __name__ == "__main__":  # a new process started by ``_child``: role, then the socket's fd
    _conn = Connection(int(sys.argv[2]))
    {"producer": _producer_child, "consumer": _consumer_child}[sys.argv[1]](_conn, *_conn.recv())
