"""What finished since the user last asked, and what the agent holds now (layer: agent)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvxfer.errors import KvxferError
from kvxfer.types import ReleaseReason, RequestState

__all__ = ["AgentStats", "Finished", "Reports", "STATUS_MEMORY"]


@dataclass
class Finished:
    """What completed since the last ``Agent.finished()`` call (each request once, in one set).

    Producer holds, listed only once their blocks are really free (no consumer's transfer
    window is open any more): only then may the engine reuse them.
    ``sent``: every consumer reported done. ``aborted``: ended by ``release`` or a consumer's
    ``abort``. ``expired``: ended by the lease, or by a claim window that passed without the
    consumer's done (nothing else). ``freed`` is the three together.

    Consumer requests: ``received``: the blocks arrived (reads, or every expected write, see
    ``Agent.expect_writes``). ``failed``: the request failed, with the error; its destination
    blocks are the engine's again unless ``error.quarantined_blocks`` lists them.
    ``reclaimed``: failed requests whose destination blocks were quarantined (the transfer was
    not confirmed ended when it failed) and are free again now.
    """

    sent: set[str] = field(default_factory=set)
    expired: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: dict[str, KvxferError] = field(default_factory=dict)
    reclaimed: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)

    @property
    def freed(self) -> set[str]:
        """Producer requests whose blocks the engine may reuse now: ``sent | aborted | expired``."""
        return self.sent | self.aborted | self.expired

    def reason(self, request_id: str) -> ReleaseReason | None:
        """Why the hold of ``request_id`` ended (``ReleaseReason``), or None if it is not in ``freed``."""
        for reason, ids in ((ReleaseReason.SENT, self.sent), (ReleaseReason.ABORTED, self.aborted),
                            (ReleaseReason.EXPIRED, self.expired)):
            if request_id in ids:
                return reason
        return None


@dataclass(frozen=True)
class AgentStats:
    """What an agent holds right now (``Agent.stats()``); all zero on an idle agent.

    Producer: ``held_requests``/``held_blocks`` (not yet free), ``claimed_requests`` (inside a
    consumer's transfer window), ``ending_requests`` (released, aborted or expired, waiting for
    a window to close). Consumer: ``in_flight`` (reads and writes not ended, draining included),
    ``draining`` (failed, waiting for their transfers to end), ``quarantined_blocks`` (destination
    blocks of failed reads not confirmed ended: do not reuse them until ``finished().reclaimed``).
    Side channel: ``sessions`` (handshaken consumers), ``express_lanes`` (those of them whose
    requests come on an express lane) and ``rejected_frames`` by reason.
    """

    held_requests: int = 0
    held_blocks: int = 0
    claimed_requests: int = 0
    ending_requests: int = 0
    in_flight: int = 0
    draining: int = 0
    quarantined_blocks: int = 0
    sessions: int = 0
    rejected_frames: dict[str, int] = field(default_factory=dict)
    express_lanes: int = 0


#: How many ended requests ``Agent.status`` remembers (the oldest is forgotten first).
STATUS_MEMORY = 10_000


class Reports:
    """Thread-safe accumulation of ``Finished`` sets, drained by the user, and the last state of
    the most recent ``STATUS_MEMORY`` ended requests, which nothing drains (``Agent.status``)."""

    def __init__(self, memory: int = STATUS_MEMORY) -> None:
        self._lock = threading.Lock()
        self._current = Finished()
        self._expected_writes: dict[str, tuple[int, int]] = {}  # request -> (producers, writes each)
        self._writes: dict[str, dict[str, int]] = {}             # request -> producer engine -> writes
        self._ended: OrderedDict[str, RequestState] = OrderedDict()
        self._memory = memory

    def _remember(self, request_id: str, state: RequestState) -> None:
        """Record an ended request's state (caller holds the lock); forget the oldest past the cap."""
        self._ended.pop(request_id, None)
        self._ended[request_id] = state
        while len(self._ended) > self._memory:
            self._ended.popitem(last=False)

    def ended(self, request_id: str) -> RequestState | None:
        """The last state recorded for an ended request, or None (never ended here, or forgotten)."""
        with self._lock:
            return self._ended.get(request_id)

    def forget(self, request_id: str) -> None:
        """A request starts again under the same id: its old end is no longer its state."""
        with self._lock:
            self._ended.pop(request_id, None)

    def read_done(self, handle) -> None:
        """A consumer read completed (with or without an error)."""
        error = handle.exception()
        with self._lock:
            if error is None:
                self._current.received.add(handle.request_id)
                self._remember(handle.request_id, RequestState.RECEIVED)
            else:
                self._current.failed[handle.request_id] = error
                quarantined = getattr(error, "quarantined_blocks", None)
                self._remember(handle.request_id, RequestState.QUARANTINED if quarantined else RequestState.FAILED)

    def released(self, request_id: str, why: str) -> None:
        """A producer hold ended: ``why`` is a ``ReleaseReason`` ("sent", "aborted" or "expired")."""
        reason = ReleaseReason(why)
        with self._lock:
            {ReleaseReason.SENT: self._current.sent, ReleaseReason.ABORTED: self._current.aborted,
             ReleaseReason.EXPIRED: self._current.expired}[reason].add(request_id)
            self._remember(request_id, RequestState(reason.value))

    def reclaimed(self, request_id: str) -> None:
        """A failed read's quarantined blocks are free again."""
        with self._lock:
            self._current.reclaimed.add(request_id)
            self._remember(request_id, RequestState.RECLAIMED)

    def expect_writes(self, request_id: str, producers: int = 1, writes: int = 1) -> None:
        """``request_id`` is received once each of ``producers`` producer engines has completed
        ``writes`` writes into this agent (see ``Agent.expect_writes``)."""
        with self._lock:
            self._expected_writes[request_id] = (producers, writes)
            self._ended.pop(request_id, None)

    def write_arrived(self, request_id: str, producer: str) -> None:
        """One write of ``request_id`` by ``producer`` (an engine id) completed here; the request is
        received once every expected producer completed every expected write."""
        with self._lock:
            producers, writes = self._expected_writes.get(request_id, (1, 1))
            counts = self._writes.setdefault(request_id, {})
            counts[producer] = counts.get(producer, 0) + 1
            if sum(1 for n in counts.values() if n >= writes) < producers:
                self._remember(request_id, RequestState.IN_FLIGHT)
                return
            del self._writes[request_id]
            self._expected_writes.pop(request_id, None)
            self._current.received.add(request_id)
            self._remember(request_id, RequestState.RECEIVED)

    def drain(self) -> Finished:
        with self._lock:
            out, self._current = self._current, Finished()
        return out
