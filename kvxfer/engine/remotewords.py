"""The one-sided look at a producer's hold word on another host: one small NIXL READ (layer:
engine; imports no agent, transport or torch).

A consumer whose producer is on another host cannot map its table (``WordView``); the table is
registered with NIXL by the producer and announced in ``PeerInfo.hold_words_addr``. Once a token
read's move has completed, ``RemoteWordView.check`` posts one 16-byte READ of the token's slot into
a row of this agent's own registered buffer (``WordReader``), and later checks poll it (nothing
here waits: the engine polls the read again, its deadline binding); the NIXL READ is
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

__all__ = ["Look", "WordReader", "RemoteWordView"]

#: Rows of the consumer's landing buffer: looks in flight at once (more wait for a row).
ROWS = 64
#: Seconds one look may take before the read fails (the producer's UCX answers a 16-byte READ).
LOOK_TIMEOUT = 5.0


class WordReader:
    """This agent's registered landing rows for looks at remote hold words (16 bytes each).

    ``registry`` registers the buffer with ``backend`` (``register_buffer``); thread-safe. A look
    never waits on the caller's thread: ``start`` posts it (or says no row is free yet) and the
    look is polled (``Look.poll``) until its READ ends. A look given up while its READ may still
    write (``Look.cancel``) keeps its row until the backend says the READ ended."""

    def __init__(self, backend, registry, rows: int = ROWS) -> None:
        self._backend = backend
        self.buffer = np.zeros((rows, 2), dtype="<u8")
        self._base = registry.register_buffer(self.buffer).addr
        self._free = list(range(rows))
        self._ending: list[tuple[int, int]] = []   # (row, transfer) of looks given up, not ended yet
        self._lock = threading.Lock()

    def view(self, peer: str, addr: int, slots: int, timeout: float = LOOK_TIMEOUT) -> "RemoteWordView":
        """The table of ``peer`` (its backend agent name) at ``addr``, ``slots`` slots."""
        return RemoteWordView(self, peer, addr, slots, timeout)

    def start(self, peer: str, remote_addr: int) -> "Look | str | None":
        """Post a look at the word at ``remote_addr`` on ``peer``: the ``Look``, None while no
        row is free (start again later), or why it could not be posted (a str)."""
        with self._lock:
            self._reap()
            if not self._free:
                return None
            row = self._free.pop()
        self.buffer[row] = 0
        local = descs(np.array([self._base + 16 * row]), np.array([16]), 0)
        remote = descs(np.array([remote_addr]), np.array([16]), 0)
        try:
            xfer = self._backend.post(Direction.READ, local, MemKind.DRAM, remote, MemKind.DRAM, peer, b"")
        except Exception as exc:  # noqa: BLE001 - any failure to look fails the read, typed by the caller
            self._give(row)
            return f"the look at the producer's hold word could not be posted ({type(exc).__name__}: {exc})"
        return Look(self, row, xfer)

    def _give(self, row: int) -> None:
        with self._lock:
            self._free.append(row)

    def _end(self, row: int, xfer: int) -> None:
        try:
            self._backend.release(xfer)
        except Exception:  # noqa: BLE001 - the look's outcome is already known
            pass
        self._give(row)

    def _reap(self) -> None:
        """Rows of given-up looks whose READ has ended come back (the caller holds the lock)."""
        still = []
        for row, xfer in self._ending:
            try:
                state = self._backend.state(xfer)
            except Exception:  # noqa: BLE001 - unknown to the backend: nothing of it moves any more
                state = XferState.FAILED
            if state is XferState.PENDING:
                still.append((row, xfer))
                continue
            try:
                self._backend.release(xfer)
            except Exception:  # noqa: BLE001
                pass
            self._free.append(row)
        self._ending = still


class Look:
    """One look in flight: ``poll`` until it returns ``(epoch, tag)`` or why not (a str)."""

    def __init__(self, reader: WordReader, row: int, xfer: int) -> None:
        self._reader, self._row, self._xfer = reader, row, xfer
        self._over = False

    def poll(self) -> tuple[int, int] | str | None:
        """``(epoch, tag)`` once the READ is done, why not if it failed, None while it moves."""
        if self._over:
            return "the look was given up"
        reader = self._reader
        try:
            state = reader._backend.state(self._xfer)
        except Exception as exc:  # noqa: BLE001 - a lost peer, a failed transfer: not proven
            self._over = True
            reader._end(self._row, self._xfer)
            return f"the look at the producer's hold word failed ({type(exc).__name__}: {exc})"
        if state is XferState.PENDING:
            return None
        self._over = True
        got = (int(reader.buffer[self._row, 0]), int(reader.buffer[self._row, 1]))
        reader._end(self._row, self._xfer)
        if state is XferState.FAILED:
            return "the look at the producer's hold word failed (the backend reported it failed)"
        return got

    def cancel(self) -> None:
        """Give the look up; its row comes back once its READ has ended."""
        if self._over:
            return
        self._over = True
        with self._reader._lock:
            self._reader._ending.append((self._row, self._xfer))


class RemoteWordView:
    """A producer's table on another host, looked at one word at a time: ``check`` starts or
    polls the look for one read and never waits (the engine polls again)."""

    def __init__(self, reader: WordReader, peer: str, addr: int, slots: int, timeout: float) -> None:
        self._reader, self._peer, self._addr = reader, peer, addr
        self.slots, self._timeout = slots, timeout

    def check(self, token: HoldToken, look: dict | None = None) -> str | None:
        """"" when the slot still holds ``token``'s word, why not, or None while the look is in
        flight (call again with the same ``look``: the read's own state, a dict). Called once the
        move completed; the first call posts the look. A look longer than the view's timeout fails."""
        if token.slot >= self.slots:
            return f"hold token slot {token.slot} is past the producer's table ({self.slots} slots)"
        look = {} if look is None else look
        now = time.monotonic()
        current = look.get("look")
        if current is None:
            look.setdefault("since", now)
            started = self._reader.start(self._peer, self._addr + 16 * token.slot)
            if isinstance(started, str):
                return started + "; the hold is not proven, so the read fails"
            look["look"] = current = started
        if current is not None:
            got = current.poll()
        else:
            got = None  # no landing row free yet
        if got is None:
            if now - look["since"] > self._timeout:
                if current is not None:
                    current.cancel()
                return (f"the look at the producer's hold word did not complete within {self._timeout} s; "
                        "the hold is not proven, so the read fails")
            return None
        if isinstance(got, str):
            return got + "; the hold is not proven, so the read fails"
        epoch, tag = got
        if epoch != token.epoch or tag != token.tag:
            now_word = "no hold" if epoch == 0 else f"a later hold (epoch {epoch})"
            return (f"the producer's hold ended before the read's move completed (its slot {token.slot} now "
                    f"holds {now_word}; the token had epoch {token.epoch})")
        return ""

    @staticmethod
    def cancel(look: dict) -> None:
        """Give up the look of ``look`` (the read ended another way)."""
        current = look.get("look")
        if current is not None:
            current.cancel()
