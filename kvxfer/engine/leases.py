"""Producer-side holds on a request's blocks (layer: engine; pure logic over an injectable clock).

A producer ``hold``s a request's blocks. Consumers ``claim`` them before reading (the claim
is refused once the hold is gone, so a late read is never served from freed blocks), report
``done`` when their read completed, and may ``abort``. The hold ends when every expected
consumer is done (``sent``), or on abort / lease expiry (``expired``). Claimed holds are
kept alive by the claim and by heartbeats; an unclaimed hold lives ``lease`` seconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvxfer.clock import Clock, MonotonicClock
from kvxfer.errors import BlockIdError, ConfigError

__all__ = ["Hold", "LeaseTable", "ClaimResult"]


@dataclass
class Hold:
    request_id: str
    blocks: np.ndarray            # sorted unique int64 block ids
    expected: int | None          # consumers that must report done; None until the first claim says
    deadline: float
    claimed_by: set[str] = field(default_factory=set)
    done_by: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class ClaimResult:
    granted: bool
    reason: str = ""
    lease_remaining: float = 0.0


class LeaseTable:
    """Thread-safe table of holds. Every method is O(blocks of one request) at most."""

    def __init__(self, lease: float, clock: Clock | None = None,
                 on_release: Callable[[str, str], None] | None = None) -> None:
        if lease <= 0:
            raise ConfigError(f"lease must be positive; got {lease!r}")
        self._lease = lease
        self._clock = clock or MonotonicClock()
        self._holds: dict[str, Hold] = {}
        self._lock = threading.Lock()
        self._on_release = on_release or (lambda request_id, why: None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def held(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._holds

    def hold(self, request_id: str, blocks, num_blocks: int, consumers: int | None = None,
             lease: float | None = None) -> None:
        """Hold ``blocks`` for ``request_id``. Re-holding a held request replaces its blocks.

        Raises:
            BlockIdError: a block id outside ``[0, num_blocks)`` (names the id and the bound).
            ConfigError: ``consumers`` < 1 or ``lease`` <= 0.
        """
        ids = np.asarray(list(blocks) if not isinstance(blocks, np.ndarray) else blocks, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise BlockIdError(f"block id {bad} outside this cache's [0, {num_blocks})")
        if consumers is not None and consumers < 1:
            raise ConfigError(f"consumers must be >= 1; got {consumers}")
        if lease is not None and lease <= 0:
            raise ConfigError(f"lease must be positive; got {lease}")
        deadline = self._clock.now() + (lease or self._lease)
        with self._lock:
            self._holds[request_id] = Hold(request_id, np.unique(ids), consumers, deadline)

    def claim(self, request_id: str, consumer: str, blocks, expected_if_unset: int = 1) -> ClaimResult:
        """A consumer announces it will read ``blocks``; refused unless all are held for the request."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return ClaimResult(False, f"request {request_id!r} is not held (unknown, released or expired)")
            wanted = np.asarray(blocks, dtype=np.int64).reshape(-1)
            missing = wanted[~np.isin(wanted, hold.blocks, assume_unique=False)]
            if missing.size:
                return ClaimResult(False, f"block {int(missing[0])} is not held for request {request_id!r}")
            if hold.expected is None:
                hold.expected = expected_if_unset
            hold.claimed_by.add(consumer)
            hold.deadline = max(hold.deadline, self._clock.now() + self._lease)
            return ClaimResult(True, lease_remaining=hold.deadline - self._clock.now())

    def check_claimed(self, request_id: str, consumer: str, blocks) -> str:
        """Why ``consumer`` may not read ``blocks`` of ``request_id`` now ("" when it may). Changes nothing."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return f"request {request_id!r} is not held (unknown, released or expired)"
            if consumer not in hold.claimed_by:
                return f"request {request_id!r} was not claimed by {consumer!r}"
            wanted = np.asarray(blocks, dtype=np.int64).reshape(-1)
            missing = wanted[~np.isin(wanted, hold.blocks)]
            if missing.size:
                return f"block {int(missing[0])} is not held for request {request_id!r}"
        return ""

    def heartbeat(self, request_ids, consumer: str) -> tuple[list[str], list[str]]:
        """Extend the holds a consumer still waits on; returns (alive, gone)."""
        alive, gone = [], []
        now = self._clock.now()
        with self._lock:
            for rid in request_ids:
                hold = self._holds.get(rid)
                if hold is None:
                    gone.append(rid)
                else:
                    hold.deadline = max(hold.deadline, now + self._lease)
                    alive.append(rid)
        return alive, gone

    def done(self, request_id: str, consumer: str) -> bool:
        """A consumer finished reading. Returns True when this released the hold."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return False
            hold.done_by.add(consumer)
            if len(hold.done_by) < (hold.expected or 1):
                return False
            del self._holds[request_id]
        self._on_release(request_id, "sent")
        return True

    def release(self, request_id: str, why: str = "aborted") -> bool:
        """Drop a hold now (producer abort or consumer abort). Idempotent."""
        with self._lock:
            if self._holds.pop(request_id, None) is None:
                return False
        self._on_release(request_id, why)
        return True

    def expire(self) -> list[str]:
        """Release every hold past its deadline; returns their request ids."""
        now = self._clock.now()
        with self._lock:
            gone = [rid for rid, h in self._holds.items() if h.deadline <= now]
            for rid in gone:
                del self._holds[rid]
        for rid in gone:
            self._on_release(rid, "expired")
        return gone
