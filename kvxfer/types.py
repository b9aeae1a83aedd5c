"""Small value types shared by every layer (layer: types; imports nothing but the standard library)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AbortOutcome", "MemKind", "Region", "XferState", "Direction"]


class MemKind(str, enum.Enum):
    """Where memory lives, in NIXL's words."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class Direction(str, enum.Enum):
    """READ: the consumer pulls from the producer (default). WRITE: the producer pushes."""

    READ = "READ"
    WRITE = "WRITE"


class AbortOutcome(str, enum.Enum):
    """What ``Agent.abort`` achieved at the producer ranks it told (the worst one counts).

    RELEASED: a producer released its hold. NOT_HELD: no producer held the request (already
    released, expired or never held; or no producer was told). REFUSED: a producer refused
    (its hold names other consumer engines). UNREACHABLE: a producer could not be reached even
    after a fresh handshake; its hold ends with its lease.
    """

    RELEASED = "released"
    NOT_HELD = "not_held"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"

    @classmethod
    def combine(cls, outcomes) -> "AbortOutcome":
        """One outcome for several ranks: unreachable, then refused, then released, else not held."""
        seen = set(outcomes)
        for worst in (cls.UNREACHABLE, cls.REFUSED, cls.RELEASED):
            if worst in seen:
                return worst
        return cls.NOT_HELD


class XferState(enum.Enum):
    """State of one posted transfer as the backend reports it."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Region:
    """One contiguous registered span of memory.

    ``addr`` is the address in this process, ``length`` in bytes, ``device`` the
    GPU ordinal (0 for host memory), ``kind`` DRAM or VRAM.
    """

    addr: int
    length: int
    device: int
    kind: MemKind

    @property
    def end(self) -> int:
        return self.addr + self.length
