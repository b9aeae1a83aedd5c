"""Small value types shared by every layer (layer: types; imports nothing but the standard library)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["MemKind", "Region", "XferState", "Direction"]


class MemKind(str, enum.Enum):
    """Where memory lives, in NIXL's words."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class Direction(str, enum.Enum):
    """READ: the consumer pulls from the producer (default). WRITE: the producer pushes."""

    READ = "READ"
    WRITE = "WRITE"


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
