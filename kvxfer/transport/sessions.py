"""The side-channel server's bounded session table and rate-limited hostile-input log (layer: transport; stdlib and kvxfer.protocol only, never zmq or sockets).

A ``SessionTable`` keeps one ``ServerSession`` per handshaken client identity, bounded twice:
at most ``per_address`` sessions per client address and ``max_sessions`` in all. When a new
session would pass a bound, one session is evicted, chosen in this order:

1. never a *pinned* session (``pinned(session)`` is true: e.g. its consumer has claims in flight);
2. first a session that has only said Hello (never sent a request: unproven, as a flood's are),
   the least recently active first;
3. then the least recently active session.

If every candidate is pinned the new session is refused (the caller answers ``Reject('busy')``)
and nothing is evicted. A session is removed at once when its client disconnects, so its memory
is returned (the transport reports the connection's socket closing). ``LogLimiter`` writes at most one line per reason per interval, with a count of what
it held back, so hostile input cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvxfer.protocol import ServerSession

__all__ = ["LogLimiter", "SessionTable"]


@dataclass
class _Entry:
    session: ServerSession
    address: str
    fd: int = -1                      # the connection's socket, to drop the session when it closes
    requests: int = 0                 # requests answered after the handshake
    last_active: float = field(default_factory=time.monotonic)


class SessionTable:
    """Handshaken sessions by client identity, bounded per address and in all. Not thread-safe:
    the server's one thread owns it (``snapshot`` copies are taken under the server's lock).

    Args:
        max_sessions: sessions kept in all.
        per_address: sessions kept per client address (``""`` when the transport cannot tell).
        pinned: sessions this returns True for are never evicted.
    """

    def __init__(self, max_sessions: int = 4096, per_address: int = 256,
                 pinned: Callable[[ServerSession], bool] | None = None) -> None:
        if max_sessions < 1 or per_address < 1:
            raise ValueError(f"session bounds must be >= 1; got {max_sessions}, {per_address}")
        self.max_sessions, self.per_address = max_sessions, per_address
        self._pinned = pinned or (lambda session: False)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()   # least recently active first
        self._by_address: dict[str, OrderedDict[bytes, None]] = {}
        self._by_fd: dict[int, set[bytes]] = {}
        self.evicted = 0
        self.refused = 0
        self.disconnected = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, identity: bytes) -> ServerSession | None:
        entry = self._entries.get(identity)
        return entry.session if entry is not None else None

    def sessions(self) -> list[ServerSession]:
        """Every session, least recently active first."""
        return [e.session for e in self._entries.values()]

    def touch(self, identity: bytes, request: bool) -> None:
        """Mark ``identity`` active now (``request``: it sent a request, not a Hello)."""
        entry = self._entries.get(identity)
        if entry is None:
            return
        entry.last_active = time.monotonic()
        entry.requests += request
        self._entries.move_to_end(identity)
        self._by_address[entry.address].move_to_end(identity)

    def add(self, identity: bytes, address: str, session: ServerSession, fd: int = -1) -> bool:
        """Keep a freshly handshaken session, evicting one if a bound is reached.

        Returns False (keeping nothing) when a bound is reached and every candidate is pinned.
        """
        peers = self._by_address.get(address)
        if peers is not None and len(peers) >= self.per_address:
            if not self._evict_one(list(peers)):
                self.refused += 1
                return False
        if len(self._entries) >= self.max_sessions:
            if not self._evict_one(list(self._entries)):
                self.refused += 1
                return False
        self._entries[identity] = _Entry(session, address, fd)
        self._by_address.setdefault(address, OrderedDict())[identity] = None
        if fd >= 0:
            self._by_fd.setdefault(fd, set()).add(identity)
        return True

    def disconnect(self, fd: int) -> int:
        """The connection on socket ``fd`` closed: forget its sessions. Returns how many."""
        identities = self._by_fd.pop(fd, set())
        return sum(self.remove(identity, disconnected=True) for identity in identities)

    def remove(self, identity: bytes, disconnected: bool = False) -> bool:
        """Forget ``identity``'s session (its client went away or it was evicted), dropping its
        peer's ``PeerInfo`` at once. Returns whether one was kept."""
        entry = self._entries.pop(identity, None)
        if entry is None:
            return False
        entry.session.forget_peer()  # freed now even if something still holds the session
        peers = self._by_address[entry.address]
        del peers[identity]
        if not peers:
            del self._by_address[entry.address]
        linked = self._by_fd.get(entry.fd)
        if linked is not None:
            linked.discard(identity)
            if not linked:
                del self._by_fd[entry.fd]
        self.disconnected += disconnected
        return True

    def _evict_one(self, candidates: list[bytes]) -> bool:
        """Evict the first unpinned Hello-only candidate, else the first unpinned one."""
        fallback = None
        for identity in candidates:  # least recently active first
            entry = self._entries[identity]
            if self._pinned(entry.session):
                continue
            if entry.requests == 0:
                fallback = identity
                break
            if fallback is None:
                fallback = identity
        if fallback is None:
            return False
        self.remove(fallback)
        self.evicted += 1
        return True


class LogLimiter:
    """One log line per reason per ``interval`` seconds; the next line says how many were held back.

    Args:
        logger: where lines go.
        interval: seconds between two lines of one reason.
        clock: seconds, monotonic (tests pass their own).
        level: the lines' level (WARNING: hostile input; INFO: refusals a peer may cause at will).
        prefix: what every line starts with.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, level: int = logging.WARNING,
                 prefix: str = "side channel") -> None:
        self._log, self._interval, self._clock = logger, interval, clock
        self._level, self._prefix = level, prefix
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()   # every event by reason, logged or not

    def event(self, reason: str, detail: str) -> None:
        """Count one event of ``reason``; log it (``detail`` cut to 200 characters) unless one
        of the same reason was logged less than ``interval`` seconds ago."""
        self.counts[reason] += 1
        now = self._clock()
        if now < self._next.get(reason, float("-inf")):
            self._held[reason] += 1
            return
        self._next[reason] = now + self._interval
        held = self._held.pop(reason, 0)
        more = f" ({held} more since the last line of this reason)" if held else ""
        text = detail if len(detail) <= 200 else detail[:197] + "..."
        self._log.log(self._level, "%s: %s: %s%s", self._prefix, reason, text, more)
