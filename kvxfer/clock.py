"""Clocks (layer: clock; stdlib only). Every wait and deadline in kvxfer reads one; tests swap in ``ManualClock``.

A loop that waits for something until a deadline on a clock also sleeps on that clock
(``Clock.sleep``), so under ``ManualClock`` it never sleeps for real: it polls on until the
test moves the clock past its deadline. Pacing yields (``time.sleep(0)``: let another thread run) and a thread's idle waits
for work are not deadlines and stay on the real clock.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "ManualClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of this clock pass (a poll's interval in a wait with a deadline)."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


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

    def sleep(self, seconds: float) -> None:
        """Never sleeps for real and never moves the clock (only ``advance`` does): it lets other
        threads run, so a wait polls on until the test advances the clock past its deadline."""
        time.sleep(0)
