"""Clocks (layer: clock; stdlib only). Every wait and deadline in kvxfer reads one; tests swap in ``ManualClock``."""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "ManualClock"]


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
