"""The transfer methods ``kvxfer bench`` times, consumer and producer halves (layer: bench app).

Every consumer method returns ``{"times": [seconds per timed iteration], "verified": n_ok,
"failed": n_bad, "descriptors": ..}``; before every iteration the destination is overwritten
with random background bytes, after it the whole destination is compared byte for byte with
the expected cache. Methods:

* ``nixl-per-block``: raw NIXL, one descriptor per layer x K/V x block (what per-layer
  connectors issue), prepared lists, one ``make_prepped_xfer`` per producer per request;
* ``nixl-1desc``: raw NIXL, the request's bytes as one descriptor per producer (the link's
  NIXL figure; moves contiguous buffers, not the cache);
* ``memcpy`` (CPU): the same byte count copied within the consumer process (the memory line);
* ``kvxfer-staged-read`` / ``-write``: ``kvxfer.engine.paths.pipeline`` pipelines (pack, move, unpack);
* ``kvxfer-ipc``: ``kvxfer.gpu`` single pass through CUDA IPC (same host only);
* ``kvxfer-agent``: the public ``kvxfer.Agent`` read path, end to end (CPU and GPU; on GPUs
  ``--gpu-path`` forces the Agent's path: auto, ipc, staged or direct), in
  ``kvxfer.bench.agentmethods``; ``kvxfer-token`` the same with the producer's hold tokens (no
  claim; ``kvxfer-token-direct`` forces the direct path); Mooncake's rows are in ``kvxfer.bench.mooncake``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from kvxfer.backend.base import descs
from kvxfer.bench.links import PeerLink
from kvxfer.errors import TransferFailedError, TransferTimeoutError
from kvxfer.testing import spin_python as spin
from kvxfer.types import Direction, MemKind, XferState

__all__ = ["CONSUMER", "PREPARE", "PRODUCER", "peer_copy"]

DEADLINE = 30.0


def timed_loop(w: Any, iters: int, warmup: int, body: Callable[[int], float], key: str = "native",
          poison: Callable[[], None] | None = None, verify: Callable[[], bool] | None = None) -> dict:
    times, ok, bad = [], 0, 0
    for it in range(warmup + iters):
        (poison or (lambda: w.poison(key)))()
        seconds = body(it)
        good = (verify or (lambda: w.verify(key)))()
        if it >= warmup:
            times.append(seconds)
            ok, bad = ok + good, bad + (not good)
    return {"times": times, "verified": ok, "failed": bad}


def _wait_all(backend: Any, xids: list[int], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    pending = list(xids)
    while pending:
        still = []
        for x in pending:
            state = backend.state(x)
            if state is XferState.PENDING:
                still.append(x)
                continue
            backend.release(x)
            if state is XferState.FAILED:
                raise TransferFailedError(f"{what}: transfer failed")
        pending = still
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"{what}: not done after {DEADLINE} s")


def _contiguous(ts: int, hs: int, tokens: int, heads: int) -> bool:
    return (hs == 1 and (ts == heads or tokens == 1)) or (ts == 1 and (hs == tokens or heads == 1))


# ---- raw NIXL ------------------------------------------------------------------------
def block_pairs(w, requests, tokens, options):
    """Per producer, the request as one piece per layer x K/V x block: ``(name, info, local
    descs, remote descs)``, addresses in wire order; or a ``{"skipped": why}`` dict when the
    layouts differ so a block is no single byte range (the raw and peer baselines need that)."""
    import dataclasses  # noqa: PLC0415

    from kvxfer.layout.pairs import direct_pairs  # noqa: PLC0415 - pure numpy tables
    from kvxfer.layout.spec import CacheGeometry  # noqa: PLC0415

    key = options.get("twin") or "native"
    spec = w.cache.spec if key == "native" else dataclasses.replace(w.cache.spec, layout=key)
    out = []
    for r in requests:
        info = w.peers[r["name"]]
        pairs = direct_pairs(r["spec"], CacheGeometry(info["bases"], info["device"], w.cache.geometry.kind),
                             r["ids"], spec, w.cache.geometry, r["local_ids"], tokens)
        if not (_contiguous(pairs.src_ts, pairs.src_hs, pairs.tokens, pairs.heads)
                and _contiguous(pairs.dst_ts, pairs.dst_hs, pairs.tokens, pairs.heads)):
            return {"skipped": "not expressible as one descriptor per block (layouts differ)"}
        out.append((r["name"], info, descs(pairs.dst, pairs.pair_bytes, w.cache.geometry.device),
                    descs(pairs.src, pairs.pair_bytes, info["device"])))
    return out


def nixl_per_block(w, requests, tokens, iters, warmup, options):
    """One descriptor per layer x K/V x block, lists prepared once per peer and one
    ``make_prepped_xfer`` per producer per request: how vLLM's stock NIXL connector posts."""
    key = options.get("twin") or "native"
    pieces = block_pairs(w, requests, tokens, options)
    if isinstance(pieces, dict):
        return pieces
    kind = w.cache.geometry.kind
    posts, count = [], 0
    for name, info, local, remote in pieces:
        lp = w.backend.prepare(None, local, kind)
        rp = w.backend.prepare(name, remote, MemKind(info["kind"]))
        posts.append((name, lp, rp, np.arange(len(local), dtype=np.int64)))
        count += len(local)

    def body(it):
        t0 = time.perf_counter()
        xids = [w.backend.post_prepared(Direction.READ, lp, idx, rp, idx, name, b"")
                for name, lp, rp, idx in posts]
        _wait_all(w.backend, xids, "nixl-per-block")
        return time.perf_counter() - t0

    try:
        result = timed_loop(w, iters, warmup, body, key)
    finally:
        for _, lp, rp, _ in posts:
            w.backend.unprepare(lp)
            w.backend.unprepare(rp)
    result["descriptors"] = count
    return result


def link_check(w, requests, total):
    """``(poison, verify)`` for a read of ``total`` bytes into this worker's link buffer, each
    producer's share from the start of its own link buffer (seeded, so known here); or None
    when the link buffer is too small."""
    import torch  # noqa: PLC0415

    share = total // len(requests)
    if share * len(requests) > w.link.numel():
        return None
    expected = torch.empty_like(w.link[: share * len(requests)])
    for i, r in enumerate(requests):
        gen = torch.Generator(device=w.device)
        gen.manual_seed(r["seed"] + 1)
        src = torch.randint(0, 256, (w.peers[r["name"]]["link_bytes"],), dtype=torch.uint8,
                            device=w.device, generator=gen)
        expected[i * share:(i + 1) * share] = src[:share]
    background = torch.randint(0, 256, expected.shape, dtype=torch.uint8, device=w.device)

    def poison():
        w.link[: expected.numel()].copy_(background)
        w._sync()

    def verify():
        w._sync()
        return bool(torch.equal(w.link[: expected.numel()], expected))

    return poison, verify


def nixl_1desc(w, requests, tokens, iters, warmup, options):
    """The same byte count as one descriptor per producer, link buffer to link buffer."""
    total = options["request_bytes"]
    share = total // len(requests)
    kind = w.cache.geometry.kind
    dev = w.cache.geometry.device
    check = link_check(w, requests, total)
    if check is None:
        return {"skipped": f"link buffer of {w.link.numel()} bytes < request {total}"}

    def body(it):
        t0 = time.perf_counter()
        xids = []
        for i, r in enumerate(requests):
            info = w.peers[r["name"]]
            xids.append(w.backend.post(Direction.READ, descs([w.link.data_ptr() + i * share], share, dev),
                                       kind, descs([info["link"]], share, info["device"]),
                                       MemKind(info["kind"]), r["name"], b""))
        _wait_all(w.backend, xids, "nixl-1desc")
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body, poison=check[0], verify=check[1])
    result["descriptors"] = len(requests)
    return result


# ---- kvxfer GPU paths ----------------------------------------------------------------------
def _each(requests, fn) -> None:
    """Run ``fn(index, request)`` for every producer, in threads when there are several."""
    if len(requests) == 1:
        fn(0, requests[0])
        return
    errors: list[BaseException] = []

    def run(i, r):
        try:
            fn(i, r)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def staged(w, requests, tokens, iters, warmup, options, direction: str):
    """Consumer half of ``kvxfer-staged-read`` / ``-write``."""
    from kvxfer.layout.pairs import unpack_pairs  # noqa: PLC0415
    from kvxfer.engine.paths.pipeline import fetch_read, receive_write  # noqa: PLC0415

    slot_bytes = options.get("piece_bytes") or w.area.slot_bytes
    per = w.area.slots // len(requests)

    def one(it, i, r):
        info = w.peers[r["name"]]
        deadline = time.monotonic() + DEADLINE
        unpack = unpack_pairs(r["spec"], r["ids"], w.cache.spec, w.cache.geometry, r["local_ids"], 0, tokens)
        area = w.area.subset(i * per, per)
        link = PeerLink(w.mailbox, r["name"])
        if direction == "read":
            trace: list = []
            fetch_read(it, unpack, area, w.kernel, link, w.backend, r["name"],
                       lambda s, base=info["staging"], sb=info["slot_bytes"]: base + s * sb,
                       info["device"], deadline, slot_bytes, trace=trace)
            traces[i] = [(what, piece, round((t - starts[it]) * 1e3, 3)) for what, piece, t in trace]
        else:
            receive_write(it, unpack, area, w.kernel, link, deadline, slot_bytes)

    traces: dict[int, list] = {}
    starts: dict[int, float] = {}

    def body(it):
        t0 = starts[it] = time.perf_counter()
        for r in requests:
            w.mailbox.send_go(r["name"], it)
        _each(requests, lambda i, r: one(it, i, r))
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body)
    if traces:
        result["trace_ms"] = traces  # the last iteration's steps, ms after GO, per producer
    return result


def ipc(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``kvxfer-ipc``: one pair-copy kernel per producer, reading through IPC
    (the request's tables from a per-producer ``DirectTemplate``, as ``Agent.read`` builds them)."""
    from kvxfer.layout.pairs import DirectTemplate  # noqa: PLC0415
    from kvxfer.layout.request import check_block_ids  # noqa: PLC0415

    cp = w.kernel.cp
    with cp.cuda.Device(w.kernel.device):
        streams = [cp.cuda.Stream(non_blocking=True) for _ in requests]
    for r in requests:
        if "mapped" not in w.peers[r["name"]]:
            return {"skipped": "peer cache not mapped through CUDA IPC (not on this host?)"}
    templates = [DirectTemplate(r["spec"], w.peers[r["name"]]["mapped"].geometry, w.cache.spec, w.cache.geometry)
                 for r in requests]

    host: list[float] = []
    kernel = w.kernel if not options.get("unroll") else type(w.kernel)(w.kernel.device, unroll=options["unroll"])

    def body(it):
        t0 = time.perf_counter()
        keep = []
        for r, stream, template in zip(requests, streams, templates):
            # the ids checked as Agent.read checks them (once per read), then the table and launch
            src_ids = check_block_ids("remote", r["ids"], r["spec"].num_blocks)
            dst_ids = check_block_ids("local", r["local_ids"], w.cache.spec.num_blocks)
            keep.append(kernel.launch(template.copy(src_ids, dst_ids, tokens), stream.ptr))
        host.append(time.perf_counter() - t0)  # ids checked, tables built, uploaded and launched
        for stream in streams:
            stream.synchronize()
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body)
    result["host_ms"] = sorted(host)[len(host) // 2] * 1e3
    return result


def peer_copy(w, src_device, nbytes, iters, warmup):
    """torch ``copy_`` of ``nbytes`` from ``src_device`` to this process's GPU, verified."""
    import torch  # noqa: PLC0415

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=w.device)
    times, ok = [], 0
    for it in range(warmup + iters):
        dst.fill_(0xA5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if it >= warmup:
            times.append(seconds)
            ok += bool(torch.equal(dst.to(src.device), src))
    return {"times": times, "verified": ok, "failed": iters - ok, "descriptors": 1}


def host_copy(w, requests, tokens, iters, warmup, options):
    """``memcpy``: ``torch`` ``copy_`` of the request's byte count between two host buffers of
    this process (one core's memory bandwidth: the line for two processes of one CPU host)."""
    import torch  # noqa: PLC0415

    if w.device != "cpu":
        return {"skipped": "memcpy is the CPU line (on GPUs: peer-copy)"}
    nbytes = options["request_bytes"]
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)

    def body(it):
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body, poison=lambda: dst.fill_(0xA5),
                   verify=lambda: bool(torch.equal(dst, src)))
    result["descriptors"] = 1
    return result


# ---- producer halves ------------------------------------------------------------------------
def serve_staged(w, consumer, request, tokens, rounds, options, direction: str):
    from kvxfer.layout.pairs import pack_pairs  # noqa: PLC0415
    from kvxfer.engine.paths.pipeline import push_write, serve_read  # noqa: PLC0415

    slot_bytes = options.get("piece_bytes") or w.area.slot_bytes
    info = w.peers[consumer]
    link = PeerLink(w.mailbox, consumer)
    for _ in range(rounds):
        it = w.mailbox.wait_go(consumer, time.monotonic() + DEADLINE)
        deadline = time.monotonic() + DEADLINE
        pack = pack_pairs(w.cache.spec, w.cache.geometry, request["ids"], request["consumer_spec"],
                          request["local_ids"], 0, tokens)
        if direction == "read":
            serve_read(it, pack, w.area, w.kernel, link, deadline, slot_bytes)
        else:
            first, count = request["remote_slots"]
            push_write(it, pack, w.area, w.kernel, link, w.backend, consumer,
                       lambda s: info["staging"] + (first + s) * info["slot_bytes"], count,
                       info["device"], deadline, slot_bytes)
    return {"rounds": rounds}


def drive(w, options: dict | None = None) -> dict:
    """Producer half of the raw NIXL methods: nothing when the raw agent runs NIXL's progress
    thread; else poll the agent until the orchestrator's next command (``Worker.release``), since
    transports such as TCP move a read's bytes only while the target progresses. With
    ``options["busy"]`` the main thread runs Python meanwhile (a busy engine), polling between
    1 ms spins when there is no progress thread."""
    polls = 0
    if (options or {}).get("busy"):
        deadline = time.monotonic() + 600
        while not w.interrupted() and time.monotonic() < deadline:
            if not w.backend.progress_thread:
                w.mailbox.poll()
                polls += 1
            spin(1e-3)
        return {"polls": polls}
    if not w.backend.progress_thread:
        deadline = time.monotonic() + 600  # a guard only: the orchestrator's release ends it
        while not w.interrupted() and time.monotonic() < deadline:
            w.mailbox.poll()
            polls += 1
            time.sleep(0)
    return {"polls": polls}


CONSUMER: dict[str, Callable[..., dict]] = {
    "nixl-per-block": nixl_per_block,
    "nixl-1desc": nixl_1desc,
    "memcpy": host_copy,
    "kvxfer-staged-read": lambda *a: staged(*a, direction="read"),
    "kvxfer-staged-write": lambda *a: staged(*a, direction="write"),
    "kvxfer-ipc": ipc,
}

#: Producer steps that must finish before the consumer starts ``measure``.
PREPARE: dict[str, Callable[..., dict]] = {}  # the kvxfer-agent rows' holds: kvxfer.bench.agentmethods

PRODUCER: dict[str, Callable[..., dict]] = {
    "nixl-per-block": lambda w, *a: drive(w, a[-1]),
    "nixl-1desc": lambda w, *a: drive(w, a[-1]),
    "kvxfer-staged-read": lambda *a: serve_staged(*a, direction="read"),
    "kvxfer-staged-write": lambda *a: serve_staged(*a, direction="write"),
}
