"""In-process fake transport that really copies bytes (layer: backend; imports backend.base, types, errors, numpy; never nixl).

``FakeBackend`` agents live in a ``FakeWorld`` (one per process by default), keyed by name.
A transfer copies bytes with ``ctypes.memmove`` between memory the two agents registered, so
tests of the engine check data, not calls. Semantics, chosen to be deterministic:

* Bytes are copied **at post** (``state`` is then DONE at once), unless transfers are held
  (``hold_transfers(True)``): held transfers stay PENDING and are copied, in post order, when the
  hold is lifted; a held transfer that is ``release``\\ d first is cancelled (nothing copied).
* A descriptor outside the registered memory of its side makes ``post`` raise
  ``RegistrationError`` naming the address (NixlBackend raises the same class there).
* A non-empty notification is delivered to the peer, as ``(initiator name, bytes)``, when the
  copy happens; a failed transfer copies nothing and delivers nothing.
* ``fail_next(n)``: the next n posted transfers end FAILED. ``kill()`` simulates a crash of this
  agent: it leaves the world, its own methods raise ClosedError, posts and notifies to it raise
  ``PeerLostError`` and held transfers touching it end FAILED.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvxfer.backend.base import XferId
from kvxfer.backend.checks import check_regions, as_enum, check_indices, check_pair
from kvxfer.errors import (ClosedError, ConfigError, KvxferError, PeerLostError, RegistrationError,
                           TransferFailedError)
from kvxfer.types import Direction, MemKind, Region, XferState

__all__ = ["FakeBackend", "FakeWorld"]

_MAGIC = b"kvxfer-fake:"


class FakeWorld:
    """The agents that can reach one another (a stand-in for the network)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.agents: dict[str, "FakeBackend"] = {}


_DEFAULT_WORLD = FakeWorld()


@dataclass
class _Xfer:
    direction: Direction
    local: np.ndarray
    remote: np.ndarray
    peer: str
    notification: bytes
    state: XferState = XferState.PENDING
    error: KvxferError | None = None


class FakeBackend:
    """An in-process ``Backend`` (plus ``prepare``/``post_prepared``) with fault injection.

    Args:
        name: agent name, unique within ``world``.
        world: the set of reachable agents; the process-wide default when omitted.

    Raises:
        ConfigError: an empty name, or one already live in ``world``.
    """

    def __init__(self, name: str, world: FakeWorld | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"agent name must be a non-empty str; got {name!r}")
        self.name = name
        self._world = world or _DEFAULT_WORLD
        with self._world.lock:
            if name in self._world.agents:
                raise ConfigError(f"a FakeBackend named {name!r} is already live in this world")
            self._world.agents[name] = self
        self._ids = itertools.count(1)
        self._regs: dict[int, list[Region]] = {}
        self._peers: set[str] = set()
        self._preps: dict[int, tuple[str | None, np.ndarray, MemKind]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._held: list[int] = []
        self._inbox: list[tuple[str, bytes]] = []
        self._fail_next = 0
        self._hold = False
        self._closed = False
        self.posted = 0  #: transfers posted so far (for tests that count operations)

    # ---- fault injection -------------------------------------------------------------
    def fail_next(self, n: int = 1) -> None:
        """Make the next ``n`` posted transfers end FAILED (nothing copied, nothing notified)."""
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"n must be an int >= 0; got {n!r}")
        with self._world.lock:
            self._fail_next = n

    def hold_transfers(self, hold: bool) -> None:
        """While held, posted transfers stay PENDING; lifting the hold completes them in order."""
        with self._world.lock:
            self._check_open()
            self._hold = bool(hold)
            if not self._hold:
                held, self._held = self._held, []
                for xid in held:
                    if xid in self._xfers:
                        self._complete(self._xfers[xid])

    def kill(self) -> None:
        """Simulate this agent's crash: peers lose it; this object then acts closed."""
        with self._world.lock:
            if self._world.agents.get(self.name) is self:
                del self._world.agents[self.name]
            self._closed = True
            self._regs.clear()

    # ---- lifecycle -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"FakeBackend {self.name!r} is closed")

    def close(self) -> None:
        """Leave the world and drop registrations and transfers. Idempotent."""
        with self._world.lock:
            self.kill()
            self._xfers.clear()
            self._held.clear()
            self._preps.clear()
            self._peers.clear()

    def __enter__(self) -> "FakeBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- peers -----------------------------------------------------------------------
    def metadata(self) -> bytes:
        with self._world.lock:
            self._check_open()
            return _MAGIC + self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        """Load metadata from ``metadata()``; raises ConfigError for foreign bytes,
        PeerLostError when that agent is no longer in the world."""
        data = bytes(metadata) if isinstance(metadata, (bytes, bytearray, memoryview)) else b""
        if not data.startswith(_MAGIC) or len(data) == len(_MAGIC):
            raise ConfigError(f"expected FakeBackend metadata starting with {_MAGIC!r}; got {data[:32]!r}")
        name = data[len(_MAGIC):].decode()
        with self._world.lock:
            self._check_open()
            if name not in self._world.agents:
                raise PeerLostError(f"agent {name!r} is not reachable (closed or killed)")
            self._peers.add(name)
            return name

    def remove_peer(self, peer: str) -> None:
        with self._world.lock:
            self._check_open()
            self._peers.discard(peer)
            for pid in [i for i, p in self._preps.items() if p[0] == peer]:
                del self._preps[pid]

    def connect(self, peer: str, probe: object = None, timeout: float = 10.0) -> float:
        """Check ``peer`` is reachable (``probe`` and ``timeout`` are accepted as NixlBackend's; unused)."""
        self._reach(peer)
        return 0.0

    def _reach(self, peer: str) -> "FakeBackend":
        """The live peer object; ConfigError if never added, PeerLostError if gone."""
        self._check_open()
        if peer not in self._peers:
            raise ConfigError(f"unknown peer {peer!r}; known peers: {sorted(self._peers)}")
        other = self._world.agents.get(peer)
        if other is None or other._closed:
            raise PeerLostError(f"peer {peer!r} is gone (closed or killed)")
        return other

    # ---- memory ----------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> int:
        regions = check_regions(regions)
        with self._world.lock:
            self._check_open()
            hid = next(self._ids)
            self._regs[hid] = regions
            return hid

    def deregister(self, handle: object) -> None:
        with self._world.lock:
            self._check_open()
            if self._regs.pop(handle, None) is None:  # type: ignore[arg-type]
                raise ConfigError(f"unknown registration handle {handle!r}; live: {sorted(self._regs)}")

    def registered(self) -> list[Region]:
        """Every region this agent has registered now (tests use it to check deregistration)."""
        with self._world.lock:
            return [r for regs in self._regs.values() for r in regs]

    def _check_registered(self, table: np.ndarray, kind: MemKind, side: str) -> None:
        """Raise RegistrationError unless every row lies inside one registered region of ``kind``
        on the row's device."""
        kind = as_enum(MemKind, kind, f"{side} kind")
        regions = sorted((r for r in self.registered() if MemKind(r.kind) is kind),
                         key=lambda r: (r.device, r.addr))
        for device in np.unique(table[:, 2]):
            rows = table[table[:, 2] == device]
            mine = [r for r in regions if r.device == int(device)]
            starts = np.array([r.addr for r in mine], dtype=np.uint64)
            # With regions sorted by start, a row is inside one of them iff the furthest end
            # among regions starting at or before the row reaches the row's end.
            reach = np.maximum.accumulate(np.array([r.end for r in mine], dtype=np.uint64)) \
                if mine else np.zeros(0, np.uint64)
            pos = np.searchsorted(starts, rows[:, 0], side="right") - 1
            ok = pos >= 0
            ok[ok] = reach[pos[ok]] >= rows[ok, 0] + rows[ok, 1]
            if not ok.all():
                bad = rows[int(np.flatnonzero(~ok)[0])]
                raise RegistrationError(
                    f"{side} range [{int(bad[0]):#x}, +{int(bad[1])}) on {kind.value} device "
                    f"{int(device)} is not inside memory registered by agent {self.name!r}")

    # ---- transfers -------------------------------------------------------------------
    def post(self, direction: Direction, local: np.ndarray, local_kind: MemKind,
             remote: np.ndarray, remote_kind: MemKind, peer: str, notification: bytes) -> XferId:
        """Check both sides' registrations, then copy (see the module docstring for timing).

        Raises: ConfigError (bad descriptors, unknown peer), PeerLostError (peer killed/closed),
        RegistrationError (a range outside registered memory).
        """
        local, remote = check_pair(local, remote)
        local_kind = as_enum(MemKind, local_kind, "local_kind")
        remote_kind = as_enum(MemKind, remote_kind, "remote_kind")
        with self._world.lock:
            other = self._reach(peer)
            self._check_registered(local, local_kind, "local")
            other._check_registered(remote, remote_kind, "remote")
            xfer = _Xfer(as_enum(Direction, direction, "direction"), local, remote, peer,
                         bytes(notification))
            xid = next(self._ids)
            self._xfers[xid] = xfer
            self.posted += 1
            if self._fail_next:
                self._fail_next -= 1
                xfer.state = XferState.FAILED
                xfer.error = TransferFailedError(f"fake transfer {xid} to {peer!r}: injected failure")
            elif self._hold:
                self._held.append(xid)
            else:
                self._complete(xfer)
            return xid

    def prepare(self, peer: str | None, table: np.ndarray, kind: MemKind) -> int:
        """Keep a descriptor table for ``post_prepared`` (``peer=None``: local). Checks registration."""
        arr = check_pair(table, table)[0]
        with self._world.lock:
            owner = self if peer is None else self._reach(peer)
            self._check_open()
            owner._check_registered(arr, kind, "prepared")
            pid = next(self._ids)
            self._preps[pid] = (peer, arr, as_enum(MemKind, kind, "kind"))
            return pid

    def unprepare(self, prep: int) -> None:
        with self._world.lock:
            self._check_open()
            self._preps.pop(prep, None)

    def post_prepared(self, direction: Direction, local_prep: int, local_idx: np.ndarray,
                      remote_prep: int, remote_idx: np.ndarray, peer: str,
                      notification: bytes) -> XferId:
        """``post`` with rows picked from prepared tables (same checks as NixlBackend)."""
        with self._world.lock:
            self._check_open()
            lp, rp = self._preps.get(local_prep), self._preps.get(remote_prep)
            if lp is None or rp is None:
                missing = local_prep if lp is None else remote_prep
                raise ConfigError(f"unknown prepared list {missing!r}; live: {sorted(self._preps)}")
            if lp[0] is not None:
                raise ConfigError(f"local_prep {local_prep} was prepared for peer {lp[0]!r}; expected a local list")
            if rp[0] != peer:
                raise ConfigError(f"remote_prep {remote_prep} was prepared for {rp[0]!r}; expected {peer!r}")
            li = check_indices(local_idx, lp[1].shape[0], "local")
            ri = check_indices(remote_idx, rp[1].shape[0], "remote")
            if li.size != ri.size:
                raise ConfigError(f"local and remote index counts must match; got {li.size} and {ri.size}")
            return self.post(direction, lp[1][li], lp[2], rp[1][ri], rp[2], peer, notification)

    def _complete(self, xfer: _Xfer) -> None:
        other = self._world.agents.get(xfer.peer)
        if other is None or other._closed:
            xfer.state = XferState.FAILED
            xfer.error = PeerLostError(f"peer {xfer.peer!r} went away before the transfer ran")
            return
        src, dst = (xfer.remote, xfer.local) if xfer.direction is Direction.READ else (xfer.local, xfer.remote)
        for (s, n, _), (d, _, _) in zip(src.tolist(), dst.tolist()):
            ctypes.memmove(d, s, n)
        xfer.state = XferState.DONE
        if xfer.notification:
            other._inbox.append((self.name, xfer.notification))

    def state(self, xfer: XferId) -> XferState:
        with self._world.lock:
            self._check_open()
            entry = self._xfers.get(xfer)
            if entry is None:
                raise ConfigError(f"unknown transfer id {xfer!r}")
            return entry.state

    def failure(self, xfer: XferId) -> KvxferError | None:
        """Why a transfer FAILED (mirrors NixlBackend.failure), or None."""
        with self._world.lock:
            entry = self._xfers.get(xfer)
            return None if entry is None else entry.error

    def release(self, xfer: XferId) -> None:
        """Forget a transfer; a held (PENDING) one is cancelled. Releasing twice is harmless."""
        with self._world.lock:
            self._check_open()
            self._xfers.pop(xfer, None)
            if xfer in self._held:
                self._held.remove(xfer)

    # ---- notifications ---------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        with self._world.lock:
            self._reach(peer)._inbox.append((self.name, bytes(message)))

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._world.lock:
            self._check_open()
            out, self._inbox = self._inbox, []
            return out
