"""A unit of side-channel work queued on a peer's lane (layer: agent; imports nothing of kvxfer).

Reads and writes have their own lane items (``PendingRead``, ``PendingWrite``); the push model's
round trips (``Announce``, ``WritesDone``) are ``LaneJob``s: the lane runs them in order with the
reads and writes queued for the same peer, and a crashed lane fails them like the others.
"""

from __future__ import annotations

__all__ = ["LaneJob"]


class LaneJob:
    """Work for one peer's lane: ``run`` on the lane's thread, ``fail`` when the lane crashed."""

    def run(self, agent) -> None:  # pragma: no cover - an interface
        raise NotImplementedError

    def fail(self, error: Exception) -> None:  # pragma: no cover - an interface
        raise NotImplementedError
