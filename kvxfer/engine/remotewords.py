"""The one-sided look at a producer's hold word on another host: one small NIXL READ (layer:
engine; imports no agent, transport or torch).

A consumer whose producer is on another host cannot map its table (``WordView``); the table is
registered with NIXL by the producer and announced in ``PeerInfo.hold_words_addr``. Once a token
read's move has completed, ``RemoteWordView.check`` posts one 16-byte READ of the token's slot into
a row of this agent's own registered buffer (``WordReader``) and waits for it; the NIXL READ is
posted only after the data READ's completion, so the word is read after every byte of the move was
(docs/reliability.md, "hold tokens", across hosts). Anything but the token's word (another epoch, 0,
a failed or late READ) is a reason to fail the read: the look fails closed.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvxfer.backend.base import descs
from kvxfer.types import Direction, HoldToken, MemKind, XferState

__all__ = ["WordReader", "RemoteWordView"]

#: Rows of the consumer's landing buffer: looks in flight at once (more wait for a row).
ROWS = 64
#: Seconds one look may take before the read fails (the producer's UCX answers a 16-byte READ).
LOOK_TIMEOUT = 5.0


class WordReader:
    """This agent's registered landing rows for looks at remote hold words (16 bytes each).

    ``registry`` registers the buffer with ``backend`` (``register_buffer``); thread-safe."""

    def __init__(self, backend, registry, rows: int = ROWS) -> None:
        self._backend = backend
        self.buffer = np.zeros((rows, 2), dtype="<u8")
        self._base = registry.register_buffer(self.buffer).addr
        self._free = list(range(rows))
        self._cv = threading.Condition()

    def view(self, peer: str, addr: int, slots: int, timeout: float = LOOK_TIMEOUT) -> "RemoteWordView":
        """The table of ``peer`` (its backend agent name) at ``addr``, ``slots`` slots."""
        return RemoteWordView(self, peer, addr, slots, timeout)

    def _take(self, deadline: float) -> int | None:
        with self._cv:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._free.pop()

    def _give(self, row: int) -> None:
        with self._cv:
            self._free.append(row)
            self._cv.notify()

    def look(self, peer: str, remote_addr: int, timeout: float) -> tuple[int, int] | str:
        """``(epoch, tag)`` read from ``remote_addr`` on ``peer``, or why not (a str)."""
        deadline = time.monotonic() + timeout
        row = self._take(deadline)
        if row is None:
            return f"no landing row free for the look within {timeout} s"
        try:
            self.buffer[row] = 0
            local = descs(np.array([self._base + 16 * row]), np.array([16]), 0)
            remote = descs(np.array([remote_addr]), np.array([16]), 0)
            try:
                xfer = self._backend.post(Direction.READ, local, MemKind.DRAM, remote, MemKind.DRAM, peer, b"")
            except Exception as exc:  # noqa: BLE001 - any failure to look fails the read, typed by the caller
                return f"the look at the producer's hold word could not be posted ({type(exc).__name__}: {exc})"
            try:
                spins = 0
                while True:
                    try:
                        state = self._backend.state(xfer)
                    except Exception as exc:  # noqa: BLE001 - a lost peer, a failed transfer: not proven
                        return f"the look at the producer's hold word failed ({type(exc).__name__}: {exc})"
                    if state is XferState.DONE:
                        break
                    if state is XferState.FAILED:
                        return "the look at the producer's hold word failed (the backend reported it failed)"
                    if time.monotonic() > deadline:
                        return f"the look at the producer's hold word did not complete within {timeout} s"
                    spins += 1
                    if spins > 50:
                        time.sleep(0.0001)
            finally:
                try:
                    self._backend.release(xfer)
                except Exception:  # noqa: BLE001 - the look's outcome is already known
                    pass
            return int(self.buffer[row, 0]), int(self.buffer[row, 1])
        finally:
            self._give(row)


class RemoteWordView:
    """A producer's table on another host, looked at one word at a time (``check``, as
    ``WordView.check``)."""

    def __init__(self, reader: WordReader, peer: str, addr: int, slots: int, timeout: float) -> None:
        self._reader, self._peer, self._addr = reader, peer, addr
        self.slots, self._timeout = slots, timeout

    def check(self, token: HoldToken) -> str:
        """"" when the slot still holds ``token``'s word, else why not. Called once the move completed."""
        if token.slot >= self.slots:
            return f"hold token slot {token.slot} is past the producer's table ({self.slots} slots)"
        got = self._reader.look(self._peer, self._addr + 16 * token.slot, self._timeout)
        if isinstance(got, str):
            return got + "; the hold is not proven, so the read fails"
        epoch, tag = got
        if epoch != token.epoch or tag != token.tag:
            now = "no hold" if epoch == 0 else f"a later hold (epoch {epoch})"
            return (f"the producer's hold ended before the read's move completed (its slot {token.slot} now "
                    f"holds {now}; the token had epoch {token.epoch})")
        return ""
