"""A first-fit allocator over one registered staging buffer (layer: engine; pure bookkeeping)."""

from __future__ import annotations

import threading

__all__ = ["StagingAllocator"]


class StagingAllocator:
    """Hands out aligned byte ranges of a buffer of ``capacity`` bytes; thread-safe.

    ``allocate`` returns an offset or ``None`` when no free range is large enough.
    """

    def __init__(self, capacity: int, align: int = 256) -> None:
        self.capacity = capacity
        self._align = align
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // self._align) * self._align
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (start + size, length - size)
                    self._used[start] = size
                    return start
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                return
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())
