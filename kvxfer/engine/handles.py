"""Per-request transfer handles: done / wait / await (layer: engine; no nixl, zmq or torch)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvxfer.errors import KvxferError, TransferTimeoutError

__all__ = ["TransferHandle", "TransferStats"]

# How long ``wait`` polls the request itself before it sleeps on the engine's progress thread:
# long enough to cover a small request's copy, short enough that a long transfer's waiter
# does not take a core from the threads moving it.
SPIN_SECONDS = 0.002


@dataclass
class TransferStats:
    """What one request moved: payload bytes, descriptors posted, seconds from post to completion.

    ``setup_seconds``: from the call until the transfer was posted (checking ids, choosing the
    path, the producers' claim round trips, tables, kernel launches; on host memory UCX may also
    move data inside the post); ``claim_seconds`` runs from sending the claims to having every
    answer (work done meanwhile, such as a kernel launch, overlaps it); ``seconds`` runs
    from the post to completion.
    """

    request_id: str
    num_bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    mode: str = "direct"          # a TransferPath value: direct, host-staged, staged or ipc
    peers: int = 0
    setup_seconds: float = 0.0
    claim_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferHandle:
    """One request's transfer, possibly spread over several peer ranks.

    Completed exactly once, with stats or an error: by the engine's progress thread, or by a
    waiter's own poll (``wait`` and ``done`` poll the request once it is posted, so a request
    that already finished completes without a hand-over between threads).
    ``wait`` and ``await`` re-raise the error; ``done`` never raises.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._poke: Callable[[], None] | None = None  # polls this request once (set by the engine)
        self._event = threading.Event()
        self._error: KvxferError | None = None
        self._stats: TransferStats | None = None
        self._lock = threading.Lock()
        self._callbacks: list = []

    # ---- engine side -----------------------------------------------------------
    def _finish(self, stats: TransferStats | None = None, error: KvxferError | None = None) -> bool:
        """Complete the handle; returns False if it was already complete."""
        with self._lock:
            if self._event.is_set():
                return False
            self._stats, self._error = stats, error
            self._poke = None
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` on completion (at once if already complete), on the completing thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # ---- user side ---------------------------------------------------------------
    def done(self) -> bool:
        poke = self._poke
        if poke is not None and not self._event.is_set():
            poke()
        return self._event.is_set()

    def exception(self) -> KvxferError | None:
        """The error the transfer ended with, or None (also None while still running)."""
        return self._error

    def wait(self, timeout: float | None = None) -> TransferStats:
        """Block until complete; return the stats or raise the transfer's error.

        Raises:
            TransferTimeoutError: ``timeout`` seconds passed first (the transfer goes on).
        """
        left = timeout
        poke = self._poke
        if poke is not None and not self._event.is_set():
            # Poll the request here for a moment: a small request is usually complete by now,
            # and completing it on this thread saves waking it from the progress thread.
            started = time.monotonic()
            until = started + (SPIN_SECONDS if timeout is None else min(SPIN_SECONDS, max(timeout, 0.0)))
            while True:
                poke()
                if self._event.is_set() or time.monotonic() >= until:
                    break
                time.sleep(0)
            if timeout is not None:
                left = max(0.0, timeout - (time.monotonic() - started))
        if not self._event.wait(left):
            raise TransferTimeoutError(
                f"request {self.request_id!r} not complete within {timeout} s"
            )
        if self._error is not None:
            raise self._error
        assert self._stats is not None  # set together with the event (internal invariant)
        return self._stats

    def __await__(self):
        if self.done():  # polls the request once: a finished one needs no trip through the loop

            if self._error is not None:
                raise self._error
            return self._stats
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def resolve(_: "TransferHandle") -> None:
            loop.call_soon_threadsafe(_settle, future, self)

        self.add_done_callback(resolve)
        return (yield from future.__await__())

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<TransferHandle {self.request_id!r} {state}>"


def _settle(future: asyncio.Future, handle: TransferHandle) -> None:
    if future.done():
        return
    if handle._error is not None:
        future.set_exception(handle._error)
    else:
        future.set_result(handle._stats)
