"""``kvxfer bench``'s ``kvxfer-agent`` rows: the public ``Agent`` end to end, consumer and producer halves (layer: bench app).

Same contract as ``kvxfer.bench.methods``. The consumer times ``Agent.read`` (one request per
iteration, or with ``options["batch"]`` N a step of N requests submitted together and timed
until all are complete); the producer holds every iteration's requests before the consumer
starts and waits until each was reported done.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from kvxfer.bench.methods import DEADLINE, timed_loop
from kvxfer.bench.phases import Timeline
from kvxfer.testing import spin_python as spin
from kvxfer.errors import TransferFailedError, TransferTimeoutError

__all__ = ["CONSUMER", "PREPARE", "PRODUCER"]

#: Seconds between an idle producer's looks at its holds while the consumer reads (untimed).
IDLE_LOOK = 0.02


def _agent_config(options: dict, port: int, host: str = "127.0.0.1", path: str | None = None):
    from kvxfer import AgentConfig  # noqa: PLC0415

    extra = {}
    if options.get("slot_bytes"):
        extra = dict(pipeline_slot_bytes=options["slot_bytes"], pipeline_slots=options["slots"])
    # The producer's agent starts (NIXL agent, cache registration, IPC export) while the
    # consumer already knocks: give the first handshake more than the default 10 s.
    # from_env: a run may set kvxfer's variables (e.g. KVXFER_EXPRESS_PORT=off, to compare)
    return AgentConfig.from_env(side_channel_host=host, side_channel_port=port, handshake_timeout=60.0,
                                transfer_path=path or options.get("transfer_path") or "auto", **extra)


def _bench_agent(w, options: dict, port: int, listen: bool):
    """This worker's ``Agent`` for ``kvxfer-agent``, kept across rounds: a consumer keeps one per
    transfer path; a producer (``listen``) has one, on ``options["producer_host"]`` (default
    127.0.0.1), whose own path is ``options["producer_path"]`` (``staged``: it also serves staged
    reads of host memory)."""
    from kvxfer import Agent  # noqa: PLC0415

    key = "agent-producer" if listen else f"agent-{options.get('transfer_path') or 'auto'}"
    ag = w.extra.get(key)
    if ag is None:
        host = options.get("producer_host" if listen else "consumer_host") or "127.0.0.1"
        path = options.get("producer_path") if listen else None
        ag = Agent(f"{w.name}-{key}", w.cache.spec, _agent_config(options, port, host, path))
        ag.register(w.cache.tensors)
        if listen:
            ag.listen()
        w.extra[key] = ag
    return ag


def step_ids(ids, batch: int) -> list[np.ndarray]:
    """A ``--batch`` step's ids: the run's request (``batch`` requests' worth of blocks) cut into
    ``batch`` equal requests, in order (the orchestrator makes the block count divisible)."""
    return np.split(np.asarray(ids), batch) if batch > 1 else [np.asarray(ids)]


def submit_step(ag, remote, local: list, remote_ids: list, rids: list[str], tokens: list | None = None) -> list:
    """Submit one step of reads and return their handles in order: through the public batch
    API (``Agent.read_many``) where the Agent has it, else as back-to-back ``Agent.read`` calls.
    ``tokens``: each read's hold token (``kvxfer-token``, ``kvxfer-token-direct``), or None."""
    if hasattr(ag, "read_many"):
        from kvxfer import ReadRequest  # noqa: PLC0415 - the batch API's request type

        tokens = tokens or [None] * len(rids)
        return ag.read_many([ReadRequest(remote, lb, rb, rid, timeout=DEADLINE, token=tok)
                             for lb, rb, rid, tok in zip(local, remote_ids, rids, tokens)])
    return [ag.read(remote, lb, rb, rid, timeout=DEADLINE) for lb, rb, rid in zip(local, remote_ids, rids)]


def agent(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-agent``: ``Agent.read`` from the producer instance, end to end.

    ``options["transfer_path"]`` (``--gpu-path``) picks the Agent's path; the modes the reads
    reported are returned under ``"modes"``. With ``options["batch"]`` N > 1 each iteration is
    one step of N requests (``submit_step``), timed until every one of them is complete."""
    offset = 50 + 10 * ("auto", "ipc", "staged", "direct").index(options.get("transfer_path") or "auto")
    ag = _bench_agent(w, options, options["port"] + offset, listen=False)
    remote = (options.get("producer_host") or "127.0.0.1", options["port"])
    batch = options.get("batch", 1)
    local_ids = step_ids(requests[0]["local_ids"], batch)
    remote_ids = step_ids(requests[0]["ids"], batch)
    modes: set[str] = set()
    by_token: list[bool] = []
    setup: list[float] = []
    posted: list[float] = []
    claims: list[float] = []
    total_vs_wall: list[float] = []   # TransferStats.total_seconds over this loop's own clock
    posted_vs_wall: list[float] = []  # TransferStats.seconds over it

    held = (requests[0].get("prepared") or {}).get("tokens")  # kvxfer-token-direct: rid -> the hold's token
    if held is not None:
        from kvxfer import HoldToken  # noqa: PLC0415
        ag.connect(*remote)  # a handshaken producer: the token reads start at once
    # KVXFER_BENCH_PHASES=1: the timeline of the timed reads (``kvxfer.bench.phases``), to stderr
    timeline = Timeline.installed() if os.environ.get("KVXFER_BENCH_PHASES") == "1" else None
    calls: list[tuple[float, float]] = []

    def body(it):
        t0 = time.perf_counter()
        rids = _step_rids(options, it)
        tokens = [HoldToken.from_wire(held[rid]) for rid in rids] if held is not None else None
        if timeline is not None:  # its own clock: the timed seconds stay what they are without it
            t1, c1 = timeline.start(), time.thread_time()
        handles = submit_step(ag, remote, local_ids, remote_ids, rids, tokens)
        if timeline is not None:
            timeline.mark("read_many returned")
            if it >= warmup:  # the call's wall time and this thread's CPU time in it
                calls.append((time.perf_counter() - t1, time.thread_time() - c1))
        all_stats = [h.wait(DEADLINE) for h in handles]
        w._sync()
        seconds = time.perf_counter() - t0
        if timeline is not None:
            timeline.mark("all waits returned")
            if it >= warmup:
                timeline.record(t1, batch > 1)
        for stats in all_stats:
            modes.add(stats.mode)
            by_token.append(getattr(stats, "by_token", False))
        setup.append(all_stats[0].setup_seconds)
        posted.append(all_stats[-1].seconds)
        claims.append(all_stats[0].claim_seconds)
        total_vs_wall.append(max(s.total_seconds for s in all_stats) / seconds)
        posted_vs_wall.append(all_stats[-1].seconds / seconds)
        return seconds

    result = timed_loop(w, iters, warmup, body)
    if timeline is not None:
        wall, cpu = (statistics.median(c[k] for c in calls) * 1e6 for k in (0, 1))
        print(f"[phases] {'token' if held is not None else 'claimed'} reads, {batch} a step, {iters} timed steps; "
              f"the submitting call: {wall:.0f} us wall, {cpu:.0f} us of its thread's CPU (medians)\n"
              + "\n".join(timeline.lines()), file=sys.stderr, flush=True)
        timeline.offsets.clear()
    result["modes"] = sorted(modes) + (["by token"] if by_token and all(by_token) else [])
    result["api"] = "read_many" if hasattr(ag, "read_many") else ("read x N" if batch > 1 else "read")
    # medians (warm-up included): before the post (ids, path, claims, tables, launch) and after it
    # (with a step: the first request's setup and claim, the last one's post-to-done)
    result["setup_ms"] = sorted(setup)[len(setup) // 2] * 1e3 if setup else None
    result["posted_ms"] = sorted(posted)[len(posted) // 2] * 1e3 if posted else None
    result["claim_ms"] = sorted(claims)[len(claims) // 2] * 1e3 if claims else None
    # The stats against the bench's own clock (read() to wait() returning, device synced): total
    # should be just under 1 (the call is the whole request); posted is what the post left to do.
    result["total_vs_wall"] = _median(total_vs_wall)
    result["posted_vs_wall"] = _median(posted_vs_wall)
    result["total_over_wall"] = sum(1 for r in total_vs_wall if r > 1.0)  # must stay 0
    return result


def _median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 3) if values else None


def hold_agent(w, consumer, request, tokens, rounds, options):
    """Before ``kvxfer-agent`` is timed: hold every round's request(s), so the consumer's first
    claim (at once, when the agents are already connected) finds them held."""
    ag = _bench_agent(w, options, options["port"], listen=True)
    ag.finished()  # forget earlier serves' reports
    chunks = step_ids(request["ids"], options.get("batch", 1))
    tokens = {}
    for it in range(rounds):
        for rid, ids in zip(_step_rids(options, it), chunks):
            # one consumer rank is measured: with consumer TP > 1 (tp1-2) the default would wait
            # for the unmeasured ranks' reads until the lease expired
            ag.hold(rid, ids, consumers=1)
            if options.get("hold_tokens"):  # kvxfer-token-direct: the tokens travel to the consumer
                token = ag.hold_token(rid)
                if token is None:
                    raise TransferFailedError(f"kvxfer-token-direct: the hold of {rid!r} got no token")
                tokens[rid] = token.wire()
    return {"held": rounds * len(chunks), **({"tokens": tokens} if options.get("hold_tokens") else {})}


def _step_rids(options: dict, it: int) -> list[str]:
    batch = options.get("batch", 1)
    if batch == 1:
        return [f"bench-{options['run']}-{it}"]
    return [f"bench-{options['run']}-{it}-{j}" for j in range(batch)]


def _agent_rids(options: dict, rounds: int) -> list[str]:
    return [rid for it in range(rounds) for rid in _step_rids(options, it)]


def serve_agent(w, consumer, request, tokens, rounds, options):
    """Producer half of ``kvxfer-agent`` (after ``hold_agent``): wait until every request was read."""
    ag = _bench_agent(w, options, options["port"], listen=True)
    rids = _agent_rids(options, rounds)
    deadline = time.monotonic() + DEADLINE * 2
    held = list(rids)
    # only the holds still standing are looked at again: a look over every round's ids each
    # millisecond kept this (idle) producer's interpreter busy for a growing share of the run
    while held := [rid for rid in held if ag.holding(rid)]:
        if time.monotonic() > deadline:
            raise TransferTimeoutError("kvxfer-agent: the producer still holds requests the consumer read; "
                                       "it was never told they were done")
        if options.get("busy"):  # a busy engine: its main thread runs Python while the reads go on
            spin(1e-3)
        else:
            # an idle producer, as raw NIXL's rows have: nothing waits on this look, and on a
            # small host a frequent one competes with the consumer being timed
            time.sleep(IDLE_LOOK)
    # A staged read's hold can end (its last piece served) a moment before its report is filed:
    # collect reports for a short while before calling a request unreported.
    sent: set = set()
    expired: set = set()
    settle = time.monotonic() + 5.0
    while True:
        fin = ag.finished()
        sent |= set(fin.sent)
        expired |= set(fin.expired) | set(fin.aborted)
        missing = [rid for rid in rids if rid not in sent]
        if not missing or time.monotonic() > settle:
            break
        time.sleep(5e-3)
    if missing:
        raise TransferFailedError(f"kvxfer-agent: {len(missing)} of {len(rids)} holds ended without the "
                                  f"consumer's done notice (e.g. {missing[0]!r}; expired: "
                                  f"{sorted(set(missing) & expired)})")
    return {"rounds": rounds}


def _direct_tokens(options: dict) -> dict:
    """``kvxfer-token-direct``'s options: the direct path, holds that answer their tokens (issue 35)."""
    return {**options, "transfer_path": "direct", "hold_tokens": True}


def _tokens(options: dict) -> dict:
    """``kvxfer-token``'s options: the run's path (``--gpu-path``; auto takes IPC on one GPU), holds
    that answer their tokens (issue 35): no claim on any path that reads by token."""
    return {**options, "hold_tokens": True}


CONSUMER = {"kvxfer-agent": agent, "kvxfer-agent-direct": agent, "kvxfer-agent-staged": agent,
            "kvxfer-token-direct": lambda w, r, t, i, wu, o: agent(w, r, t, i, wu, _direct_tokens(o)),
            "kvxfer-token": lambda w, r, t, i, wu, o: agent(w, r, t, i, wu, _tokens(o))}
PREPARE = {"kvxfer-agent": hold_agent, "kvxfer-agent-direct": hold_agent, "kvxfer-agent-staged": hold_agent,
           "kvxfer-token-direct": lambda w, c, r, t, n, o: hold_agent(w, c, r, t, n, _direct_tokens(o)),
           "kvxfer-token": lambda w, c, r, t, n, o: hold_agent(w, c, r, t, n, _tokens(o))}
PRODUCER = {"kvxfer-agent": serve_agent, "kvxfer-agent-direct": serve_agent, "kvxfer-agent-staged": serve_agent,
            "kvxfer-token-direct": serve_agent, "kvxfer-token": serve_agent}
