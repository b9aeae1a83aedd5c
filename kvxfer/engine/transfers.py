"""The transfer engine: runs a request's parts on their executors, polls them, completes handles (layer: engine).

May import backend.base, layout, protocol, clock, errors, types; never nixl, zmq or torch.
One request may span several peer ranks (heterogeneous TP): each rank is a *part*, run by
one executor behind the ``Job`` interface (start -> poll -> cancel): a direct backend
transfer or a host-staged one (``kvxfer.engine.posted``, built here from the part's layout
plan), or a job a GPU path already started (a CUDA IPC kernel, a staged pipeline half,
``kvxfer.engine.paths``). The request's handle completes when every part has, and fails as
soon as one fails, it is cancelled, or its deadline passes. When a job that moves its bytes
itself finishes, the engine sends the part's notification to the peer, as a backend transfer
does on completion.

A request's phase (waiting for its grant, its parts, its bytes; draining; ended) follows the one
table in ``kvxfer.engine.lifecycle``; every change of phase here goes through it.

Ownership of the destination (docs/reliability.md): a request's jobs are let go only once
each confirms that nothing it started can write any more (a backend transfer: DONE or FAILED;
releasing a pending one does not stop bytes arriving over every transport, UCX over TCP keeps
writing). So a failed, cancelled or timed-out request first *drains*: its handle fails once
every job has ended, or, if that is not confirmed within ``drain_grace`` seconds after its
deadline, the handle fails anyway and its destination blocks stay *quarantined*
(``quarantined()``) until the jobs confirm the end; ``on_reclaimed(request_id)`` then reports
them free. A request that completes after its deadline (the window its producer granted)
fails: its producer may have freed and reused the blocks while they moved.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvxfer.backend.base import Backend
from kvxfer.clock import Clock, MonotonicClock
from kvxfer.engine import lifecycle
from kvxfer.engine.handles import TransferHandle, TransferStats
from kvxfer.engine.lifecycle import Event, Phase
from kvxfer.engine.posted import DirectJob, HostStagedJob, StagingBuffer
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import (
    BlockIdError,
    ClosedError,
    KvxferError,
    RequestInFlightError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvxfer.types import Direction, MemKind, TransferPath

__all__ = ["LOOKING", "Job", "Part", "TransferEngine", "stop_jobs"]

log = logging.getLogger("kvxfer.engine")

#: Seconds a request is left to the thread that submitted it, from the end of its submission
#: (``submitted``), before the background driver polls it too (``progress(leave_fresh=True)``):
#: the caller that submits a read then waits on it or polls it, and a driver polling beside it
#: from the start only takes the interpreter from that caller (on the CPU host a small read took
#: ~100 us longer). A caller that never polls sees its read completed by the driver at most this
#: much later. Real time, like a waiter's spin: a scheduling hint, never a deadline.
CALLER_GRACE = 0.0005

#: ``_Request.fresh_until`` while the submitting call still works on the request (booked, not yet
#: handed back): the driver leaves it alone until ``submitted`` starts its grace. A step's call
#: books every read before it launches or posts any, and a driver waking at a grace counted from
#: the booking took the interpreter from that call in the middle of the step's launch.
SUBMITTING = math.inf

#: Seconds (on the engine's clock) a handle may stay pending after a poll first found its request
#: ended before the engine's backstop completes it (``TransferEngine._orphaned``): the thread
#: that ended the request completes the handle within microseconds, so a second means that was lost.
ORPHAN_GRACE = 1.0

_INT64 = np.dtype(np.int64)
_EMPTY = np.zeros(0, dtype=np.int64)

#: What a request's ``verify`` returns while its look is still out (a NIXL READ of a hold word on
#: another host): the engine asks again on the request's next poll, until its deadline.
LOOKING = object()


class Job(Protocol):
    """An executor's share of a request: moves its bytes, is polled, can be stopped.

    ``poll`` never blocks: True once the bytes are in place, a ``KvxferError`` when they cannot
    be. ``cancel`` stops the job and frees what it holds; it returns True once nothing the job
    started can write into memory any more, False while that is not confirmed yet (the engine
    calls it again; idempotent). ``notifies``: the job's transport delivers the part's
    notification itself (a backend transfer); otherwise the engine sends it when ``poll`` first
    returns True.
    """

    num_bytes: int
    descriptors: int
    notifies: bool

    def poll(self) -> bool: ...

    def cancel(self) -> bool: ...


def stop_jobs(jobs: list, clock: Clock, grace: float) -> bool:
    """Cancel ``jobs`` and wait (on ``clock``, up to ``grace`` seconds) until none can write any
    more; True once confirmed. For a caller that must not return while they could (a failed
    start); the engine's drain asks again on each pass instead."""
    until = clock.now() + grace
    while True:
        ended = [bool(job.cancel()) for job in jobs]
        if all(ended) or clock.now() >= until:
            return all(ended)
        jobs = [job for job, done in zip(jobs, ended) if not done]
        clock.sleep(0.0005)


@dataclass(eq=False)
class Part:
    """One peer rank's share of a request: a layout ``plan`` the engine runs as a direct or
    host-staged job, or a ``job`` an executor already started (a CUDA IPC kernel, a staged
    pipeline half)."""

    peer: str
    plan: object
    remote_kind: MemKind
    notification: bytes
    job: Job | None = None
    on_done: Callable[[], None] | None = None  # a job part's completion notice (else backend.notify)
    done: bool = False
    ended: bool = False     # cancelled and confirmed: nothing it started writes any more


@dataclass(eq=False)  # identity: a step's membership tests stay O(1), never compare arrays
class _Request:
    handle: TransferHandle
    direction: Direction
    parts: list[Part]
    deadline: float | None
    started: float
    mode: str
    blocks: np.ndarray                      # the local blocks this request writes (READ) or reads
    on_success: Callable[[], None] | None = None
    # Called with the handles of a batch of ended requests (``reserve_many``'s ``on_end``: the
    # agent's reports of its reads), once their handles are complete and before their own
    # done-callbacks run: one call for a step's requests completed together.
    on_end: Callable[[list[TransferHandle]], None] | None = None
    phase: Phase = Phase.GRANTED            # where it stands (``kvxfer.engine.lifecycle``: the one table)
    error: KvxferError | None = None        # why it failed (set with the move to DRAINING)
    drain_until: float = 0.0
    all_done_at: float | None = None        # engine-clock time every part was first seen done
    group: list | None = None               # the requests sharing its job (one launch for a step)
    self_moving: bool = False               # every part moves its own bytes (a kernel, a pipeline)
    # Moves the request on while its grant is pending, on whichever thread polls it: takes the
    # claim's answers once they are in, then grants, posts or fails (``advance(block)`` waits at
    # most ``block`` seconds on the peer; the agent's ``ReadStep.advance``). None: a lane does it.
    advance: Callable[[float], object] | None = None
    # A hold-token read (issue 35, granted before it moves): looked at once every part is done,
    # before success; returns the read's error (the producer's hold ended before the move
    # completed), None, or LOOKING while the look is out (never waits); ``verify.cancel()``, where
    # it exists, gives an unfinished look up when the request ends another way.
    verify: Callable[[], object] | None = None
    stats: TransferStats = field(init=False)
    # Threads launching or posting its parts right now (``posting``, until ``attach``): while any
    # is, the request cannot end (a deadline or a cancel only fails it), so nothing launched can
    # outlive its handle; only ``_abandon`` ends it, once its deadline and the grace have passed.
    posters: int = 0
    # When a poll first found it ended with its handle still pending (``_orphaned``).
    orphan_seen: float | None = None
    # Until then (``time.monotonic``) the background driver leaves it to its caller's polls
    # (``SUBMITTING`` while the submitting call works on it, then ``CALLER_GRACE``); ``Agent.poll``,
    # a waiter and ``done()`` poll it at any time.
    fresh_until: float = 0.0
    # One poller at a time. Held only for bookkeeping and non-blocking polls: never across a post,
    # a launch, a peer's I/O or a callback (those run after it is released).
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.stats = TransferStats(self.handle.request_id, mode=self.mode)

    # The phase read three ways, for the checks that need only one question answered.
    @property
    def finished(self) -> bool:
        """The handle has completed (succeeded, failed or quarantined)."""
        return self.phase in lifecycle.ENDED

    @property
    def granted(self) -> bool:
        """Its producers granted it (``grant``); success waits for that."""
        return self.phase in lifecycle.GRANTED

    @property
    def posted(self) -> bool:
        """Its parts are attached and it may still succeed: polling it may complete it."""
        return self.phase in lifecycle.ATTACHED

    def move(self, event: Event) -> Phase:
        """Apply ``event`` (the caller holds the engine's or the request's lock)."""
        self.phase = lifecycle.advance(self.phase, event)
        return self.phase

    def count_parts(self) -> None:
        num_bytes = descriptors = 0
        peers = set()
        for p in self.parts:
            if p.job:
                num_bytes += int(p.job.num_bytes)
                descriptors += int(p.job.descriptors)
            else:
                num_bytes += int(p.plan.num_bytes)
                descriptors += int(p.plan.local.shape[0])
            peers.add(p.peer)
        stats = self.stats
        stats.num_bytes, stats.descriptors, stats.peers = num_bytes, descriptors, len(peers)


@dataclass(frozen=True)
class EngineCounts:
    """A snapshot for ``Agent.stats()``."""

    in_flight: int          # requests posted and not yet ended (draining included)
    draining: int           # failed requests whose transfers are not confirmed ended yet
    quarantined_blocks: int  # local blocks of failed requests still not confirmed ended


def _give_up_look(req: _Request) -> None:
    """A request ending another way gives up its look at a hold word, if one is out."""
    cancel = getattr(req.verify, "cancel", None)
    if cancel is not None:
        try:
            cancel()
        except Exception:  # noqa: BLE001 - the look's row comes back later or never: no byte of the cache
            log.debug("request %r: giving up its look failed", req.handle.request_id, exc_info=True)


def _quarantine_error(error: KvxferError, blocks: list[int]) -> KvxferError:
    """``error`` for one quarantined request, naming its blocks (``quarantined_blocks``): a copy,
    since one error may fail several requests (a step's), each with its own blocks, and a request
    that ended cleanly with the same error has none."""
    try:
        mine = copy.copy(error)
    except Exception:  # noqa: BLE001 - an error that cannot be rebuilt from its args: name the blocks on it
        mine = error
    mine.__cause__, mine.__context__ = error.__cause__, error.__context__
    mine.__suppress_context__, mine.__traceback__ = error.__suppress_context__, error.__traceback__
    mine.quarantined_blocks = blocks
    return mine


def _let_go(req: _Request) -> None:
    """Drop what an ended request holds of its step (its group, its claim's driver, its success
    callback): each refers back to the request, and a cycle of a step's objects is freed only by
    the interpreter's cycle collector, whose pauses then grow with every step (issue 34, rule 4).
    A failed one keeps its parts (a quarantined request's blocks come back only once they end)."""
    req.group = req.advance = req.on_success = None


def _fresh(req: _Request, now: float) -> bool:
    """Whether the background driver leaves ``req`` to its caller's polls at ``now`` (live and
    submitted less than ``CALLER_GRACE`` ago; a failed one it drains at once)."""
    return req.fresh_until > now and req.error is None and not req.finished


def _watched(req: _Request, groups: dict[int, bool]) -> bool:
    """Whether a waiter polls ``req`` now, or another request of its group (one job for all of
    them: polling one observes it for all); only for jobs that move their own bytes, whose polls
    only observe them. ``groups`` caches the answer per group for one pass."""
    if not req.self_moving or req.error is not None:
        return False
    group = req.group
    if group is None:
        return req.handle._watched > 0
    seen = groups.get(id(group))
    if seen is None:
        seen = groups[id(group)] = any(r.handle._watched for r in group)
    return seen


class TransferEngine:
    """Tracks in-flight requests over one backend. Thread-safe; ``progress`` is called by one
    thread, and a request's waiter may poll that request too (``TransferHandle.wait``).

    Args:
        backend: the transport agent.
        local_kind: memory kind of the local cache and staging buffer.
        staging_base: address of the registered staging buffer (0 if none).
        staging: allocator over that buffer, or None (then staged plans are refused).
        unpack: ``unpack(plan, staging_offset)`` moves a landed staged part into the cache.
        drain_grace: seconds past a failed request's deadline (or its failure, if later) that
            its handle waits for the backend to confirm its transfers ended.
        on_reclaimed: ``(request_id)`` when a quarantined request's blocks are free again.
        wake: called when the progress thread should poll again soon (a waiter that was polling
            its request stopped doing so).
    """

    def __init__(self, backend: Backend, local_kind: MemKind, *, clock: Clock | None = None,
                 staging_base: int = 0, staging: StagingAllocator | None = None,
                 unpack: Callable[[object, int], None] | None = None, drain_grace: float = 0.25,
                 on_reclaimed: Callable[[str], None] | None = None,
                 wake: Callable[[], None] | None = None) -> None:
        self._backend = backend
        self._kind = local_kind
        self._clock = clock or MonotonicClock()
        self._area = StagingBuffer(staging_base, staging, unpack) if staging is not None and unpack else None
        self._grace = drain_grace
        self._on_reclaimed = on_reclaimed or (lambda request_id: None)
        self._wake = wake or (lambda: None)
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}   # posted, not yet ended (draining included)
        self._quarantine: dict[str, _Request] = {}  # handle failed, transfers not confirmed ended
        self._sweeping = threading.Lock()          # one thread at a time confirms quarantined ends
        self._closed = False

    # ---- submission --------------------------------------------------------------
    def submit(self, request_id: str, direction: Direction, parts: list[Part], *,
               timeout: float | None = None, deadline: float | None = None, blocks=None,
               on_success: Callable[[], None] | None = None, mode: TransferPath | None = None,
               setup_seconds: float = 0.0, claim_seconds: float = 0.0) -> TransferHandle:
        """Post every part now and return the request's handle: ``reserve`` then ``attach``.

        ``deadline`` (on the engine's clock; or ``timeout`` seconds from now) is the end of the
        request's window: it fails unless it completed before then. ``blocks`` are the local
        block ids the request touches; a request may not touch a quarantined block.

        Raises:
            ClosedError: the engine was closed.
            BlockIdError: a block of ``blocks`` is quarantined.
            RequestInFlightError: the request id already has a transfer in flight (or quarantined).
            KvxferError: posting failed (nothing stays posted).
        """
        if deadline is None and timeout is not None:
            deadline = self._clock.now() + timeout
        req = self.reserve(request_id, direction, deadline=deadline, blocks=blocks)
        req.on_success = on_success
        req.stats.claim_seconds = claim_seconds
        if not self.attach(req, parts, mode=mode, setup_seconds=setup_seconds):
            raise req.error
        return req.handle

    def reserve(self, request_id: str, direction: Direction, *, deadline: float | None = None, blocks=None,
                granted: bool = True) -> "_Request":
        """Register a request before its parts exist; its handle (``.handle``) is pending from now on.

        The request id and its local ``blocks`` are checked at once, atomically with every
        other submission: an id already in flight (or quarantined) is refused, and so is a block
        of a quarantined request. ``granted=False``: the request may not succeed until ``grant``
        (its claim is still travelling). A reserved request that passes its deadline before
        ``attach`` fails with ``TransferTimeoutError``.

        Raises:
            ClosedError, RequestInFlightError, BlockIdError: nothing was registered.
        """
        return self.reserve_many([(request_id, deadline, blocks)], direction, granted=granted)[0]

    def reserve_many(self, items: list, direction: Direction, *, granted: bool = True,
                     caller_polls: bool = False,
                     on_end: Callable[[list[TransferHandle]], None] | None = None) -> list["_Request"]:
        """``reserve`` for many ``(request_id, deadline, blocks)`` at once, all or none: one id in
        flight, repeated among ``items``, or a quarantined block refuses the whole batch.
        ``caller_polls``: the submitting thread polls them first; the background driver leaves
        them to it until ``submitted`` and for ``CALLER_GRACE`` after. ``on_end(handles)``: called
        for these requests once they end, either way (``_Request.on_end``)."""
        now = time.perf_counter()
        fresh = SUBMITTING if caller_polls else 0.0
        reqs = []
        for request_id, deadline, blocks in items:
            if blocks is None:
                ids = _EMPTY
            elif type(blocks) is np.ndarray and blocks.dtype == _INT64 and blocks.ndim == 1:
                ids = blocks  # (a read's checked ids)
            else:
                ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
            reqs.append(_Request(TransferHandle(request_id), direction, [], deadline, now, "direct", ids,
                                 phase=Phase.GRANTED if granted else Phase.RESERVED, fresh_until=fresh,
                                 on_end=on_end))
        with self._lock:
            if self._closed:  # under the lock: ``close`` takes its list of requests after setting it
                raise ClosedError("transfer engine is closed")
            seen: set[str] = set()
            for req in reqs:
                request_id = req.handle.request_id
                if request_id in self._requests or request_id in self._quarantine or request_id in seen:
                    state = "quarantined (its failed transfer is not confirmed ended)" \
                        if request_id in self._quarantine else "in flight"
                    raise RequestInFlightError(
                        f"request {request_id!r} is already {state} on this agent: a second transfer of it is "
                        "refused (wait for the first handle, or abort it)")
                seen.add(request_id)
            if self._quarantine:
                self._check_not_quarantined_many([req.blocks for req in reqs])
            for req in reqs:
                self._requests[req.handle.request_id] = req
        for req in reqs:
            req.handle._poke = partial(self._poke, req)
            req.handle._unwatched = self._wake
            req.handle._hand_over = partial(self._hand_over, req)
        return reqs

    def submitted(self, reqs: list["_Request"]) -> None:
        """The call that booked ``reqs`` with ``caller_polls`` is done with them (launched,
        posted, failed or handed to a lane): their ``CALLER_GRACE`` starts now."""
        until = time.monotonic() + CALLER_GRACE
        for req in reqs:
            if req.fresh_until == SUBMITTING:
                req.fresh_until = until

    def _hand_over(self, req: "_Request") -> None:
        """Its caller will not poll ``req`` (it awaits the handle or added a done-callback): the
        background driver polls it from now on, not after ``CALLER_GRACE``."""
        req.fresh_until = 0.0
        self._wake()

    def attach(self, req: "_Request", parts: list[Part], *, mode: TransferPath | None = None,
               setup_seconds: float = 0.0, started: bool = False, group: list | None = None) -> bool:
        """Give a reserved request its parts, posting those not yet running (no ``job``).

        Parts already running (an IPC kernel launched, a NIXL transfer posted) are attached even
        when the request failed meanwhile, so the request ends only once they have (no byte
        lands after its handle ended). The rest are posted here, outside the request's lock
        (``posting``), unless the request already failed (cancelled, timed out): then nothing
        more goes out and False is returned. Returns False also when posting failed: the
        request then fails with the error, and what was posted before the failure has ended (or
        is left to its drain) when this returns. ``started``: the caller says every part runs
        already (kept for callers; the parts' jobs decide). ``group``: the requests sharing these
        parts' job (a step's one launch); polling one that completes also completes those of
        them that may (``_poke``).
        """
        if mode is None:
            staged = any(p.job is None and p.plan.staging_bytes for p in parts)
            mode = TransferPath.HOST_STAGED if staged else TransferPath.DIRECT
        if any(p.job is None for p in parts):
            return self._post_parts(req, parts, mode, setup_seconds, group)
        return self._attach_running(req, parts, mode, setup_seconds, group)

    def _post_parts(self, req: "_Request", parts: list[Part], mode: TransferPath, setup_seconds: float,
                    group: list | None) -> bool:
        """Post the parts not running yet with no lock held, then attach every part."""
        with self.posting([req]) as live:
            if live:
                posted_at = time.perf_counter()  # the move may run inside the post (UCX over TCP, warm)
                try:
                    for part in parts:
                        self._post(req, part)
                except BaseException as exc:
                    error = exc if isinstance(exc, KvxferError) else TransferFailedError(f"posting failed: {exc!r}")
                    self._fail(req, error)
                    running = [p for p in parts if p.job is not None]
                    stop_jobs([p.job for p in running], self._clock, self._grace)
                    self._attach_running(req, running, mode, setup_seconds, group)
                    return False
                return self._attach_running(req, parts, mode, setup_seconds, group, since=posted_at)
        # Failed or ended before its post: nothing more goes out; what already runs is attached
        # so that the request ends only with it.
        running = [p for p in parts if p.job is not None]
        if running:
            self._attach_running(req, running, mode, setup_seconds, group)
        return False

    def _attach_running(self, req: "_Request", parts: list[Part], mode: TransferPath, setup_seconds: float,
                        group: list | None, since: float | None = None) -> bool:
        """Attach ``parts``, every one running; False if the request had ended (or was abandoned).
        ``since``: when this engine began posting them (the request's ``seconds`` run from there)."""
        with req.lock:
            if req.phase is Phase.QUARANTINED:
                # Its deadline passed while this poster was still posting (``_abandon``): what it
                # started is kept, so the blocks come back only once that has ended.
                req.parts = list(parts)
                with self._lock:
                    req.move(Event.ATTACH)
                return False
            if req.finished:
                # Its jobs started only if the request ended under its poster (``close``): let
                # them end before this returns, as a drain would.
                stop_jobs([p.job for p in parts], self._clock, self._grace)
                return False
            req.parts = list(parts)
            req.group = group
            # ``seconds`` runs from the post (``setup_seconds`` before it)
            req.started = since if since is not None else time.perf_counter()
            req.mode = req.stats.mode = mode
            req.count_parts()
            req.stats.setup_seconds = setup_seconds
            req.self_moving = bool(req.parts) and all(getattr(p.job, "moves_itself", False) for p in req.parts)
            with self._lock:
                req.move(Event.ATTACH)
            succeed = not req.parts and req.error is None and self._landed(req)  # nothing to move
        if succeed:
            self._succeed(req, Event.LANDED)
        if req.granted:
            req.handle._nudge()  # a waiter may poll it now (not before its grant: nothing to poll)
        return True

    def attach_step(self, reqs: list["_Request"], parts: list[list[Part]], *, mode: TransferPath,
                    setup_seconds: list[float], grant: bool = False) -> None:
        """``attach`` for a step's requests whose parts all run already and share one job (one
        kernel launch, one backend post): ``reqs[i]`` gets ``parts[i]`` and the step as its group
        (polling one that completes completes the others that may, ``_poke``). With ``grant``,
        each is also granted (a read by its hold token: its ``verify`` is set before). One pass
        over the step, the same phases as ``attach`` then ``grant`` request by request; a request
        that ended meanwhile keeps its parts as ``attach`` keeps them."""
        group = list(reqs)
        now = time.perf_counter()
        for req, req_parts, setup in zip(reqs, parts, setup_seconds):
            moves_itself = True
            for p in req_parts or (None,):
                if p is None or p.job is None:
                    raise ValueError("attach_step takes running parts only (use attach)")
                moves_itself = moves_itself and getattr(p.job, "moves_itself", False)
            with req.lock:
                if req.phase is Phase.QUARANTINED or req.finished:
                    pass  # ended under its poster: ``_attach_running`` keeps or stops its parts, below
                else:
                    req.parts, req.group, req.started = req_parts, group, now
                    req.mode = req.stats.mode = mode
                    req.count_parts()
                    req.stats.setup_seconds = setup
                    req.self_moving = bool(moves_itself)
                    with self._lock:
                        req.move(Event.ATTACH)
                        if grant and lifecycle.live(req.phase):
                            req.move(Event.GRANT)
                    if req.granted:
                        req.handle._nudge()
                    continue
            self._attach_running(req, req_parts, mode, setup, group)

    def grant(self, req: "_Request", claim_seconds: float = 0.0) -> None:
        """The request's producers granted its claim: it may succeed once its parts are done. A
        grant taken after the request's deadline, its bytes in already, fails it as a poll would
        (``_poll``): success is reported only inside the read's window."""
        with req.lock:
            req.stats.claim_seconds = claim_seconds
            with self._lock:
                if not lifecycle.live(req.phase):
                    return  # failed (or ended) meanwhile: the grant is not wanted
                landed = req.phase is Phase.MOVED
                if not landed:
                    req.move(Event.GRANT)
        if landed:
            if req.deadline is not None and self._clock.now() >= req.deadline:
                self._fail(req, TransferTimeoutError(
                    f"request {req.handle.request_id!r}: its producers had not granted the claim when its "
                    "deadline passed"))
                return
            self._succeed(req, Event.GRANT)  # its bytes were in already: the grant completes it
        if req.posted:
            req.handle._nudge()  # a waiter may poll it now (not before its post: nothing to poll)

    def bound_deadline(self, req: "_Request", deadline: float) -> None:
        """Bring ``req``'s deadline forward to ``deadline`` (engine clock) if it is earlier: its
        producers granted a window that ends then (they count it from their receipt of the
        claim, so it ends no earlier); it succeeds only if done by then."""
        with req.lock:
            if req.deadline is None or deadline < req.deadline:
                req.deadline = deadline

    def on_advance(self, reqs: list["_Request"], advance: Callable[[float], object]) -> None:
        """``advance(block)`` moves ``reqs`` on while their grant is pending (see ``_Request``):
        every poll of one of them (``done``, ``wait``, ``progress``) calls it first."""
        for req in reqs:
            req.advance = advance
            req.handle._nudge()  # a waiter sleeping until the request moves: it may drive it now

    @contextlib.contextmanager
    def posting(self, reqs: list["_Request"]):
        """Mark ``reqs`` as being posted while their parts are launched or posted and attached;
        yields those still live (neither failed nor ended). Use ``attach(..., started=True)``
        inside for what was launched.

        No lock is held meanwhile (polls, grants and other requests' posts go on), but a marked
        request cannot end: a deadline or a cancel only fails it, and its drain waits for this
        poster to attach what it started. Only a poster still inside past the request's deadline
        and the drain's grace loses it (``_abandon``: failed, its blocks quarantined until what
        it attaches afterwards has ended)."""
        live = []
        for req in reqs:
            with req.lock:
                if lifecycle.live(req.phase):
                    req.posters += 1
                    live.append(req)
        try:
            yield live
        finally:
            for req in live:
                with req.lock:
                    req.posters -= 1

    def fail(self, req: "_Request", error: KvxferError) -> bool:
        """Fail a reserved or posted request (e.g. its claim was refused); it drains as any failure."""
        return self._fail(req, error)

    def _check_not_quarantined_many(self, lists: list[np.ndarray]) -> None:
        """``_check_not_quarantined`` for a step's lists: one look over all their ids; where one
        touches a quarantined block, the lists are looked at one by one to name it."""
        held = [other.blocks for other in self._quarantine.values()]
        flat = np.concatenate(lists) if len(lists) > 1 else lists[0]
        if held and flat.size and np.isin(flat, np.concatenate(held)).any():
            for ids in lists:
                self._check_not_quarantined(ids)

    def _check_not_quarantined(self, ids: np.ndarray) -> None:
        for other in self._quarantine.values():
            hit = np.intersect1d(ids, other.blocks)
            if hit.size:
                raise BlockIdError(
                    f"local block {int(hit[0])} is quarantined: request {other.handle.request_id!r} failed "
                    "and its transfer is not confirmed ended yet (finished().reclaimed reports it free)")

    def _post(self, req: _Request, part: Part) -> None:
        """Start a plan part as the executor its plan asks for (a job part is already running)."""
        if part.job is not None:
            return
        label = f"request {req.handle.request_id!r}"
        args = (self._backend, req.direction, part.plan, self._kind, part.peer, part.remote_kind,
                part.notification, label)
        part.job = HostStagedJob(*args, self._area) if part.plan.staging_bytes else DirectJob(*args)

    # ---- progress ----------------------------------------------------------------
    def in_flight(self) -> int:
        """Requests still moving or draining, plus quarantined ones (the progress loop polls them)."""
        with self._lock:
            return len(self._requests) + len(self._quarantine)

    def has(self, request_id: str) -> bool:
        """Whether ``request_id`` is reserved or in flight here (draining included), not yet ended."""
        with self._lock:
            return request_id in self._requests

    def counts(self) -> EngineCounts:
        with self._lock:
            draining = sum(1 for r in self._requests.values() if r.error is not None)
            return EngineCounts(len(self._requests), draining,
                                sum(int(r.blocks.size) for r in self._quarantine.values()))

    def quarantined(self) -> dict[str, list[int]]:
        """Local blocks of failed requests whose transfers are not confirmed ended, by request."""
        with self._lock:
            return {rid: r.blocks.tolist() for rid, r in self._quarantine.items()}

    def progress(self, leave_fresh: bool = False) -> None:
        """Poll every in-flight part once; complete, fail, drain or time out requests. A request
        whose waiter polls it (``TransferHandle.wait``) is left to that waiter; ``leave_fresh``
        (the background driver's passes): so is one submitted less than ``CALLER_GRACE`` ago."""
        with self._lock:
            requests = list(self._requests.values())
            quarantined = list(self._quarantine.values())
        if leave_fresh:
            now = time.monotonic()
            requests = [req for req in requests if not _fresh(req, now)]
        self._progress(requests)
        if not quarantined or not self._sweeping.acquire(blocking=False):
            return
        try:
            for req in quarantined:
                if not req.lock.acquire(blocking=False):
                    continue  # polled meanwhile: next pass
                try:
                    # its poster still inside: what it attaches must end first
                    ended = not req.posters and self._end_parts(req, wait=False)
                finally:
                    req.lock.release()
                if ended:
                    with self._lock:
                        if self._quarantine.get(req.handle.request_id) is not req:
                            continue
                        del self._quarantine[req.handle.request_id]
                        req.move(Event.RECLAIM)
                    self._on_reclaimed(req.handle.request_id)
        finally:
            self._sweeping.release()

    def _progress(self, requests: list[_Request]) -> None:
        groups: dict[int, bool] = {}
        advanced: set[int] = set()
        for req in requests:
            advance = req.advance
            if advance is not None and not req.granted and not req.finished and id(advance) not in advanced:
                advanced.add(id(advance))  # one call moves its whole step on
                advance(0.0)
            if _watched(req, groups):
                continue  # a waiter polls it or its group (a kernel or pipeline: polls only observe it)
            # Never wait on a request's lock (another thread polls it: next pass). A request
            # whose poster is inside (``posting``) is not ended here: it is polled once its parts
            # are attached, or, once its deadline and the drain's grace have passed with its
            # poster still inside a backend call, abandoned.
            if not req.lock.acquire(blocking=False):
                if self._overdue(req):
                    self._abandon(req)
                continue
            succeed, end, stuck = False, None, False
            try:
                if req.posters:
                    stuck = self._overdue(req)
                elif not req.posted:
                    if req.error is None and req.deadline is not None and self._clock.now() >= req.deadline:
                        self._fail(req, TransferTimeoutError(
                            f"request {req.handle.request_id!r}: its timeout passed before its transfer was "
                            "posted (the producer did not answer in time)"))
                    if req.error is not None:
                        end = self._drain(req)
                else:
                    if req.error is None:
                        try:
                            succeed = self._poll(req)
                        except KvxferError as exc:
                            self._fail(req, exc)
                    if req.error is not None:
                        end = self._drain(req)
            finally:
                req.lock.release()
            # what completes a handle (callbacks, notices, a hold word's look) runs unlocked
            if stuck:
                self._abandon(req)
                continue
            if succeed:
                self._succeed(req, Event.LANDED)
            if end is not None:  # failed by another thread after it landed: it drained here, and only
                end()            # this call ends its handle (``_succeed`` found it no longer live)

    def _poke(self, req: _Request, block: float = 0.0) -> bool | None:
        """Poll ``req`` once from its waiter's thread; nothing if another thread is polling it.
        When it completes, the requests of its group (a step's launch) that may complete are
        polled too, in the same pass: one waiter completes the step.

        A request whose grant is pending is first moved on here (``_Request.advance``, waiting at
        most ``block`` seconds for its claim's answer): the claim's answer, the post and the
        completion all happen on the polling thread. Returns True when polled, None while the
        grant is pending and this thread may drive it (poll again), and False while only another
        thread can move it on (a lane claiming it): a waiter then sleeps instead of spinning. A
        failure is recorded here and drained by the progress thread, like one it found."""
        if req.finished:  # ended: its handle completes on the thread that ended it, unless that was lost
            self._orphaned(req)
            return True
        if self._overdue(req):  # past its deadline and the grace: any poller ends it, here
            end = None
            stuck = not req.lock.acquire(blocking=False)
            if not stuck:
                stuck = req.posters > 0
                if not stuck:  # nobody inside: fail and drain it as the progress pass would
                    end = self._expire(req)
                req.lock.release()
            if stuck:  # its poster stuck (maybe the progress thread itself)
                self._abandon(req)
            elif end is not None:
                end()
            return True
        advance = req.advance
        if advance is not None and not (req.posted and req.granted) and not req.finished:
            advance(block)
            if not req.granted and not req.finished:
                return None
        if not req.posted or not req.granted:
            return False
        group = req.group  # let go of once it completes (``_complete``)
        landed = self._poll_free(req)
        if group and (landed or req.finished):
            self._poll_group(group, req if landed else None)
        elif landed:
            self._succeed(req, Event.LANDED)
        return True

    def _poll_group(self, group: list[_Request], first: _Request | None = None) -> None:
        """A request of a step's shared job landed (``first``, polled already) or completed: poll
        the step's others that may complete (granted, posted, live, nobody posting, not polled by
        another thread right now) and complete those whose bytes are in, with ``first``, together
        (``_succeed_many``)."""
        landed = [other for other in group if other is not first and other.phase is Phase.CLEARED
                  and self._poll_free(other)]
        if first is not None:
            landed.insert(0, first)
        if landed:
            self._succeed_many(landed)

    def _expire(self, req: _Request) -> Callable[[], None] | None:
        """``req`` (its lock held, nobody posting) is past its deadline and the grace: fail it if
        it is still live and drain it now (its blocks quarantined until what moves has ended).
        Returns what fails the handle, to run once the lock is released. The progress pass does
        the same; a waiter does it too, so that no handle outlives its deadline for want of a
        pass (``done``, ``wait``, ``status`` all poll)."""
        if req.finished:
            return None
        if req.error is None and req.posted:  # one last poll says why (or that it landed in time)
            try:
                if self._poll(req):
                    return partial(self._succeed, req, Event.LANDED)
            except KvxferError as exc:
                self._fail(req, exc)
        if req.error is None:
            self._fail(req, TransferTimeoutError(
                f"request {req.handle.request_id!r}: its deadline passed before it completed"))
        return self._drain(req, force=True)

    def _poll_free(self, req: _Request) -> bool:
        """Poll ``req`` once unless another thread holds it, it ended or failed, or a poster is
        inside; True when it landed granted (the caller succeeds it with no lock held)."""
        if not req.lock.acquire(blocking=False):
            return False
        try:
            if req.finished or req.error is not None or self._closed or req.posters:
                return False
            try:
                return self._poll(req)
            except KvxferError as exc:
                self._fail(req, exc)
            except Exception:  # noqa: BLE001 - the progress thread meets it again and logs it
                pass
            return False
        finally:
            req.lock.release()

    def peers_in_use(self) -> set[str]:
        """Backend names of the peers a request in flight or quarantined has parts with."""
        with self._lock:
            reqs = list(self._requests.values()) + list(self._quarantine.values())
        return {part.peer for req in reqs for part in req.parts}

    def moving(self) -> int:
        """How the progress loop should poll: 2 while a posted request has a backend transfer
        (UCX moves host-memory data inside the polls: spin), 1 while only jobs that move their
        own bytes are in flight (a kernel, a pipeline thread: poll soon, without holding the
        interpreter from the threads launching them), 0 when nothing moves."""
        return self.driver_view(leave_fresh=False)[0]

    def driver_view(self, leave_fresh: bool = True) -> tuple[int, float]:
        """``moving()`` for the background driver: the level, counting only requests it polls
        (``leave_fresh``: not those left to their caller, see ``CALLER_GRACE``), and the seconds
        until the first such request falls to it (0.0: none is left to a caller)."""
        with self._lock:
            requests = list(self._requests.values())
            if self._quarantine:
                return 2, 0.0
        level, fresh = 0, 0.0
        if leave_fresh:
            now = time.monotonic()
            left = [req.fresh_until - now for req in requests if _fresh(req, now)]
            if left:
                fresh = min(left)
                requests = [req for req in requests if not _fresh(req, now)]
        return self._level(requests), fresh

    @staticmethod
    def _level(requests: list[_Request]) -> int:
        level = 0
        groups: dict[int, bool] = {}
        for req in requests:
            if req.advance is not None and not req.granted and not req.finished:
                level = max(level, 1)  # a claim's answer to take: look again soon
            if not req.parts or req.finished or _watched(req, groups):
                continue  # nothing attached yet (or any more) to poll
            for part in req.parts:
                if getattr(part.job, "moves_itself", False):
                    level = 1
                else:
                    return 2
        return level

    def _poll(self, req: _Request) -> bool:
        """Poll ``req``'s parts (its lock held). True: every part landed in its window and it is
        granted: the caller succeeds it (``_succeed``) once the lock is released."""
        succeed, all_done = False, True
        for part in req.parts:
            if not part.done:
                if part.job.poll():
                    part.done = True
                else:
                    all_done = False
        seen = self._clock.now()  # every DONE above was observed before this instant
        if all_done:
            if req.all_done_at is None:
                req.all_done_at = seen
            if req.deadline is not None and req.all_done_at > req.deadline:
                raise TransferTimeoutError(
                    f"request {req.handle.request_id!r} completed {req.all_done_at - req.deadline:.3f} s after "
                    "its window closed; the producer may have reused its blocks meanwhile")
            if req.phase is not Phase.MOVED:
                succeed = self._landed(req)  # the bytes may have landed before the grant: success only after it
            if req.phase is Phase.MOVED and req.deadline is not None and seen >= req.deadline:
                raise TransferTimeoutError(
                    f"request {req.handle.request_id!r}: its producers had not granted the claim when its "
                    "deadline passed")
        elif req.deadline is not None and seen >= req.deadline:
            raise TransferTimeoutError(
                f"request {req.handle.request_id!r}: {sum(p.done for p in req.parts)} of "
                f"{len(req.parts)} parts complete when its deadline passed"
            )
        return succeed

    def _landed(self, req: _Request) -> bool:
        """Every part of ``req`` is done inside its window: True if it is granted (the caller
        succeeds it, with no lock held), else it waits for its grant (MOVED)."""
        if req.phase is Phase.CLEARED:
            return True  # granted: its success checks the phase again, under the lock (``_succeed``)
        with self._lock:
            if not lifecycle.live(req.phase):
                return False
            granted = req.phase is Phase.CLEARED
            if not granted:
                req.move(Event.LANDED)
        return granted

    def _succeed(self, req: _Request, event: Event) -> None:
        """``req`` moves to DONE by ``event`` (CLEARED landed, or MOVED granted) and its handle
        completes here: notices, ``on_success``, then the handle's callbacks. A read by hold token
        is first checked (``verify``: the look at the producer's hold word, after every part's
        DONE); a mismatch fails it instead."""
        if not self._proven(req):
            return
        with self._lock:
            if not lifecycle.live(req.phase):
                return
            req.move(event)
            self._forget(req)
        self._complete(req)

    def _succeed_many(self, reqs: list[_Request]) -> None:
        """``_succeed`` (by LANDED: each granted, every part done) for a step's requests at once:
        each is checked as ``_succeed`` checks it, then all move to DONE under one hold of the
        engine's lock, then each handle completes."""
        proven = self._proven_many(reqs)
        done = []
        with self._lock:
            for req in proven:
                if lifecycle.live(req.phase):
                    req.move(Event.LANDED)
                    self._forget(req)
                    done.append(req)
        for req in done:
            self._tell_done(req)
        self._end_handles([(req, req.stats, None) for req in done])

    def _proven(self, req: _Request) -> bool:
        """Whether ``req`` may succeed now: True unless it reads by hold token and its look at the
        producer's word failed it (a mismatch, or no answer by its deadline) or is still out."""
        if req.verify is None or not lifecycle.live(req.phase):
            return True
        error = req.verify()  # after every part's DONE: the look that proves the hold covered the move
        if error is LOOKING:
            if req.deadline is None or self._clock.now() < req.deadline:
                return False  # its look is out: the request's next poll asks again
            error = TransferTimeoutError(
                f"request {req.handle.request_id!r}: its bytes moved, but the look at the producer's hold "
                "word had not come back when its deadline passed (the hold is not proven)")
        if error is None:
            return True
        self._fail(req, error)
        self._wake()
        return False

    def _proven_many(self, reqs: list[_Request]) -> list[_Request]:
        """Those of ``reqs`` that may succeed now (``_proven``). Where every look is one a batch
        can take (``verify.many``: the same table on this host), they are taken together."""
        looks = [req for req in reqs if req.verify is not None and lifecycle.live(req.phase)]
        many = getattr(looks[0].verify, "many", None) if len(looks) > 1 else None
        results = many([req.verify for req in looks]) if many is not None else None
        if results is None:
            return [req for req in reqs if self._proven(req)]
        failed = set()
        for req, error in zip(looks, results):
            if error is not None:  # never LOOKING: a batch's looks are loads on this host
                failed.add(id(req))
                self._fail(req, error)
        if failed:
            self._wake()
        return [req for req in reqs if id(req) not in failed]

    def _complete(self, req: _Request) -> None:
        """Complete the handle of ``req``, which has just left the table as DONE."""
        self._tell_done(req)
        self._end_handles([(req, req.stats, None)])

    def _tell_done(self, req: _Request) -> None:
        """What a request that has left the table as DONE does before its handle completes: its
        stats' time, its completion notices, ``on_success``."""
        req.stats.seconds = time.perf_counter() - req.started
        # The request has left the table: nothing below may stop its handle from completing. A
        # notice that cannot be sent (the producer died after the bytes arrived) is logged; the
        # producer's lease then ends the hold.
        for part in req.parts:  # completion notices go only once the read is known good
            try:
                if part.on_done is not None:
                    part.on_done()
                elif part.notification and not getattr(part.job, "notifies", False):
                    self._backend.notify(part.peer, part.notification)
            except Exception as exc:  # noqa: BLE001 - the read succeeded; only its notice failed
                log.warning("request %r: done notice to %s not sent (its lease will end the hold): %s",
                            req.handle.request_id, part.peer, exc)
        if req.on_success is not None:
            try:
                req.on_success()
            except Exception:  # noqa: BLE001
                log.exception("request %r: on_success raised", req.handle.request_id)

    @staticmethod
    def _end_handles(items: list[tuple[_Request, TransferStats | None, KvxferError | None]]) -> None:
        """Complete the handles of ``(request, stats, error)`` items: every handle first (its
        waiters pass), then each distinct ``on_end`` once with its requests' handles, then each
        handle's own done-callbacks, in order; then each request lets go of its step
        (``_let_go``), whichever way it ended. Called with no lock held."""
        ended = []
        for req, stats, error in items:
            callbacks = req.handle._end(stats=stats, error=error)
            if callbacks is not None:
                ended.append((req.handle, callbacks, req.on_end))
        hooks: dict[int, tuple] = {}
        for handle, _, on_end in ended:
            if on_end is not None:
                hooks.setdefault(id(on_end), (on_end, []))[1].append(handle)
        for on_end, handles in hooks.values():
            try:
                on_end(handles)
            except Exception:  # noqa: BLE001 - the handles are complete: their callbacks still run
                log.exception("the end of %d request(s) could not be reported", len(handles))
        for handle, callbacks, _ in ended:
            for cb in callbacks:
                handle._run_callback(cb)
        for req, _, _ in items:
            _let_go(req)

    def _forget(self, req: _Request) -> None:
        """Take ``req`` out of the table of requests in flight (the caller holds the engine's
        lock): by identity, so that a request that ended and was seen late never takes out a
        newer request of the same id."""
        rid = req.handle.request_id
        if self._requests.get(rid) is req:
            del self._requests[rid]

    def _overdue(self, req: _Request) -> bool:
        """Past its deadline and the drain's grace, and not ended: nothing may hold its handle any longer."""
        return (req.deadline is not None and not req.finished
                and self._clock.now() >= req.deadline + self._grace)

    def _orphaned(self, req: _Request) -> None:
        """``req`` ended but its handle is still pending. The thread that ended it completes the
        handle a moment later (microseconds); only if that was lost (an engine bug, or a call on
        that thread that does not return) is the handle still pending ``ORPHAN_GRACE`` after a
        poll first saw it so: it completes here then, with the request's outcome, and the loss
        is logged. No handle stays pending whatever the engine's threads did."""
        if req.handle._finished:
            return
        now = self._clock.now()
        if req.orphan_seen is None:
            req.orphan_seen = now  # the thread that ended it may be completing it right now
            return
        if now < req.orphan_seen + ORPHAN_GRACE:
            return
        log.error("kvxfer engine: request %r ended (%s) without completing its handle; completed now",
                  req.handle.request_id, req.phase.value)
        if req.phase is Phase.DONE:
            self._end_handles([(req, req.stats, None)])
        else:
            error = req.error or TransferFailedError(f"request {req.handle.request_id!r} failed")
            self._end_handles([(req, None, error)])

    def _abandon(self, req: _Request) -> None:
        """``req``'s poster has held it past its deadline and the drain's grace (a backend call
        that does not return): its handle fails now with its blocks quarantined, and whatever
        the poster attaches afterwards is confirmed ended before they come back (``attach``,
        the quarantine sweep). The deadline promise holds whatever the backend does."""
        rid = req.handle.request_id
        _give_up_look(req)
        with self._lock:
            if req.finished:
                return
            if lifecycle.live(req.phase):
                req.move(Event.FAIL)
                req.error = TransferTimeoutError(
                    f"request {rid!r}: its deadline passed while its transfer was still being posted "
                    "(the transport's call had not returned)")
            req.move(Event.GIVE_UP)
            self._forget(req)
            self._quarantine[rid] = req
            req.error = error = _quarantine_error(req.error, req.blocks.tolist())
        self._end_handles([(req, None, error)])

    def _fail(self, req: _Request, error: KvxferError) -> bool:
        """Mark ``req`` failed; it drains from the next progress step. False if it already ended."""
        with self._lock:
            if not lifecycle.live(req.phase):
                return False
            req.move(Event.FAIL)
            req.error = error
            now = self._clock.now()
            req.drain_until = max(now, req.deadline if req.deadline is not None else now) + self._grace
        return True

    def _drain(self, req: _Request, force: bool = False) -> Callable[[], None] | None:
        """End a failed request: its handle fails once every transfer ended, or at ``drain_until``
        (at once with ``force``) with its blocks quarantined until they do. Returns what fails
        the handle, for the caller to run once it has let go of the request's lock (or None)."""
        ended = self._end_parts(req, wait=False)
        if not ended and not force and self._clock.now() < req.drain_until:
            return None
        _give_up_look(req)
        with self._lock:
            if req.finished:
                return None
            self._forget(req)
            req.move(Event.ENDED if ended else Event.GIVE_UP)
            if not ended:
                self._quarantine[req.handle.request_id] = req
                req.error = _quarantine_error(req.error, req.blocks.tolist())
        error = req.error
        return partial(self._end_handles, [(req, None, error)])

    def _end_parts(self, req: _Request, wait: bool) -> bool:
        """Cancel every job of ``req``; True once none can write any more.

        A backend transfer's job confirms only once the backend reports it DONE or FAILED
        (releasing a pending one does not stop its bytes). ``wait``: poll until ended or the
        grace passes (posting errors)."""
        until = self._clock.now() + self._grace
        while True:
            ended = True
            for part in req.parts:
                if part.job is not None and not part.ended:
                    part.ended = bool(part.job.cancel())
                    ended = ended and part.ended
            if ended or not wait or self._clock.now() >= until:
                return ended
            self._clock.sleep(0.0005)

    # ---- cancellation ------------------------------------------------------------
    def cancel(self, request_id: str, error: KvxferError) -> bool:
        """Fail an in-flight request with ``error``; returns False if none was in flight.

        The handle completes once the request's transfers have ended (see the module doc)."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            return False
        return self._fail(req, error)

    def close(self) -> None:
        """Fail everything in flight with ClosedError, waiting up to the grace for transfers
        to end. Idempotent."""
        self._closed = True
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            self._fail(req, ClosedError(f"agent closed while request {req.handle.request_id!r} was in flight"))
        for req in requests:
            self._end_parts(req, wait=True)
            end = self._drain(req, force=True)
            if end is not None:
                end()
