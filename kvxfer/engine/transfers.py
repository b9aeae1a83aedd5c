"""The transfer engine: posts a request's parts, polls them, completes handles (layer: engine).

May import backend.base, layout, protocol, clock, errors, types; never nixl, zmq or torch.
One request may span several peer ranks (heterogeneous TP): each rank is a *part*; the
request's handle completes when every part has, and fails (releasing the others) as soon
as one fails or the deadline passes. Staged parts land in a registered staging buffer and
are unpacked into the cache before the part counts as done. A part may instead carry a
``Job`` (the GPU paths: a CUDA IPC kernel, a staged pipeline) that moves the bytes itself;
the engine polls it and, when it finishes, sends the part's notification to the peer, as a
backend transfer would have on completion.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvxfer.backend.base import Backend, XferId
from kvxfer.clock import Clock, MonotonicClock
from kvxfer.engine.handles import TransferHandle, TransferStats
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import (
    ClosedError,
    KvxferError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvxfer.types import Direction, MemKind, XferState

__all__ = ["Job", "Part", "TransferEngine"]


class Job(Protocol):
    """A part that moves its bytes itself. ``poll`` never blocks: True once the bytes are in
    place, a ``KvxferError`` when they cannot be; ``cancel`` stops it and frees what it holds
    (idempotent; after it returns, nothing the job started writes into memory any more)."""

    num_bytes: int
    descriptors: int

    def poll(self) -> bool: ...

    def cancel(self) -> None: ...


@dataclass
class Part:
    """One peer rank's share of a request. ``plan`` is a layout ``RequestPlan`` (or None with a ``job``)."""

    peer: str
    plan: object
    remote_kind: MemKind
    notification: bytes
    job: Job | None = None
    on_done: Callable[[], None] | None = None  # a job part's completion notice (else backend.notify)
    xfer: XferId | None = None
    staging_offset: int | None = None
    done: bool = False
    waiting: bool = False   # staged part not yet posted: the staging buffer was full


@dataclass
class _Request:
    handle: TransferHandle
    direction: Direction
    parts: list[Part]
    deadline: float | None
    started: float
    mode: str
    on_success: Callable[[], None] | None = None
    finished: bool = False
    stats: TransferStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = TransferStats(
            self.handle.request_id,
            num_bytes=sum(int(p.job.num_bytes if p.job else p.plan.num_bytes) for p in self.parts),
            descriptors=sum(int(p.job.descriptors if p.job else p.plan.local.shape[0]) for p in self.parts),
            mode=self.mode,
            peers=len(self.parts),
        )


class TransferEngine:
    """Tracks in-flight requests over one backend. Thread-safe; ``progress`` is called by one thread.

    Args:
        backend: the transport agent.
        local_kind: memory kind of the local cache and staging buffer.
        staging_base: address of the registered staging buffer (0 if none).
        staging: allocator over that buffer, or None (then staged plans are refused).
        unpack: ``unpack(plan, staging_offset)`` moves a landed staged part into the cache.
    """

    def __init__(self, backend: Backend, local_kind: MemKind, *, clock: Clock | None = None,
                 staging_base: int = 0, staging: StagingAllocator | None = None,
                 unpack: Callable[[object, int], None] | None = None) -> None:
        self._backend = backend
        self._kind = local_kind
        self._clock = clock or MonotonicClock()
        self._staging_base = staging_base
        self._staging = staging
        self._unpack = unpack
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._posting: set[str] = set()
        self._closed = False

    # ---- submission --------------------------------------------------------------
    def submit(self, request_id: str, direction: Direction, parts: list[Part], *,
               timeout: float | None, on_success: Callable[[], None] | None = None,
               mode: str | None = None, setup_seconds: float = 0.0,
               claim_seconds: float = 0.0) -> TransferHandle:
        """Post every part now and return the request's handle (``mode`` names the path in its stats).

        Raises:
            ClosedError: the engine was closed.
            KvxferError: posting failed (nothing stays posted) or the request id is in flight.
        """
        if self._closed:
            raise ClosedError("transfer engine is closed")
        handle = TransferHandle(request_id)
        now = self._clock.now()
        if mode is None:
            mode = "staged" if any(p.job is None and p.plan.staging_bytes for p in parts) else "direct"
        req = _Request(handle, direction, parts, None if timeout is None else now + timeout,
                       time.perf_counter(), mode, on_success)
        req.stats.setup_seconds, req.stats.claim_seconds = setup_seconds, claim_seconds
        with self._lock:
            if request_id in self._requests or request_id in self._posting:
                raise TransferFailedError(f"request {request_id!r} already has a transfer in flight")
            self._posting.add(request_id)
        try:
            # Post before the progress thread can see the request, so it never races the posting.
            for part in parts:
                self._post(part, direction)
        except BaseException:
            self._release_parts(req)
            with self._lock:
                self._posting.discard(request_id)
            raise
        with self._lock:
            self._posting.discard(request_id)
            self._requests[request_id] = req
        if not parts:
            self._complete(req, None)
        return handle

    def _post(self, part: Part, direction: Direction) -> None:
        """Post one part; a staged part waits (unposted) while the staging buffer is full."""
        if part.job is not None:
            return  # already running
        local = part.plan.local
        if part.plan.staging_bytes:
            if self._staging is None or self._unpack is None:
                raise TransferFailedError("a staged transfer needs a staging buffer; none is registered")
            if part.plan.staging_bytes > self._staging.capacity:
                raise TransferFailedError(
                    f"a staged part needs {part.plan.staging_bytes} bytes; "
                    f"the staging buffer holds {self._staging.capacity}"
                )
            offset = self._staging.allocate(part.plan.staging_bytes)
            if offset is None:
                part.waiting = True  # posted by progress() once another part frees its range
                return
            part.waiting = False
            part.staging_offset = offset
            local = local.copy()
            local[:, 0] += self._staging_base + offset
        part.xfer = self._backend.post(direction, local, self._kind, part.plan.remote,
                                       part.remote_kind, part.peer, part.notification)

    # ---- progress ----------------------------------------------------------------
    def in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    def progress(self) -> None:
        """Poll every in-flight part once; complete, fail or time out requests."""
        with self._lock:
            requests = list(self._requests.values())
        now = self._clock.now()
        for req in requests:
            try:
                self._poll(req, now)
            except KvxferError as exc:
                self._complete(req, exc)

    def _poll(self, req: _Request, now: float) -> None:
        for part in req.parts:
            if part.done:
                continue
            if part.waiting:
                self._post(part, req.direction)
                if part.waiting:
                    continue
            if part.job is not None:
                if part.job.poll():
                    part.done = True
                    if part.on_done is not None:
                        part.on_done()
                    else:
                        self._backend.notify(part.peer, part.notification)
                continue
            state = self._backend.state(part.xfer)
            if state is XferState.PENDING:
                continue
            if state is XferState.FAILED:
                raise TransferFailedError(
                    f"request {req.handle.request_id!r}: transfer with peer {part.peer!r} failed"
                )
            self._backend.release(part.xfer)
            part.xfer = None
            if part.staging_offset is not None:
                self._unpack(part.plan, self._staging_base + part.staging_offset)
                self._staging.free(part.staging_offset)
                part.staging_offset = None
            part.done = True
        if all(p.done for p in req.parts):
            self._complete(req, None)
        elif req.deadline is not None and now >= req.deadline:
            raise TransferTimeoutError(
                f"request {req.handle.request_id!r}: {sum(p.done for p in req.parts)} of "
                f"{len(req.parts)} parts complete when its deadline passed"
            )

    def _complete(self, req: _Request, error: KvxferError | None) -> None:
        with self._lock:
            if req.finished:
                return
            req.finished = True
            self._requests.pop(req.handle.request_id, None)
        if error is not None:
            self._release_parts(req)
            req.handle._finish(error=error)
            return
        req.stats.seconds = time.perf_counter() - req.started
        if req.on_success is not None:
            req.on_success()
        req.handle._finish(stats=req.stats)

    def _release_parts(self, req: _Request) -> None:
        for part in req.parts:
            if part.job is not None and not part.done:
                part.job.cancel()
            if part.xfer is not None:
                try:
                    self._backend.release(part.xfer)
                except KvxferError:
                    pass  # already failed; releasing is best effort
                part.xfer = None
            if part.staging_offset is not None and self._staging is not None:
                self._staging.free(part.staging_offset)
                part.staging_offset = None

    # ---- cancellation ------------------------------------------------------------
    def cancel(self, request_id: str, error: KvxferError) -> bool:
        """Fail an in-flight request with ``error``; returns False if none was in flight."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            return False
        self._complete(req, error)
        return True

    def close(self) -> None:
        """Fail everything in flight with ClosedError. Idempotent."""
        self._closed = True
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            self._complete(req, ClosedError(f"agent closed while request {req.handle.request_id!r} was in flight"))
