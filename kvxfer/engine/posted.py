"""The executors the backend moves: a direct transfer, a host-staged one (layer: engine).

May import backend.base, errors, types; never nixl, zmq, torch or the agent. Each is a ``Job``
(``kvxfer.engine.transfers``) built by the engine from a layout plan:

- ``DirectJob`` posts the plan's descriptor rows as one backend transfer; the backend sends the
  part's notification to the peer when it completes.
- ``HostStagedJob`` takes a range of the registered staging buffer (waiting, unposted, while
  the buffer is full), posts the plan into it and, once the bytes landed, unpacks them into the
  cache and frees the range.

``cancel`` never releases a transfer the backend still reports pending: releasing it does not
stop its bytes over every transport (UCX over TCP keeps writing), so it returns False until
the backend says DONE or FAILED, and the engine keeps the request draining meanwhile.
"""

from __future__ import annotations

from typing import Callable

from kvxfer.backend.base import Backend, XferId
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import ClosedError, KvxferError, PeerLostError, TransferFailedError
from kvxfer.types import Direction, MemKind, XferState

__all__ = ["DirectJob", "HostStagedJob", "StagingBuffer"]


class DirectJob:
    """One backend transfer of a plan's rows, posted at construction.

    Raises (constructor): whatever ``backend.post`` raises; nothing stays posted then.
    """

    notifies = True  # the backend delivers the part's notification with the transfer

    def __init__(self, backend: Backend, direction: Direction, plan, local_kind: MemKind, peer: str,
                 remote_kind: MemKind, notification: bytes, label: str) -> None:
        self._backend, self._direction, self.plan = backend, direction, plan
        self._kind, self.peer, self._remote_kind = local_kind, peer, remote_kind
        self._note, self._label = notification, label
        self.num_bytes, self.descriptors = int(plan.num_bytes), int(plan.local.shape[0])
        self._xfer: XferId | None = None
        self._start(plan.local)

    def _start(self, local) -> None:
        lists = getattr(self.plan, "lists", None)
        if lists is not None:  # indices into prepared lists (``kvxfer.engine.paths.prepared``)
            self._xfer = self._backend.post_prepared(self._direction, lists.local_id, local, lists.remote_id,
                                                     self.plan.remote, self.peer, self._note)
            return
        self._xfer = self._backend.post(self._direction, local, self._kind, self.plan.remote,
                                        self._remote_kind, self.peer, self._note)

    def _state(self) -> XferState:
        return self._backend.state(self._xfer)

    def poll(self) -> bool:
        if self._xfer is None:
            return True
        state = self._state()
        if state is XferState.PENDING:
            return False
        if state is XferState.FAILED:
            raise self._failure()
        self._backend.release(self._xfer)
        self._xfer = None
        self._landed()
        return True

    def _landed(self) -> None:
        """The bytes are in place (a staged job unpacks here)."""

    def _failure(self) -> KvxferError:
        """The error for a FAILED transfer, chaining the backend's reason (a lost peer stays PeerLostError)."""
        why = getattr(self._backend, "failure", lambda x: None)(self._xfer)
        cls = PeerLostError if isinstance(why, PeerLostError) else TransferFailedError
        err = cls(f"{self._label}: transfer with peer {self.peer!r} failed" + (f": {why}" if why is not None else ""))
        err.__cause__ = why
        return err

    def cancel(self) -> bool:
        """Release the transfer once the backend reports it ended; False while it is still pending."""
        if self._xfer is not None:
            try:
                state = self._state()
            except ClosedError:
                state = XferState.FAILED  # the backend is gone: nothing moves any more
            except KvxferError:
                state = XferState.PENDING
            if state is XferState.PENDING:
                return False
            try:
                self._backend.release(self._xfer)
            except KvxferError:
                pass  # ended already; releasing is bookkeeping
            self._xfer = None
        self._ended()
        return True

    def _ended(self) -> None:
        """Nothing this job started can write any more (a staged job frees its range here)."""


class StagingBuffer:
    """The registered host buffer staged parts land in: its address, allocator and unpack step.

    ``unpack(plan, address)`` moves a landed part from ``address`` into the cache.
    """

    def __init__(self, base: int, allocator: StagingAllocator, unpack: Callable[[object, int], None]) -> None:
        self.base, self.allocator, self.unpack = base, allocator, unpack


class HostStagedJob(DirectJob):
    """A transfer into a staging range, unpacked into the cache once it landed.

    While the staging buffer has no free range large enough the job waits unposted (``poll``
    retries); a part larger than the whole buffer is refused at construction.

    Raises (constructor): TransferFailedError when no staging buffer is registered or the part
    is larger than it; whatever ``backend.post`` raises.
    """

    def __init__(self, backend: Backend, direction: Direction, plan, local_kind: MemKind, peer: str,
                 remote_kind: MemKind, notification: bytes, label: str, area: StagingBuffer | None) -> None:
        if area is None:
            raise TransferFailedError("a staged transfer needs a staging buffer; none is registered")
        if plan.staging_bytes > area.allocator.capacity:
            raise TransferFailedError(f"a staged part needs {plan.staging_bytes} bytes; "
                                      f"the staging buffer holds {area.allocator.capacity}")
        self._area = area
        self._offset: int | None = None
        self.waiting = True
        super().__init__(backend, direction, plan, local_kind, peer, remote_kind, notification, label)

    def _start(self, local) -> None:
        offset = self._area.allocator.allocate(self.plan.staging_bytes)
        if offset is None:
            return  # poll posts it once another part frees a range
        self._offset, self.waiting = offset, False
        shifted = local.copy()
        shifted[:, 0] += self._area.base + offset
        try:
            super()._start(shifted)
        except BaseException:
            self._area.allocator.free(offset)
            self._offset = None
            raise

    def poll(self) -> bool:
        if self.waiting:
            self._start(self.plan.local)
            if self.waiting:
                return False
        return super().poll()

    def _landed(self) -> None:
        self._area.unpack(self.plan, self._area.base + self._offset)
        self._ended()

    def _ended(self) -> None:
        if self._offset is not None:
            self._area.allocator.free(self._offset)
            self._offset = None
        self.waiting = False
