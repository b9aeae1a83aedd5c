"""Message plumbing between the benchmark's processes (layer: bench app; uses a Backend's notifications).

``Mailbox`` drains one backend's notifications and sorts them by sender into pipeline
messages (for ``kvxfer.engine.paths.pipeline``) and control messages (``GO`` at the start of a timed
iteration); ``PeerLink`` is the ``kvxfer.engine.paths.pipeline.Link`` for one peer.
"""

from __future__ import annotations

import collections
import struct
import threading
import time

from kvxfer.backend.base import Backend
from kvxfer.errors import TransferTimeoutError

__all__ = ["Mailbox", "PeerLink", "GO"]

GO = b"KXGO"
_GO = struct.Struct("<4sQ")


class Mailbox:
    """Per-sender queues over ``backend.notifications()`` (thread-safe)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._pipe: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._control: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def _drain(self) -> None:
        for sender, raw in self.backend.notifications():
            (self._control if raw[:4] == GO else self._pipe)[sender].append(raw)

    def poll(self) -> None:
        """Progress the agent once, keeping whatever notifications arrived."""
        with self._lock:
            self._drain()

    def pipe(self, sender: str) -> list[bytes]:
        with self._lock:
            self._drain()
            q = self._pipe[sender]
            out = list(q)
            q.clear()
            return out

    def wait_go(self, sender: str, deadline: float) -> int:
        """Block until ``sender``'s next GO; returns its iteration number."""
        while True:
            with self._lock:
                self._drain()
                q = self._control[sender]
                if q:
                    return _GO.unpack(q.popleft())[1]
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"no GO from {sender!r} before the deadline")
            time.sleep(0)  # yield, but poll at once: GO starts a timed iteration

    def send_go(self, peer: str, iteration: int) -> None:
        self.backend.notify(peer, _GO.pack(GO, iteration))


class PeerLink:
    """``kvxfer.engine.paths.pipeline.Link`` to one peer over a ``Mailbox``."""

    def __init__(self, mailbox: Mailbox, peer: str) -> None:
        self.mailbox, self.peer = mailbox, peer

    def send(self, message: bytes) -> None:
        self.mailbox.backend.notify(self.peer, message)

    def receive(self) -> list[bytes]:
        return self.mailbox.pipe(self.peer)

    def wait(self, timeout: float) -> None:
        """The mailbox is polled by ``receive`` itself: only yield (the pipeline stays as fast as it can)."""
        time.sleep(0)
