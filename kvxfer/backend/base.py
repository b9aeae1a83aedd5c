"""The Backend protocol every transport implements (layer: backend.base; imports types/errors and numpy only).

A backend is one agent of a one-sided transfer library (NIXL, or the in-memory
``FakeBackend`` for unit tests). kvxfer talks to it only through this protocol, so
the engine never sees NIXL types, status strings or exceptions.

Descriptor arrays are ``numpy.uint64`` arrays of shape ``[N, 3]``: ``(addr, length, device)``.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from kvxfer.types import Direction, MemKind, Region, XferState

__all__ = ["Backend", "XferId", "descs"]

XferId = int


def descs(addr: np.ndarray, length: np.ndarray, device: int) -> np.ndarray:
    """Stack address and length arrays into an ``[N, 3]`` uint64 descriptor array."""
    addr = np.asarray(addr, dtype=np.uint64)
    out = np.empty((addr.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = device
    return out


@runtime_checkable
class Backend(Protocol):
    """One transfer agent. Every method may raise ``BackendError`` (the lower error chained).

    Invariants: ``post`` never blocks on the transfer; ``state`` never blocks; after
    ``close`` every method raises ``ClosedError`` except ``close`` itself.
    """

    name: str

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach this agent."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        ...

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (its name may be added again later)."""
        ...

    def register(self, regions: Sequence[Region]) -> object:
        """Register memory for transfers; returns a handle for ``deregister``."""
        ...

    def deregister(self, handle: object) -> None:
        ...

    def post(self, direction: Direction, local: np.ndarray, local_kind: MemKind,
             remote: np.ndarray, remote_kind: MemKind, peer: str, notification: bytes) -> XferId:
        """Start moving ``local[i] <-> remote[i]`` for all i; on completion ``notification``
        is delivered to ``peer``. READ fills local from remote; WRITE the reverse."""
        ...

    def state(self, xfer: XferId) -> XferState:
        ...

    def release(self, xfer: XferId) -> None:
        """Free a finished (or failed) transfer's resources. A pending one is cancelled."""
        ...

    def notify(self, peer: str, message: bytes) -> None:
        """Send a small message to a peer through the transport's own channel."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """Messages (peer name, bytes) received since the last call."""
        ...

    def close(self) -> None:
        ...
