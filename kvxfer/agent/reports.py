"""What finished since the user last asked, and what the agent holds now (layer: agent)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvxfer.errors import KvxferError

__all__ = ["AgentStats", "Finished", "Reports"]


@dataclass
class Finished:
    """What completed since the last ``Agent.finished()`` call.

    ``sent``: producer requests released because every consumer reported done.
    ``expired``: producer requests released by abort or lease expiry.
    ``received``: consumer requests whose blocks arrived (reads, or writes from producers).
    ``failed``: consumer requests that failed, with the error.
    ``reclaimed``: failed consumer requests whose destination blocks were quarantined (the
    transfer was not confirmed ended when the read failed) and are free again now.

    A producer request appears in ``sent`` or ``expired`` only once its blocks are really free
    (no consumer's transfer window is open any more): only then may the engine reuse them.
    """

    sent: set[str] = field(default_factory=set)
    expired: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: dict[str, KvxferError] = field(default_factory=dict)
    reclaimed: set[str] = field(default_factory=set)


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


class Reports:
    """Thread-safe accumulation of ``Finished`` sets, drained by the user."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = Finished()
        self._expected_writes: dict[str, int] = {}
        self._write_counts: dict[str, int] = {}

    def read_done(self, handle) -> None:
        """A consumer read completed (with or without an error)."""
        error = handle.exception()
        with self._lock:
            if error is None:
                self._current.received.add(handle.request_id)
            else:
                self._current.failed[handle.request_id] = error

    def released(self, request_id: str, why: str) -> None:
        """A producer hold ended: ``why`` is "sent", "aborted" or "expired"."""
        with self._lock:
            (self._current.sent if why == "sent" else self._current.expired).add(request_id)

    def reclaimed(self, request_id: str) -> None:
        """A failed read's quarantined blocks are free again."""
        with self._lock:
            self._current.reclaimed.add(request_id)

    def expect_writes(self, request_id: str, producers: int) -> None:
        with self._lock:
            self._expected_writes[request_id] = producers

    def write_arrived(self, request_id: str) -> None:
        """One producer finished writing ``request_id``; received once all expected did."""
        with self._lock:
            count = self._write_counts.get(request_id, 0) + 1
            if count >= self._expected_writes.get(request_id, 1):
                self._write_counts.pop(request_id, None)
                self._expected_writes.pop(request_id, None)
                self._current.received.add(request_id)
            else:
                self._write_counts[request_id] = count

    def drain(self) -> Finished:
        with self._lock:
            out, self._current = self._current, Finished()
        return out
