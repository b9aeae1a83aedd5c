"""One job that moves the bytes of several requests (layer: engine; never nixl, zmq or the agent).

A batch's IPC reads run as one kernel launch; each request owns a *member* of the shared job.
A member is done when the job is; cancelling one member stops nothing the others still need:
it reports ended once the shared job has ended, and the job itself is cancelled only when its
last member lets go. So a request that fails (its claim refused) keeps its destination blocks
in flight until the one move that writes them has ended, and the others carry on.
"""

from __future__ import annotations

import threading
import time

from kvxfer.errors import KvxferError

__all__ = ["SharedJob"]


#: Seconds a not-yet-done shared job's state is reused: one progress pass polls every member, and
#: asking the job (a CUDA event query) once per pass instead of once per member keeps that pass
#: short, so it does not hold the interpreter while the lane is still launching the batch.
POLL_REUSE = 50e-6


class SharedJob:
    """Shares ``job`` (an engine ``Job``) among ``members`` requests; ``member`` makes each share."""

    def __init__(self, job, members: int) -> None:
        self._job, self._left = job, members
        self._done = False
        self._asked = 0.0
        self._error: KvxferError | None = None
        self._ended = False
        self._lock = threading.Lock()
        # what every member says of the job (looked up once, not once a member)
        self.notifies = bool(getattr(job, "notifies", False))
        self.moves_itself = bool(getattr(job, "moves_itself", False))

    def member(self, num_bytes: int, descriptors: int) -> "_Member":
        """One request's share (``num_bytes`` of the job's bytes, for its stats)."""
        return _Member(self, num_bytes, descriptors)

    def poll(self) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            now = time.perf_counter()
            if not self._done and now - self._asked >= POLL_REUSE:
                self._asked = now
                try:
                    self._done = bool(self._job.poll())
                except KvxferError as exc:
                    self._error = exc
                    raise
            return self._done

    def leave(self) -> bool:
        """A member stops; True once the shared job cannot write any more."""
        with self._lock:
            self._left -= 1
            if self._ended or self._done:
                return True
            if self._left <= 0:
                self._ended = bool(self._job.cancel())
                return self._ended
        # Others still want it: this member has ended only once the job has.
        return self.ended()

    def ended(self) -> bool:
        with self._lock:
            if self._ended or self._done:
                return True
            if self._left <= 0:
                self._ended = bool(self._job.cancel())
                return self._ended
            try:
                self._done = bool(self._job.poll())
            except KvxferError as exc:
                self._error = exc
                self._ended = True  # the transport failed it: nothing of it moves any more
            return self._ended or self._done


class _Member:
    """A request's view of a ``SharedJob`` (the engine's ``Job`` interface)."""

    def __init__(self, shared: SharedJob, num_bytes: int, descriptors: int) -> None:
        self._shared, self._left = shared, False
        self.num_bytes, self.descriptors = num_bytes, descriptors
        self.notifies, self.moves_itself = shared.notifies, shared.moves_itself

    def poll(self) -> bool:
        shared = self._shared
        return shared._done or shared.poll()  # once the job is done it stays done: no lock to look

    def cancel(self) -> bool:
        if not self._left:
            self._left = True
            return self._shared.leave()
        return self._shared.ended()
