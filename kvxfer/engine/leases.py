"""Producer-side ownership of a request's blocks (layer: engine; pure logic over an injectable clock).

A request's blocks move through three states (docs/reliability.md has the table):

* **held** (``hold``): readable by claims; freed by ``release``, abort or lease expiry.
* **claimed**: a consumer's ``claim`` names a transfer *window* (seconds from the claim's
  receipt). Until every claimant is done or its window has passed, the blocks are not freed,
  whatever ``release``, abort or lease expiry say meanwhile: those only mark the request as
  *ending* (new claims are refused) and the free happens when the last window closes. A
  claimant whose window passes without its done has failed its read (on its own clock): the
  hold then ends ("expired") as soon as no other window is open.
* **free**: the ``on_release(request_id, why)`` callback fires exactly once, only now; the
  engine that owns the cache may reuse the blocks from this moment on, never before.

The consumer counts its window from before it sent the claim and fails a read that finished
after it, so a read that succeeds never overlapped a free.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from kvxfer.clock import Clock, MonotonicClock
from kvxfer.config import check_count, check_seconds
from kvxfer.errors import AlreadyHeldError, ConfigError
from kvxfer.layout.request import check_block_ids
from kvxfer.protocol.messages import PACKED_ID, engine_named, pack_ids
from kvxfer.types import ReleaseOutcome, ReleaseReason, RequestState

__all__ = ["Hold", "LeaseTable", "ClaimResult", "HoldCounts"]


@dataclass
class Hold:
    request_id: str
    blocks: np.ndarray            # sorted unique int64 block ids
    expected: int | None          # consumers that must report done; None until the first claim says
    deadline: float               # lease: when an unclaimed hold expires
    lease: float = 0.0            # this hold's lease: what a claim or heartbeat extends it by
    windows: dict[str, float] = field(default_factory=dict)  # claimant -> end of its transfer window
    done_by: set[str] = field(default_factory=set)
    ending: str = ""              # why the hold ends once its windows close ("aborted", "expired")
    named: tuple[str, ...] = ()   # consumer engines that may act on it (``engine_named``); () = anyone
    epoch: int = 0                # its hold word's epoch (``on_hold``'s answer; 0: none)
    _members: frozenset | None = None  # ``blocks`` as a set, built when a claim names other ids
    _given: list | None = None         # the ids as ``hold`` got them (a claim usually names exactly these)
    _packed: bytes = b""               # ``_given`` as ``Claim.packed_ids``

    def missing(self, wanted) -> int | None:
        """The first of ``wanted`` (ints, or ``Claim.packed_ids`` bytes) not held, or None when all
        are: a list or bytes compare when the claim names the held ids in their order, else one
        C-level set test."""
        if isinstance(wanted, bytes):
            if wanted == self._packed:
                return None
            wanted = np.frombuffer(wanted, dtype=PACKED_ID)
            outside = np.flatnonzero(~np.isin(wanted, self.blocks))
            return int(wanted[outside[0]]) if outside.size else None
        if isinstance(wanted, list) and wanted == self._given:
            return None
        if self._members is None:
            self._members = frozenset(self.blocks.tolist())
        try:
            if self._members.issuperset(wanted):
                return None
        except TypeError:  # not hashable ints: let the caller's checks name it
            pass
        return next((int(b) for b in np.asarray(wanted, dtype=np.int64).reshape(-1).tolist()
                     if b not in self._members), None)

    def allows(self, consumer: str) -> bool:
        """Whether ``consumer`` (an engine id) may claim, heartbeat, abort or report done."""
        return not self.named or any(engine_named(name, consumer) for name in self.named)

    def open_windows(self, now: float) -> bool:
        """Whether some claimant that has not reported done may still be moving bytes."""
        return any(until > now and who not in self.done_by for who, until in self.windows.items())


@dataclass(frozen=True)
class ClaimResult:
    granted: bool
    reason: str = ""
    lease_remaining: float = 0.0


@dataclass(frozen=True)
class HoldCounts:
    """A snapshot for ``Agent.stats()``: holds, their blocks, and those inside a claim window."""

    requests: int
    blocks: int
    claimed: int
    ending: int


class LeaseTable:
    """Thread-safe table of holds. Every method is O(blocks of one request) at most; ``expire``
    looks only at the holds whose lease or window may have passed (a heap of due times), so a
    producer holding thousands of requests pays nothing per idle hold.

    Args:
        lease: seconds an unclaimed hold lives (and the window of a claim that names none).
        clock: the clock every deadline and window is measured on.
        on_release: ``(request_id, why)`` once per hold, when its blocks are really free;
            ``why`` is a ``ReleaseReason`` (equal to "sent", "aborted" or "expired").
        max_window: the longest transfer window a claim may name (a hostile or confused
            consumer cannot pin blocks for longer).
        on_hold: ``(request_id, ids, named, fresh)`` inside the table's lock once a hold (or a
            replacement) is recorded (``fresh``: a ``replace`` that found no hold to replace);
            returns the epoch of the hold's word, or None (``done`` checks a token read's):
            the agent writes the hold's word there, so no release can come between the hold and
            its word (docs/reliability.md, "hold tokens"). If it raises, the hold is not made
            (a replaced hold stays as it was) and the error propagates.
        on_end: ``(request_id, why)`` inside the table's lock as a hold leaves it, before
            ``held`` turns False and before any later hold of the same id: the agent changes the
            hold's word and files its report there, so nothing says the blocks are free while
            the word still proves the hold, and a hold made next is never reported freed by the
            old one's end.
    """

    def __init__(self, lease: float, clock: Clock | None = None,
                 on_release: Callable[[str, str], None] | None = None, max_window: float = 480.0,
                 on_hold: Callable[[str, np.ndarray, tuple, bool], None] | None = None,
                 on_end: Callable[[str, str], None] | None = None) -> None:
        if lease <= 0:
            raise ConfigError(f"lease must be positive; got {lease!r}")
        if max_window <= 0:
            raise ConfigError(f"max_window must be positive; got {max_window!r}")
        self._lease = lease
        self._max_window = max(max_window, lease)
        self._clock = clock or MonotonicClock()
        self._holds: dict[str, Hold] = {}
        self._due: list[tuple[float, int, str]] = []  # (when, seq, request id): look at it then
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._on_release = on_release or (lambda request_id, why: None)
        self._on_hold = on_hold
        self._on_end = on_end

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def held(self, request_id: str) -> bool:
        """True until the request's blocks are free (also while a release waits on a window)."""
        with self._lock:
            return request_id in self._holds

    def counts(self) -> HoldCounts:
        now = self._clock.now()
        with self._lock:
            holds = list(self._holds.values())
        return HoldCounts(len(holds), sum(int(h.blocks.size) for h in holds),
                          sum(1 for h in holds if h.open_windows(now)), sum(1 for h in holds if h.ending))

    def hold(self, request_id: str, blocks, num_blocks: int, consumers: int | None = None,
             lease: float | None = None, named: Sequence[str] = (), replace: bool = False) -> None:
        """Hold ``blocks`` for ``request_id``. A request already held is refused, unless
        ``replace``: then its blocks, consumers, lease and names are replaced, as long as no claim
        window is open on it and it is not ending (the old blocks may be in use: refused).

        Raises:
            BlockIdError: ids that are not distinct integers in ``[0, num_blocks)`` (names the id and bound).
            AlreadyHeldError: the request is held (without ``replace``; or, with it, inside a
                claim window or ending). A ``ConfigError``.
            ConfigError: ``consumers`` < 1, ``lease`` <= 0, ``named`` not a list of non-empty strings.

        ``named``: the consumer engines that may act on the hold (an agent name, every start of
        that agent, or one exact engine id; see ``kvxfer.protocol.engine_named``); empty: anyone.
        """
        ids = check_block_ids("held", blocks, num_blocks)
        if consumers is not None:
            consumers = check_count(consumers, "consumers", 1)
        lease = check_seconds(lease, "lease", none=True)
        names = tuple(named) if isinstance(named, Iterable) and not isinstance(named, (str, bytes)) else None
        if names is None or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"consumer engines must be a list of non-empty names; got {named!r}")
        named = names
        now = self._clock.now()
        with self._lock:
            old = self._holds.get(request_id)
            if old is not None and (old.ending or old.open_windows(now)):
                state = "ending" if old.ending else "being read (a claim window is open)"
                raise AlreadyHeldError(f"request {request_id!r} is already held ({old.blocks.size} blocks) and "
                                       f"{state}; expected it free before holding {ids.size} blocks again: hold "
                                       "it once finished() lists it", request_id)
            if old is not None and not replace:
                raise AlreadyHeldError(f"request {request_id!r} is already held ({old.blocks.size} blocks); "
                                       f"refusing to hold {ids.size} blocks under the same id (pass "
                                       "replace=True to replace the hold)", request_id)
            unique = np.sort(ids)  # distinct (checked above): np.unique of a few ids costs ~3x a sort
            lease = lease or self._lease
            deadline = now + lease
            self._holds[request_id] = Hold(request_id, unique, consumers, deadline, lease,
                                           named=tuple(named), _given=ids.tolist(),
                                           _packed=pack_ids(ids) or b"")
            if self._on_hold is not None:
                try:
                    self._holds[request_id].epoch = self._on_hold(request_id, ids, tuple(named),
                                                                  replace and old is None) or 0
                except BaseException:
                    if old is None:
                        del self._holds[request_id]
                    else:
                        self._holds[request_id] = old
                    raise
            self._look_at(request_id, deadline)

    def claim(self, request_id: str, consumer: str, blocks, expected_if_unset: int = 1,
              window: float = 0.0) -> ClaimResult:
        """A consumer announces it will read ``blocks`` within ``window`` seconds (0: the lease).

        Refused unless every block is held for the request and the request is not ending."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return ClaimResult(False, f"request {request_id!r} is not held (unknown, released or expired)")
            if hold.ending:
                return ClaimResult(False, f"request {request_id!r} was {hold.ending} (freed once its reads end)")
            if not hold.allows(consumer):
                return ClaimResult(False, f"request {request_id!r} is held for other consumer engines, not {consumer!r}")
            missing = hold.missing(blocks)
            if missing is not None:
                return ClaimResult(False, f"block {missing} is not held for request {request_id!r}")
            if hold.expected is None:
                hold.expected = expected_if_unset
            now = self._clock.now()
            lease = hold.lease or self._lease
            until = now + min(window if window > 0 else lease, max(self._max_window, lease))
            hold.windows[consumer] = max(hold.windows.get(consumer, 0.0), until)
            hold.done_by.discard(consumer)  # a claim after a done starts a new read
            hold.deadline = max(hold.deadline, now + lease)  # the hold's own lease, not the agent's
            self._look_at(request_id, until)
            return ClaimResult(True, lease_remaining=until - now)

    def check_claimed(self, request_id: str, consumer: str, blocks) -> str:
        """Why ``consumer`` may not read ``blocks`` of ``request_id`` now ("" when it may). Changes nothing."""
        return self.claimed_until(request_id, consumer, blocks)[0]

    def claimed_until(self, request_id: str, consumer: str, blocks) -> tuple[str, float]:
        """``check_claimed`` and, when ``consumer`` may read, the end of the window it was granted
        (on this table's clock; 0.0 with a reason). Changes nothing."""
        now = self._clock.now()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return f"request {request_id!r} is not held (unknown, released or expired)", 0.0
            until = hold.windows.get(consumer, 0.0)
            if until <= now:
                return f"request {request_id!r} was not claimed by {consumer!r} (or its claim window closed)", 0.0
            missing = hold.missing(blocks)
            if missing is not None:
                return f"block {missing} is not held for request {request_id!r}", 0.0
        return "", until

    def heartbeat(self, request_ids, consumer: str) -> tuple[list[str], list[str]]:
        """Extend the holds a consumer still waits on; returns (alive, gone). An ending hold is gone."""
        alive, gone = [], []
        now = self._clock.now()
        with self._lock:
            for rid in request_ids:
                hold = self._holds.get(rid)
                if hold is None or hold.ending or not hold.allows(consumer):
                    gone.append(rid)
                else:
                    hold.deadline = max(hold.deadline, now + (hold.lease or self._lease))
                    alive.append(rid)
        return alive, gone

    def done(self, request_id: str, consumer: str, epoch: int = 0) -> bool:
        """A consumer finished reading. Returns True when this freed the hold. ``epoch``: the
        hold token's the read went by (0: none); a done naming another epoch is a read's of an
        earlier hold of the request (replaced since) and changes nothing."""
        now = self._clock.now()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or not hold.allows(consumer) or (epoch and epoch != hold.epoch):
                return False
            hold.done_by.add(consumer)
            hold.windows.pop(consumer, None)
            if len(hold.done_by) >= (hold.expected or 1):
                if hold.open_windows(now):
                    # Sent, but another claimant's read may still be moving: freed once it is done
                    # or its window has passed, never under it (new claims are refused meanwhile).
                    hold.ending = hold.ending or ReleaseReason.SENT
                    self._look_at(request_id, _next_change(hold, now))
                    return False
                why = hold.ending or ReleaseReason.SENT
            elif hold.ending and not hold.open_windows(now):
                why = hold.ending
            else:
                self._look_at(request_id, now)  # the windows left decide: look at it again
                return False
            self._end(request_id, why)
        self._on_release(request_id, why)
        return True

    def may_act(self, request_id: str, consumer: str) -> bool:
        """Whether ``consumer`` may act on ``request_id`` (True when it is not held, or names nobody)."""
        with self._lock:
            hold = self._holds.get(request_id)
            return hold is None or hold.allows(consumer)

    def release(self, request_id: str, why: str = ReleaseReason.ABORTED,
                consumer: str | None = None) -> ReleaseOutcome:
        """End a hold (producer release or consumer abort). Frees at once unless a claim window
        is open: then new claims are refused and the blocks are freed when it closes.

        ``consumer``: the engine that asks (a consumer's abort). Its own window closes: it said
        it will not read (an aborted read's bytes are discarded on its side, and a claim it is
        undoing never moved any), also on a hold already ending. Returns FREE_NOW,
        FREE_WHEN_FINISHED, ALREADY_ENDING or NOT_HELD (``ReleaseOutcome``). Idempotent."""
        now = self._clock.now()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return ReleaseOutcome.NOT_HELD
            if consumer is not None:
                hold.windows.pop(consumer, None)
            if hold.ending:
                if hold.open_windows(now):
                    return ReleaseOutcome.ALREADY_ENDING
                why = hold.ending  # the consumer's abort closed the last window: free now
                outcome = ReleaseOutcome.ALREADY_ENDING
            elif hold.open_windows(now):
                hold.ending = why
                self._look_at(request_id, now)
                return ReleaseOutcome.FREE_WHEN_FINISHED
            else:
                outcome = ReleaseOutcome.FREE_NOW
            self._end(request_id, why)
        self._on_release(request_id, why)
        return outcome

    def state(self, request_id: str) -> RequestState | None:
        """HELD, CLAIMED (a claim window is open) or ENDING; None when not held. Changes nothing."""
        now = self._clock.now()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return None
            if hold.ending:
                return RequestState.ENDING
            return RequestState.CLAIMED if hold.open_windows(now) else RequestState.HELD

    def expire(self) -> list[str]:
        """Free every hold past its lease, ending, or whose claimant's window passed without its
        done (that read failed on its own clock), once no window is open; returns their request
        ids. A hold past its lease inside a window becomes ending."""
        now = self._clock.now()
        freed: list[tuple[str, str]] = []
        with self._lock:
            looked: set[str] = set()
            while self._due and self._due[0][0] <= now:
                rid = heapq.heappop(self._due)[2]
                hold = self._holds.get(rid)
                if hold is None or rid in looked:
                    continue
                looked.add(rid)
                lapsed = bool(hold.windows) and not hold.open_windows(now)
                if not hold.ending and hold.deadline > now and not lapsed:
                    self._look_at(rid, _next_change(hold, now))
                    continue
                if hold.open_windows(now):
                    hold.ending = hold.ending or ReleaseReason.EXPIRED
                    self._look_at(rid, _next_change(hold, now))
                    continue
                freed.append((rid, hold.ending or ReleaseReason.EXPIRED))
                self._end(rid, freed[-1][1])
        for rid, why in freed:
            self._on_release(rid, why)
        return [rid for rid, _ in freed]

    def _end(self, request_id: str, why: str) -> None:
        """``request_id``'s hold leaves the table (caller holds the lock): ``on_end`` first."""
        if self._on_end is not None:
            self._on_end(request_id, why)
        del self._holds[request_id]

    def _look_at(self, request_id: str, when: float) -> None:
        """Have ``expire`` look at ``request_id`` once ``when`` has come (caller holds the lock)."""
        heapq.heappush(self._due, (when, next(self._seq), request_id))
        if len(self._due) > 2 * len(self._holds) + 1024:  # else every claim, and every freed hold, stays till due
            self._compact()

    def _compact(self) -> None:
        """Keep only the earliest due entry of each hold still kept: that look decides from the
        hold as it is then and files the next one, so the heap stays O(holds) (caller holds the lock)."""
        first: dict[str, tuple[float, int, str]] = {}
        for entry in self._due:
            rid = entry[2]
            if rid in self._holds and (rid not in first or entry < first[rid]):
                first[rid] = entry
        self._due = list(first.values())
        heapq.heapify(self._due)


def _next_change(hold: Hold, now: float) -> float:
    """The next time ``hold``'s fate may change by itself: its lease or a window passing."""
    later = [t for t in (hold.deadline, *hold.windows.values()) if t > now]
    return min(later) if later else now + 0.01
