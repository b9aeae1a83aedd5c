"""Mooncake Transfer Engine as a peer in ``kvxfer bench`` (layer: bench app; Mooncake imported lazily).

The library an engine would otherwise use to move KV caches, timed on the same caches, block ids
and verification as kvxfer's rows (same contract as ``kvxfer.bench.methods``):

* ``mooncake-batch``: one ``batch_transfer_sync_read`` of the request's pieces, one per
  layer x K/V x block (the pieces ``nixl-per-block`` posts), cache to cache, whole cache verified;
* ``mooncake-1desc``: one contiguous read of the same byte count, link buffer to link buffer
  (the pair of ``nixl-1desc``), verified against the producer's seeded bytes.

Mooncake runs over TCP (``MC_FORCE_TCP=1``, the transport the non-CUDA wheel has without RDMA)
with its peer-to-peer handshake (no metadata server): each process starts one engine, registers
its cache and link buffer, and the consumer names the producer by ``host:rpc_port``. Install:
``pip install 'kvxfer[peers]'`` plus the system's ``libibverbs.so.1`` (Debian/Ubuntu:
``apt-get install -y libibverbs1``), which the wheel's ``engine.so`` links against even for TCP.
Where either is missing the rows are skipped with that one line; the other methods run.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvxfer.bench.methods import timed_loop, block_pairs, link_check

__all__ = ["CONSUMER", "PREPARE", "unavailable_reason"]

#: Mooncake's TCP transport refuses a batch with more pieces queued per peer than
#: ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1,024 per lane; 16,384 is the largest value
#: 0.3.13 accepts): the bench raises the limit to that and cuts larger requests into batches of it.
MAX_BATCH = 16384

INSTALL = ("pip install 'kvxfer[peers]' (mooncake-transfer-engine-non-cuda) and the system's "
           "libibverbs.so.1 (apt-get install -y libibverbs1)")


def unavailable_reason() -> str | None:
    """Why Mooncake's engine cannot be imported here (one line), or None when it can."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"Mooncake Transfer Engine not available ({str(exc).splitlines()[0][:120]}): {INSTALL}"
    return None


def _gpu_reason(w: Any) -> str | None:
    """Why this worker's (GPU) memory cannot go through the installed Mooncake, or None."""
    if not w.device.startswith("cuda"):
        return None
    from importlib import metadata  # noqa: PLC0415

    try:
        metadata.version("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        return None  # another build (e.g. the CUDA one): let it try
    return ("the installed Mooncake wheel (mooncake-transfer-engine-non-cuda) moves host memory only; "
            "GPU rows need its CUDA build, mooncake-transfer-engine")


def _engine(w: Any, host: str) -> tuple[Any, str]:
    """This worker's engine (started once, cache and link buffer registered) and its name."""
    got = w.extra.get("mooncake")
    if got is not None:
        return got
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(MAX_BATCH))
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines would drown the progress
    from mooncake.engine import TransferEngine  # noqa: PLC0415

    te = TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
    where = "cpu:0" if not w.device.startswith("cuda") else w.device
    for t in [*w.cache.tensors, w.link]:
        rc = te.register_memory(t.data_ptr(), t.numel() * t.element_size(), where)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({where}) returned {rc}")
    w.extra["mooncake"] = (te, f"{host}:{te.get_rpc_port()}")
    return w.extra["mooncake"]


def prepare(w, consumer, request, tokens, rounds, options) -> dict:
    """Producer, before ``measure``: start the engine; the consumer reads its ``target``."""
    reason = unavailable_reason() or _gpu_reason(w)
    if reason is not None:
        return {"skipped": reason}
    _, target = _engine(w, options.get("producer_host") or "127.0.0.1")
    return {"target": target}


def _read(te: Any, target: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
    for at in range(0, len(local), MAX_BATCH):
        end = at + MAX_BATCH
        rc = te.batch_transfer_sync_read(target, local[at:end], remote[at:end], lengths[at:end])
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_read of {len(local[at:end])} pieces returned {rc}")


def _consumer(w, requests, options) -> tuple[Any, list[str]] | dict:
    for r in requests:
        if "skipped" in r.get("prepared", {}):
            return {"skipped": r["prepared"]["skipped"]}
    reason = unavailable_reason() or _gpu_reason(w)
    if reason is not None:
        return {"skipped": reason}
    te, _ = _engine(w, options.get("consumer_host") or "127.0.0.1")
    return te, [r["prepared"]["target"] for r in requests]


def batch(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``mooncake-batch``: every piece of the request in one batched read."""
    got = _consumer(w, requests, options)
    if isinstance(got, dict):
        return got
    te, targets = got
    pieces = block_pairs(w, requests, tokens, options)
    if isinstance(pieces, dict):
        return pieces
    # Lists built once, outside the timed loop (as NIXL's prepared lists are for nixl-per-block).
    reads = [(target, local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist())
             for target, (_, _, local, remote) in zip(targets, pieces)]

    def body(it):
        t0 = time.perf_counter()
        for read in reads:
            _read(te, *read)
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body, options.get("twin") or "native")
    result["descriptors"] = sum(len(r[1]) for r in reads)
    return result


def one_desc(w, requests, tokens, iters, warmup, options):
    """Consumer half of ``mooncake-1desc``: the request's byte count in one contiguous read."""
    got = _consumer(w, requests, options)
    if isinstance(got, dict):
        return got
    te, targets = got
    total = options["request_bytes"]
    share = total // len(requests)
    check = link_check(w, requests, total)
    if check is None:
        return {"skipped": f"link buffer of {w.link.numel()} bytes < request {total}"}

    def body(it):
        t0 = time.perf_counter()
        for i, (r, target) in enumerate(zip(requests, targets)):
            _read(te, target, [w.link.data_ptr() + i * share], [w.peers[r["name"]]["link"]], [share])
        return time.perf_counter() - t0

    result = timed_loop(w, iters, warmup, body, poison=check[0], verify=check[1])
    result["descriptors"] = len(requests)
    return result


CONSUMER = {"mooncake-batch": batch, "mooncake-1desc": one_desc}
PREPARE = {"mooncake-batch": prepare, "mooncake-1desc": prepare}
