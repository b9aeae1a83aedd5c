"""Clocks and deadlines (layer: clock; stdlib only). Tests swap in ``ManualClock``."""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "ManualClock", "Deadline"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic``."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when a test calls ``advance``."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds


class Deadline:
    """A point in time after which a wait gives up. ``None`` seconds means no deadline."""

    __slots__ = ("_clock", "_at")

    def __init__(self, seconds: float | None, clock: Clock | None = None) -> None:
        self._clock = clock or MonotonicClock()
        self._at = None if seconds is None else self._clock.now() + max(0.0, seconds)

    @property
    def at(self) -> float | None:
        return self._at

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` when there is no deadline."""
        if self._at is None:
            return None
        return max(0.0, self._at - self._clock.now())

    def expired(self) -> bool:
        return self._at is not None and self._clock.now() >= self._at
