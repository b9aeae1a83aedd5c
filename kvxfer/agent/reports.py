"""What finished since the user last asked, and what the agent holds now (layer: agent)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvxfer.errors import KvxferError, TransferFailedError, TransferTimeoutError
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


#: A producer hold's end states: a notice of such a request is a late read's, not a write.
_HOLD_ENDED = frozenset({RequestState.SENT, RequestState.ABORTED, RequestState.EXPIRED})

#: How many ended requests ``Agent.status`` remembers (the oldest is forgotten first).
STATUS_MEMORY = 10_000

#: How many received requests' aux payloads wait for ``Agent.take_aux`` (the oldest is dropped first).
_AUX_MEMORY = 1_024

#: How many reports wait for ``Agent.finished()`` at most: an engine that never drains them does
#: not grow without bound; past it the oldest report is dropped (``Agent.status`` still answers
#: for the request) and a warning is logged once per drain.
REPORT_LIMIT = 65_536

log = logging.getLogger("kvxfer.agent")


class Reports:
    """Thread-safe accumulation of ``Finished`` sets, drained by the user, and the last state of
    the most recent ``STATUS_MEMORY`` ended requests, which nothing drains (``Agent.status``)."""

    def __init__(self, memory: int = STATUS_MEMORY, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._current = Finished()
        # request -> (producers, writes each or None: as each producer's WritesDone says, deadline)
        self._expected_writes: dict[str, tuple[int, int | None, float | None]] = {}
        self._writes: dict[str, dict[str, int]] = {}             # request -> producer engine -> writes
        self._finals: dict[str, dict[str, tuple[int, bytes]]] = {}  # request -> producer -> (writes, aux)
        self._aux: OrderedDict[str, dict[str, bytes]] = OrderedDict()  # received, not yet taken
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # consumer aborts: late arrivals dropped
        self._ended: OrderedDict[str, RequestState] = OrderedDict()
        self._memory = memory
        self._clock = clock
        self._order: deque = deque()  # (kind, request id) in the order reported, for REPORT_LIMIT
        self._dropped = 0

    def _report(self, kind: str, request_id: str, error: KvxferError | None = None) -> None:
        """Add one report to the current ``Finished`` (caller holds the lock), dropping the oldest
        past ``REPORT_LIMIT``."""
        current = self._current
        if kind == "failed":
            current.failed[request_id] = error
        else:
            getattr(current, kind).add(request_id)
        self._order.append((kind, request_id))
        while len(self._order) > REPORT_LIMIT:
            old_kind, old = self._order.popleft()
            if old_kind == "failed":
                current.failed.pop(old, None)
            else:
                getattr(current, old_kind).discard(old)
            self._dropped += 1
            if self._dropped == 1:
                log.warning("finished() has not been drained: more than %d reports wait; the oldest are "
                            "dropped (status() still knows them). Call finished() once per step.", REPORT_LIMIT)

    def _remember(self, request_id: str, state: RequestState) -> None:
        """Record an ended request's state (caller holds the lock); forget the oldest past the cap."""
        self._ended.pop(request_id, None)
        self._ended[request_id] = state
        while len(self._ended) > self._memory:
            self._ended.popitem(last=False)

    def ended(self, request_id: str) -> RequestState | None:
        """The last state recorded for an ended request, or None (never ended here, or forgotten)."""
        with self._lock:
            self._sweep()
            return self._ended.get(request_id)

    def forget(self, request_id: str) -> None:
        """A request starts again under the same id: its old end is no longer its state."""
        with self._lock:
            self._ended.pop(request_id, None)

    def reads_done(self, handles: list) -> None:
        """Consumer reads completed (a step's, with or without an error), under one hold of the lock."""
        with self._lock:
            for handle in handles:
                error = handle.exception()
                if error is None:
                    self._report("received", handle.request_id)
                    self._remember(handle.request_id, RequestState.RECEIVED)
                else:
                    self._report("failed", handle.request_id, error)
                    quarantined = getattr(error, "quarantined_blocks", None)
                    self._remember(handle.request_id,
                                   RequestState.QUARANTINED if quarantined else RequestState.FAILED)

    def released(self, request_id: str, why: str) -> None:
        """A producer hold ended: ``why`` is a ``ReleaseReason`` ("sent", "aborted" or "expired")."""
        reason = ReleaseReason(why)
        with self._lock:
            self._report(reason.value, request_id)
            self._remember(request_id, RequestState(reason.value))

    def withdraw(self, request_id: str) -> None:
        """Take back a hold's end not yet drained (``sent``, ``aborted``, ``expired``): a ``replace``
        of the request came right after it ended and stands for it, as a replace of a live hold
        reports nothing."""
        with self._lock:
            for kind in ("sent", "aborted", "expired"):
                ids = getattr(self._current, kind)
                if request_id in ids:
                    ids.discard(request_id)
                    with contextlib.suppress(ValueError):
                        self._order.remove((kind, request_id))
            self._ended.pop(request_id, None)

    def reclaimed(self, request_id: str) -> None:
        """A failed read's quarantined blocks are free again."""
        with self._lock:
            self._report("reclaimed", request_id)
            self._remember(request_id, RequestState.RECLAIMED)

    def expect_writes(self, request_id: str, producers: int = 1, writes: int | None = 1,
                      deadline: float | None = None) -> None:
        """``request_id`` is received once each of ``producers`` producer engines has completed
        ``writes`` writes into this agent (see ``Agent.expect_writes``); ``writes=None``: as many as
        each producer's ``WritesDone`` says, and only once that arrived (the push model). Past
        ``deadline`` (this clock) an incomplete request fails with ``TransferTimeoutError``."""
        with self._lock:
            self._expected_writes[request_id] = (producers, writes, deadline)
            self._writes.pop(request_id, None)
            self._finals.pop(request_id, None)
            self._aux.pop(request_id, None)
            self._cancelled.pop(request_id, None)
            self._ended.pop(request_id, None)
            self._remember(request_id, RequestState.IN_FLIGHT)

    def write_arrived(self, request_id: str, producer: str) -> None:
        """One write of ``request_id`` by ``producer`` (an engine id) completed here; the request is
        received once every expected producer completed every expected write. A notice of a
        request whose hold here ended (sent, aborted, expired) and that expects no writes is a
        late read's done notice: dropped."""
        with self._lock:
            if request_id in self._cancelled:
                return
            if request_id not in self._expected_writes and self._ended.get(request_id) in _HOLD_ENDED:
                # a read's done notice that came after this agent's hold of the request ended (an
                # abort, an expiry): not a write, and the hold's report stands
                log.debug("a done notice of %r after its hold ended (%s): dropped", request_id,
                          self._ended[request_id].value)
                return
            counts = self._writes.setdefault(request_id, {})
            counts[producer] = counts.get(producer, 0) + 1
            self._check_complete(request_id)

    def writes_done(self, request_id: str, producer: str, writes: int, aux: bytes, error: str = "") -> str | None:
        """A producer's ``WritesDone``: it made ``writes`` writes of ``request_id`` here, and ``aux``
        comes with them (``error``: it gave the request up; the request fails). Returns None when
        accepted, else why it is refused (a request this agent does not expect, or aborted)."""
        with self._lock:
            if request_id in self._cancelled:
                return f"request {request_id!r} was aborted by this consumer"
            if request_id not in self._expected_writes:
                state = self._ended.get(request_id)
                return (f"request {request_id!r} is not expected here"
                        + (f" (it is {state.value})" if state is not None else ""))
            if error:
                del self._expected_writes[request_id]
                self._fail_push(request_id, TransferFailedError(
                    f"producer {producer} gave request {request_id!r} up: {error}"))
                return None
            self._finals.setdefault(request_id, {})[producer] = (int(writes), bytes(aux))
            self._check_complete(request_id)
            return None

    def push_failed(self, request_id: str, error: KvxferError) -> None:
        """A pushed request failed before it was received (its announce, or the deadline)."""
        with self._lock:
            if self._expected_writes.pop(request_id, None) is None:
                return
            self._fail_push(request_id, error)

    def cancel(self, request_id: str) -> None:
        """The consumer aborted ``request_id``: forget what it expected; drop late writes of it."""
        with self._lock:
            had = self._expected_writes.pop(request_id, None) is not None
            self._writes.pop(request_id, None)
            self._finals.pop(request_id, None)
            if had:
                self._cancelled[request_id] = None
                while len(self._cancelled) > self._memory:
                    self._cancelled.popitem(last=False)

    def take_aux(self, request_id: str) -> dict[str, bytes]:
        """The aux payloads that came with a received request, by producer engine (taken once)."""
        with self._lock:
            return self._aux.pop(request_id, {})

    def _fail_push(self, request_id: str, error: KvxferError) -> None:  # caller holds the lock
        self._writes.pop(request_id, None)
        self._finals.pop(request_id, None)
        self._report("failed", request_id, error)
        self._remember(request_id, RequestState.FAILED)

    def _check_complete(self, request_id: str) -> None:  # caller holds the lock
        producers, writes, _ = self._expected_writes.get(request_id, (1, 1, None))
        counts = self._writes.get(request_id, {})
        finals = self._finals.get(request_id, {})
        if writes is None:
            complete = sum(1 for p, (n, _) in finals.items() if counts.get(p, 0) >= n)
        else:
            complete = sum(1 for n in counts.values() if n >= writes)
        if complete < producers:
            self._remember(request_id, RequestState.IN_FLIGHT)
            return
        self._writes.pop(request_id, None)
        self._finals.pop(request_id, None)
        self._expected_writes.pop(request_id, None)
        aux = {p: a for p, (_, a) in finals.items()}
        if aux:
            self._aux[request_id] = aux
            while len(self._aux) > _AUX_MEMORY:
                self._aux.popitem(last=False)
        self._report("received", request_id)
        self._remember(request_id, RequestState.RECEIVED)

    def _sweep(self) -> None:  # caller holds the lock
        """Fail the pushed requests whose deadline passed (checked whenever anyone asks)."""
        now = None
        for request_id, (_, _, deadline) in list(self._expected_writes.items()):
            if deadline is None:
                continue
            now = self._clock() if now is None else now
            if now >= deadline:
                del self._expected_writes[request_id]
                got = sum(self._writes.get(request_id, {}).values())
                self._fail_push(request_id, TransferTimeoutError(
                    f"request {request_id!r}: the producers' writes did not all arrive before the deadline "
                    f"({got} write(s) and {len(self._finals.get(request_id, {}))} end(s) arrived)"))

    def drain(self) -> Finished:
        with self._lock:
            self._sweep()
            out, self._current = self._current, Finished()
            self._order.clear()
            self._dropped = 0
        return out
