"""A unit of side-channel work queued on a peer's lane (layer: agent; imports nothing of kvxfer).

Reads and writes have their own lane items (``PendingRead``, ``PendingWrite``); the push model's
round trips (``Announce``, ``WritesDone``) are ``LaneJob``s: the lane runs them in order with the
reads and writes queued for the same peer, and a crashed lane fails them like the others.
"""

from __future__ import annotations

import logging
from typing import Callable

__all__ = ["Deferred", "LaneJob"]

log = logging.getLogger("kvxfer.agent")


class LaneJob:
    """Work for one peer's lane: ``run`` on the lane's thread, ``fail`` when the lane crashed."""

    def run(self, agent) -> None:  # pragma: no cover - an interface
        raise NotImplementedError

    def fail(self, error: Exception) -> None:  # pragma: no cover - an interface
        raise NotImplementedError


class Deferred(LaneJob):
    """A call that must not run on the thread that asks (a round trip that may wait on a frozen
    or dead peer: giving a claim's grant back), run on the peer's lane in order with the reads
    queued there after it. A crashed lane drops it: the producer's hold then ends by its lease."""

    def __init__(self, fn: Callable[[], object], what: str) -> None:
        self.fn, self.what = fn, what

    def run(self, agent) -> None:
        self.fn()

    def fail(self, error: Exception) -> None:
        log.debug("%s not done: %s", self.what, error)
