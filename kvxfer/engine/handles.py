"""Per-request transfer handles: done / wait / await (layer: engine; no nixl, zmq or torch)."""

from __future__ import annotations

import asyncio
import logging
import numbers
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from kvxfer.errors import ConfigError, KvxferError, WaitTimeout

__all__ = ["TransferHandle", "TransferStats", "owned_handle"]

# How long ``wait`` polls the request itself, once it is posted and granted, before it sleeps on
# the engine's progress thread: long enough to cover a small request's copy, short enough that a
# long transfer's waiter does not take a core from the threads moving it.
SPIN_SECONDS = 0.002

# How long one look at a request whose grant is pending may wait for its claim's answer: the
# waiter sleeps in the socket's poll (the interpreter is free meanwhile) and wakes on the answer.
CLAIM_SLICE = 0.02

log = logging.getLogger("kvxfer")


@dataclass
class TransferStats:
    """What one request moved, and how long it took. Bytes are payload bytes; every time is in
    seconds of wall time (``time.perf_counter``); GB means 10**9 bytes.

    ``total_seconds``: from the ``read``/``write`` call to the completion its caller could
    observe, everything included (handshake, claim, post, the transfer): what the request cost
    the engine. ``setup_seconds``: from the call until the transfer was posted (checking ids,
    choosing the path, the producers' claim round trips, tables, kernel launches; on host
    memory UCX may also move data inside the post). ``claim_seconds``: from sending the claims
    to having every answer (work done meanwhile, such as a kernel launch, overlaps it).
    ``seconds``: from the post to completion; it leaves out whatever moved before the post (an
    IPC kernel launched while the claim travelled), so it can be far below the data movement's
    real time: compute bandwidth from ``total_seconds`` (``gb_per_s``).
    """

    request_id: str
    num_bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    mode: str = "direct"          # a TransferPath value: direct, host-staged, staged or ipc
    peers: int = 0
    setup_seconds: float = 0.0
    claim_seconds: float = 0.0
    total_seconds: float = 0.0    # 0 until the handle completes; then >= setup_seconds + seconds
    by_token: bool = False        # proved its hold by the producer's hold token, with no claim (issue 35)

    @property
    def gb_per_s(self) -> float:
        """Payload GB (10**9 bytes) per second of ``total_seconds``: the rate the caller got."""
        return self.num_bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Deprecated: ``gb_per_s`` (GB/s, not Gbit/s; from ``total_seconds``)."""
        warnings.warn("TransferStats.gbps is GB/s and deprecated; use gb_per_s", DeprecationWarning, stacklevel=2)
        return self.gb_per_s


class TransferHandle:
    """One request's transfer, possibly spread over several peer ranks.

    Completed exactly once, with stats or an error: by the engine's progress thread, or by a
    waiter's own poll (``wait`` and ``done`` poll the request once it is posted, so a request
    that already finished completes without a hand-over between threads).
    ``wait`` and ``await`` re-raise the error; ``done`` never raises.

    Threads: every method may be called from any thread. Done-callbacks run on the thread that
    completes the handle (the agent's progress thread, or a thread inside ``done``/``wait``/
    ``await``, possibly one polling another request of the same step: see
    ``TransferEngine._poke``), or at once on the caller's thread in ``add_done_callback`` when it
    is already complete; keep them short and non-blocking. A callback that raises is logged (logger
    ``kvxfer``, with its traceback) and the later callbacks run anyway.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._poke: Callable[..., bool | None] | None = None  # polls this request once (set by the engine)
        self._error: KvxferError | None = None
        self._stats: TransferStats | None = None
        self._lock = threading.Lock()
        self._callbacks: list = []
        # A step makes a handle per request: plain locks here, not threading.Event/Condition (a
        # pure-Python object costing several times a lock to make). ``_finished`` is the state;
        # ``_latch``, held from birth to completion, is what waiters block on.
        self._finished = False
        self._latch = threading.Lock()
        self._latch.acquire()
        # ``_nudge`` wakes waiters when the request may have become pollable (posted, granted);
        # the condition is made by the first waiter that needs it
        self._moved: threading.Condition | None = None
        self._generation = 0
        # Waiters polling the request themselves now (``wait``): the progress thread leaves a
        # kernel's or pipeline's request to them, so two threads do not take turns on the
        # interpreter to watch one event; ``_unwatched`` (set by the engine) is called when the
        # last one stops.
        self._watched = 0
        self._unwatched: Callable[[], None] | None = None
        # Hands the request to the background driver at once (set by the engine): a caller that
        # awaits the handle or adds a done-callback says it will not poll, so the driver does
        # not leave the request to it first (``kvxfer.engine.transfers.CALLER_GRACE``).
        self._hand_over: Callable[[], None] | None = None

    # ---- engine side -----------------------------------------------------------
    def _finish(self, stats: TransferStats | None = None, error: KvxferError | None = None) -> bool:
        """Complete the handle; returns False if it was already complete."""
        callbacks = self._end(stats, error)
        if callbacks is None:
            return False
        for cb in callbacks:
            self._run_callback(cb)
        return True

    def _end(self, stats: TransferStats | None = None, error: KvxferError | None = None) -> list | None:
        """``_finish`` without running the done-callbacks: the handle is complete (waiters pass)
        when this returns its callbacks, for the caller to run (``_run_callback``) once it has
        done what must come first (``TransferEngine``: the agent's reports); None if it was
        already complete."""
        with self._lock:
            if self._finished:
                return None
            if stats is not None and not stats.total_seconds:
                # The call began setup_seconds before the post, and the post seconds before now.
                stats.total_seconds = stats.setup_seconds + stats.seconds
            self._stats, self._error = stats, error
            self._poke = self._hand_over = None
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
            self._generation += 1
            if self._moved is not None:
                self._moved.notify_all()
        self._latch.release()  # every waiter passes it on (``_wait_latch``)
        return callbacks

    def _nudge(self) -> None:
        """The engine moved the request on (posted, granted or ended): waiters look again."""
        with self._lock:
            self._generation += 1
            if self._moved is not None:
                self._moved.notify_all()

    def _wait_latch(self, timeout: float | None) -> bool:
        """Block until complete, at most ``timeout`` seconds; True once complete."""
        if self._finished:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else min(max(timeout, 0.0), threading.TIMEOUT_MAX)):
            return self._finished
        self._latch.release()  # the next waiter may pass too
        return True

    def _run_callback(self, fn) -> None:
        """Run one done-callback; an error in it is the callback's bug, not the transfer's: log it."""
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - every later callback (the agent's own reports) must still run
            log.exception("done-callback %r of request %r raised; the later callbacks run anyway",
                          fn, self.request_id)

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` once on completion: on the completing thread, or at once on this
        thread if the handle is already complete. Callbacks run in the order they were added; one
        that raises is logged (logger ``kvxfer``) and does not stop the others. Raises only
        ConfigError, at once, when ``fn`` is not callable."""
        if not callable(fn):
            raise ConfigError(f"a done-callback must be callable; got {fn!r}")
        if not self._add_callback(fn):
            hand_over = self._hand_over
            if hand_over is not None:
                hand_over()

    def _add_callback(self, fn) -> bool:
        """``add_done_callback`` without the hand-over (kvxfer's own callbacks); True when the
        handle was complete and ``fn`` ran here."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                return False
        self._run_callback(fn)
        return True

    # ---- user side ---------------------------------------------------------------
    def done(self) -> bool:
        """Whether the transfer ended (either way); polls the request once. Never blocks long, never raises."""
        poke = self._poke
        if poke is not None and not self._finished:
            poke()
        return self._finished

    def exception(self) -> KvxferError | None:
        """The error the transfer ended with, or None (also None while still running)."""
        return self._error

    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until complete, at most ``timeout`` seconds (None: until the transfer's own
        deadline ends it); return the stats or raise the transfer's error.

        Raises:
            WaitTimeout: ``timeout`` seconds passed first. Only the wait ended: the transfer goes
                on (``done()`` is False, its destination blocks are still in flight) and ends by
                its own deadline. Wait again, or ``Agent.abort`` it.
            TransferError (a subclass): the transfer failed; ``TransferTimeoutError`` when its
                own deadline passed. ``ClosedError`` when the agent was closed under it.
            ConfigError: ``timeout`` is neither None nor a number (0 or less: one look, no wait).
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or timeout != timeout):
            raise ConfigError(f"wait's timeout must be a number of seconds or None; got {timeout!r}")
        end = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        spin_until = None
        try:
            while not self._finished:
                poke = self._poke
                if poke is None:
                    break
                generation = self._generation
                # poke() drives a request whose grant is pending on this thread (None: it waited
                # up to CLAIM_SLICE for the claim's answer, look again); it is False while only
                # another thread can move the request on (a lane claiming it): sleep until the
                # engine moves it; once it may complete, poll it here for a moment: completing
                # it on this thread saves waking this one from another.
                now = time.monotonic()
                pollable = poke(CLAIM_SLICE if end is None else min(CLAIM_SLICE, max(end - now, 0.0)))
                now = time.monotonic()
                if self._finished or (end is not None and now >= end):
                    break
                if pollable is None:
                    continue
                if pollable is False:
                    with self._lock:
                        if self._moved is None:
                            self._moved = threading.Condition(self._lock)
                        if self._generation == generation and not self._finished:
                            self._moved.wait(None if end is None else end - now)
                    continue
                if spin_until is None:
                    spin_until = now + SPIN_SECONDS
                    with self._lock:
                        self._watched += 1
                if now >= spin_until:
                    break
                time.sleep(0)
        finally:
            poke = None  # the poll (it holds the engine's request): no frame of a raise keeps it
            if spin_until is not None:
                with self._lock:
                    self._watched -= 1
                    hand_back = not self._watched and not self._finished
                unwatched = self._unwatched
                if hand_back and unwatched is not None:
                    unwatched()  # the progress thread polls it again from now on
        left = None if end is None else max(0.0, end - time.monotonic())
        if not self._wait_latch(left):
            raise WaitTimeout(f"request {self.request_id!r} not complete within {timeout} s (only the wait ran "
                              "out: the transfer goes on until its own deadline)",
                              request_id=self.request_id, timeout=timeout)
        if self._error is not None:
            # Raised afresh each time: the traceback starts here, so repeated waits do not grow it,
            # and frames of kvxfer's own threads that met the error (which may refer back to the
            # request) are let go. This frame lets go of the handle, which keeps the error, so a
            # failed read is no cycle left to the interpreter's collector once its caller drops the
            # handle (as ``concurrent.futures`` does).
            error, self = self._error.with_traceback(None), None
            try:
                raise error
            finally:
                error = None  # nor the error itself (error -> traceback -> this frame -> error)
        assert self._stats is not None  # set together with the event (internal invariant)
        return self._stats

    def __await__(self):
        if self.done():  # polls the request once: a finished one needs no trip through the loop

            if self._error is not None:
                error, self = self._error.with_traceback(None), None  # as in ``wait``
                try:
                    raise error
                finally:
                    error = None
            return self._stats
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def resolve(_: "TransferHandle") -> None:
            loop.call_soon_threadsafe(_settle, future, self)

        self.add_done_callback(resolve)  # hands the request to the driver: the loop does not poll
        return (yield from future.__await__())

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"<TransferHandle {self.request_id!r} {state}>"


def _settle(future: asyncio.Future, handle: TransferHandle) -> None:
    if future.done():
        return
    if handle._error is not None:
        future.set_exception(handle._error)
    else:
        future.set_result(handle._stats)


def owned_handle(request_id: str) -> tuple[TransferHandle, Callable[..., bool]]:
    """A handle that its maker completes itself (a push stream's, ``kvxfer.agent.streams``), not
    the engine: the handle, and the one call that completes it (``finish(stats)`` or
    ``finish(error=...)``; False when it was already complete)."""
    handle = TransferHandle(request_id)
    return handle, handle._finish
