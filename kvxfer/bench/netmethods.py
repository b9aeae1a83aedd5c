"""``kvxfer bench`` methods for the two-hosts scenario: the TCP line and first contact (layer: bench app).

Same contract as ``kvxfer.bench.methods`` (consumer halves return ``{"times", "verified",
"failed", ...}``, every timed transfer verified byte for byte):

* ``tcp-socket``: one plain TCP connection, the producer ``sendall``s the request's byte count
  from its link buffer, the consumer ``recv_into``s it; what the link carries without NIXL;
* ``kvxfer-first-read``: per iteration a *new* consumer ``Agent`` (a peer the producer has never
  seen) handshakes (``connect``, timed as ``handshake_ms``), then reads the request (timed: the
  row's times) and reads it again (``warm_ms``); ``gap_ms`` is first minus warm, per iteration.
  The first iteration's first read is also the producer's first read ever (``fresh_ms``).
* ``kvxfer-relink``: one consumer ``Agent``; per iteration a warm read (``warm_ms``), then the
  consumer's end of the link goes down, a read in the gap fails (typed, short timeout), the
  link comes back up, and the first read after it is timed from the moment the link is up (the
  row's times; retries, re-handshake and probe included); ``gap_ms`` is that minus warm.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

from kvxfer.bench.agentmethods import _agent_config
from kvxfer.bench.methods import DEADLINE, timed_loop

__all__ = ["CONSUMER", "PREPARE", "PRODUCER"]

_SOCKET_PORT_OFFSET = 7
_FIRST_READ_PORT_OFFSET = 90
_RELINK_PORT_OFFSET = 95
_CUT_READ_TIMEOUT_S = 1.0   # the read issued while the link is down fails within this


def _expected_link(w: Any, requests: list[dict], nbytes: int):
    """The bytes the producer's link buffer starts with (as ``nixl-1desc`` computes them)."""
    import torch  # noqa: PLC0415

    info = w.peers[requests[0]["name"]]
    gen = torch.Generator(device=w.device)
    gen.manual_seed(requests[0]["seed"] + 1)
    src = torch.randint(0, 256, (info["link_bytes"],), dtype=torch.uint8, device=w.device, generator=gen)
    return src[:nbytes].clone()


def socket_consumer(w, requests, tokens, iters, warmup, options):
    """Receive the request's bytes over one TCP connection, once per iteration."""
    import torch  # noqa: PLC0415

    nbytes = options["request_bytes"]
    if len(requests) != 1 or nbytes > w.link.numel():
        return {"skipped": "tcp-socket needs one producer and a link buffer >= the request"}
    expected = _expected_link(w, requests, nbytes)
    background = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = memoryview(w.link.numpy()).cast("B")[:nbytes]
    sock = socket.create_connection((options["producer_host"], options["port"] + _SOCKET_PORT_OFFSET),
                                    timeout=DEADLINE)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def poison():
        w.link[:nbytes].copy_(background)

    def body(it):
        t0 = time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise ConnectionError("producer closed the socket mid-request")
            got += n
        return time.perf_counter() - t0

    try:
        result = timed_loop(w, iters, warmup, body, poison=poison,
                       verify=lambda: bool(torch.equal(w.link[:nbytes], expected)))
    finally:
        sock.close()
    result["descriptors"] = 1
    return result


def socket_listen(w, consumer, request, tokens, rounds, options):
    """Producer, before ``measure``: listen on the producer's address."""
    server = socket.create_server((options["producer_host"], options["port"] + _SOCKET_PORT_OFFSET))
    server.settimeout(DEADLINE)
    w.extra["tcp-socket"] = server
    return {"listening": True}


def socket_serve(w, consumer, request, tokens, rounds, options):
    """Producer: accept one connection, send the request's bytes on every 1-byte ask."""
    server = w.extra.pop("tcp-socket")
    nbytes = options["request_bytes"]
    data = memoryview(w.link.numpy()).cast("B")[:nbytes]
    try:
        conn, _ = server.accept()
    finally:
        server.close()
    with conn:
        conn.settimeout(DEADLINE)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            if conn.recv(1) != b"g":
                raise ConnectionError("consumer closed the socket early")
            conn.sendall(data)
    return {"rounds": rounds}


def _rids(options: dict, rounds: int) -> list[str]:
    return [f"bench-{options['run']}-{i}-{which}" for i in range(rounds) for which in ("first", "warm")]


def first_read(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-first-read`` (see the module docstring)."""
    from kvxfer import Agent  # noqa: PLC0415

    if len(requests) != 1:
        return {"skipped": "kvxfer-first-read measures one producer rank"}
    remote = (options["producer_host"], options["port"])
    local_ids, remote_ids = requests[0]["local_ids"], requests[0]["ids"]
    config = _agent_config({**options, "transfer_path": "auto"}, options["port"] + _FIRST_READ_PORT_OFFSET)
    handshakes: list[float] = []
    warm: list[float] = []
    phases: list[dict] = []

    def body(it):
        agent = Agent(f"{w.name}-first-{it}", w.cache.spec, config)
        try:
            agent.register(w.cache.tensors)
            t0 = time.perf_counter()
            link = agent.connect(*remote)
            handshakes.append(time.perf_counter() - t0)
            phases.append({k: round(v * 1e3, 3) for k, v in link.timings.items()})
            t1 = time.perf_counter()
            agent.read(remote, local_ids, remote_ids, f"bench-{options['run']}-{it}-first", timeout=DEADLINE).wait()
            first = time.perf_counter() - t1
            if not w.verify():
                raise AssertionError("the first read did not leave the expected bytes")
            w.poison()
            t2 = time.perf_counter()
            agent.read(remote, local_ids, remote_ids, f"bench-{options['run']}-{it}-warm", timeout=DEADLINE).wait()
            warm.append(time.perf_counter() - t2)
        finally:
            agent.close()
        return first

    result = timed_loop(w, iters, warmup, body)
    n = len(result["times"])
    result["handshake_ms"] = statistics.median(handshakes[-n:]) * 1e3
    result["warm_ms"] = statistics.median(warm[-n:]) * 1e3
    result["warm_times"] = warm[-n:]
    result["first_ms"] = statistics.median(result["times"]) * 1e3
    result["gap_ms"] = statistics.median(f - s for f, s in zip(result["times"], warm[-n:])) * 1e3
    result["handshake_phases_ms"] = phases[-n:]
    result["fresh_ms"] = (result["times"] if not warmup else [None])[0]
    if result["fresh_ms"] is not None:
        result["fresh_ms"] *= 1e3
    return result


def _link(device: str, state: str) -> None:
    import subprocess  # noqa: PLC0415

    subprocess.run(["ip", "link", "set", "dev", device, state], check=True, capture_output=True, timeout=10)


def relink(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-relink`` (see the module docstring)."""
    from kvxfer import Agent  # noqa: PLC0415
    from kvxfer.errors import KvxferError  # noqa: PLC0415

    device = options.get("consumer_device")
    if len(requests) != 1 or not device:
        return {"skipped": "kvxfer-relink needs one producer rank and two hosts (--two-hosts)"}
    remote = (options["producer_host"], options["port"])
    local_ids, remote_ids = requests[0]["local_ids"], requests[0]["ids"]
    config = _agent_config({**options, "transfer_path": "auto"}, options["port"] + _RELINK_PORT_OFFSET,
                           options["consumer_host"])
    rid = lambda it, which: f"bench-{options['run']}-{it}-{which}"  # noqa: E731
    warm: list[float] = []
    failed_as: list[str] = []
    attempts: list[int] = []
    phases: list[dict] = []
    agent = Agent(f"{w.name}-relink", w.cache.spec, config)
    agent.register(w.cache.tensors)

    def body(it):
        t0 = time.perf_counter()
        agent.read(remote, local_ids, remote_ids, rid(it, "warm")).wait(DEADLINE)
        warm.append(time.perf_counter() - t0)
        if not w.verify():
            raise AssertionError("the warm read did not leave the expected bytes")
        w.poison()
        _link(device, "down")
        try:
            agent.read(remote, local_ids, remote_ids, rid(it, "cut"), timeout=_CUT_READ_TIMEOUT_S).wait(DEADLINE)
            failed_as.append("none")
        except KvxferError as exc:
            failed_as.append(type(exc).__name__)
        finally:
            _link(device, "up")
        w.poison()  # a read that failed may have written part of its destination
        t1 = time.perf_counter()
        for attempt in range(1, 21):
            try:
                stats = agent.read(remote, local_ids, remote_ids, rid(it, f"after{attempt}")).wait(DEADLINE)
                break
            except KvxferError:
                if attempt == 20:
                    raise
        seconds = time.perf_counter() - t1
        attempts.append(attempt)
        link = agent.connect(*remote)
        phases.append({"setup": stats.setup_seconds * 1e3, "claim": stats.claim_seconds * 1e3,
                       "post_to_done": stats.seconds * 1e3,
                       **{f"handshake_{k}": v * 1e3 for k, v in link.timings.items()}})
        return seconds

    try:
        result = timed_loop(w, iters, warmup, body)
    finally:
        agent.close()
    n = len(result["times"])
    result["warm_ms"] = statistics.median(warm[-n:]) * 1e3
    result["warm_times"] = warm[-n:]
    result["first_ms"] = statistics.median(result["times"]) * 1e3
    result["gap_ms"] = statistics.median(f - s for f, s in zip(result["times"], warm[-n:])) * 1e3
    result["cut_read"] = sorted(set(failed_as))
    result["attempts"] = attempts[-n:]
    result["after_phases_ms"] = [{k: round(v, 1) for k, v in p.items()} for p in phases[-n:]]
    return result


def relink_hold(w, consumer, request, tokens, rounds, options):
    """Producer, before ``measure``: hold the warm read, the one cut off and up to 20 after."""
    from kvxfer.bench.agentmethods import _bench_agent  # noqa: PLC0415

    ag = _bench_agent(w, options, options["port"], listen=True)
    ag.finished()
    names = ["warm", "cut"] + [f"after{a}" for a in range(1, 21)]
    for i in range(rounds):
        for which in names:
            ag.hold(f"bench-{options['run']}-{i}-{which}", request["ids"], consumers=1)
    return {"held": rounds * len(names)}


def relink_serve(w, consumer, request, tokens, rounds, options):
    """Producer: nothing to wait for (the holds of reads never made expire with the agent)."""
    return {"rounds": rounds}


def first_read_hold(w, consumer, request, tokens, rounds, options):
    """Producer, before ``measure``: hold both reads of every iteration."""
    from kvxfer.bench.agentmethods import _bench_agent  # noqa: PLC0415

    ag = _bench_agent(w, options, options["port"], listen=True)
    ag.finished()
    for rid in _rids(options, rounds):
        ag.hold(rid, request["ids"], consumers=1)
    return {"held": 2 * rounds}


def first_read_serve(w, consumer, request, tokens, rounds, options):
    """Producer: wait until every held read was done (each iteration's consumer is new)."""
    from kvxfer.bench.agentmethods import _bench_agent  # noqa: PLC0415
    from kvxfer.errors import TransferTimeoutError  # noqa: PLC0415

    ag = _bench_agent(w, options, options["port"], listen=True)
    rids = _rids(options, rounds)
    deadline = time.monotonic() + DEADLINE * 2 * rounds
    while any(ag.holding(rid) for rid in rids):
        if time.monotonic() > deadline:
            raise TransferTimeoutError("kvxfer-first-read: the producer still holds requests the consumers read")
        time.sleep(1e-3)
    return {"rounds": rounds}


CONSUMER = {"tcp-socket": socket_consumer, "kvxfer-first-read": first_read, "kvxfer-relink": relink}
PREPARE = {"tcp-socket": socket_listen, "kvxfer-first-read": first_read_hold, "kvxfer-relink": relink_hold}
PRODUCER = {"tcp-socket": socket_serve, "kvxfer-first-read": first_read_serve, "kvxfer-relink": relink_serve}
