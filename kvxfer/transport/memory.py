"""An in-memory side-channel transport for tests (layer: transport; stdlib and kvxfer.protocol only, never zmq or sockets).

``MemoryTransport`` joins the agents of one process through a ``MemoryNetwork`` (a table of
listeners by host:port) instead of sockets, so agent tests need no ports. Frames still go
through the real sans-IO sessions and codec, byte for byte; only the wire is gone. A request is
answered at once, in the caller's thread (so requests on one channel are trivially multiplexed).
Closing a listener is a peer that died: requests then raise ``PeerLostError`` and channels that
spoke to it are ``stale()``; a new listener at the same address is a restarted peer that does
not know the old sessions (``Reject('state')``). Exported as ``kvxfer.testing.MemoryTransport``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

from kvxfer.errors import ClosedError, ConfigError, PeerLostError, ProtocolError
from kvxfer.protocol import DEFAULT_MAX_BYTES, PeerInfo, ServerSession, SessionState

__all__ = ["MemoryNetwork", "MemoryTransport"]


class MemoryNetwork:
    """Listeners by (host, port); shared by every ``MemoryTransport`` that should reach each other."""

    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], "MemoryListener"] = {}
        self._lock = threading.Lock()
        self._ports = itertools.count(20000)

    def bind(self, listener: "MemoryListener") -> int:
        with self._lock:
            port = listener.port
            if port == 0:
                port = next(p for p in self._ports if (listener.host, p) not in self._listeners)
            if (listener.host, port) in self._listeners:
                raise ConfigError(f"side channel cannot listen on {listener.host}:{port}: in use")
            self._listeners[(listener.host, port)] = listener
            return port

    def unbind(self, listener: "MemoryListener") -> None:
        with self._lock:
            if self._listeners.get((listener.host, listener.port)) is listener:
                del self._listeners[(listener.host, listener.port)]

    def lookup(self, host: str, port: int) -> "MemoryListener | None":
        with self._lock:
            return self._listeners.get((host, port))


class MemoryListener:
    """A listener on a ``MemoryNetwork``: one ``ServerSession`` per channel, as a ROUTER keeps one
    per identity (kept once handshaken)."""

    def __init__(self, network: MemoryNetwork, host: str, port: int,
                 make_session: Callable[[], ServerSession], max_bytes: int) -> None:
        self._network, self.host, self.port = network, host, port
        self._make_session, self._max_bytes = make_session, max_bytes
        self._sessions: dict[int, ServerSession] = {}
        self._lock = threading.Lock()
        self._started = self._closed = False
        self._rejected: dict[str, int] = {}
        self._frames = 0

    def start(self) -> tuple[str, int]:
        if self._closed:
            raise ClosedError("side channel server was closed")
        if not self._started:
            self.port = self._network.bind(self)
            self._started = True
        return self.host, self.port

    def handle(self, channel_id: int, frame: bytes) -> bytes:
        if len(frame) > self._max_bytes:
            raise PeerLostError(f"frame of {len(frame)} bytes over the listener's {self._max_bytes}: dropped")
        with self._lock:
            self._frames += 1
            session = self._sessions.get(channel_id)
            fresh = session is None
            session = session or self._make_session()
            before = session.rejected
            reply = session.receive(frame)
            if session.rejected != before:
                code = session.last_reject[0]
                self._rejected[code] = self._rejected.get(code, 0) + 1
            if fresh and session.state is SessionState.READY:
                self._sessions[channel_id] = session
            return reply

    def forget(self, channel_id: int) -> None:
        with self._lock:
            self._sessions.pop(channel_id, None)

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return [s.peer for s in self._sessions.values() if s.peer is not None]

    def counters(self) -> dict:
        with self._lock:
            return {"sessions": len(self._sessions), "frames": self._frames, "rejected": dict(self._rejected),
                    "evicted": 0, "refused": 0, "disconnected": 0}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 0.0) -> None:
        self._closed = True
        self._network.unbind(self)
        with self._lock:
            self._sessions.clear()


class _Answered:
    """A request already answered (or failed): ``reply()`` once."""

    def __init__(self, reply: bytes | None, error: Exception | None) -> None:
        self._reply, self._error, self._open = reply, error, True

    def reply(self) -> bytes:
        if not self._open:
            raise ProtocolError("this request's reply was already taken or cancelled")
        self._open = False
        if self._error is not None:
            raise self._error
        return self._reply

    def ready(self, wait: float = 0.0) -> bool:
        """Always True: the answer was made when the request was sent."""
        return True

    def cancel(self) -> None:
        self._open = False


class MemoryChannel:
    """A channel to one address of a ``MemoryNetwork`` (see ``kvxfer.transport.base.Channel``)."""

    _ids = itertools.count(1)

    def __init__(self, network: MemoryNetwork, host: str, port: int, max_bytes: int) -> None:
        self._network, self.host, self.port, self._max_bytes = network, host, port, max_bytes
        self.multiplexed = False
        self.generation = 0
        self._id = next(self._ids)
        self._peer: MemoryListener | None = None   # the listener this channel's session lives on
        self._closed = False

    def send(self, frame: bytes, timeout: float) -> _Answered:
        if self._closed:
            raise ClosedError(f"side channel client for {self.host}:{self.port} was closed")
        if len(frame) > self._max_bytes:
            raise ProtocolError(f"frame too large: expected <= {self._max_bytes} bytes; got {len(frame)}")
        listener = self._network.lookup(self.host, self.port)
        if listener is None:
            return _Answered(None, PeerLostError(f"side channel {self.host}:{self.port}: nobody listens there"))
        self._peer = self._peer or listener
        try:
            return _Answered(listener.handle(self._id, frame), None)
        except PeerLostError as exc:
            return _Answered(None, exc)

    def try_send(self, frame: bytes, timeout: float) -> None:
        """Never: ``send`` runs the listener's handler on the calling thread, which may wait."""
        return None

    def request(self, frame: bytes, timeout: float) -> bytes:
        return self.send(frame, timeout).reply()

    def stale(self) -> bool:
        """The listener this channel spoke to closed, or another one took its address."""
        if self._closed:
            return True
        if self._peer is None:
            return False
        return self._peer.closed or self._network.lookup(self.host, self.port) is not self._peer

    def close(self) -> None:
        self._closed = True
        if self._peer is not None:
            self._peer.forget(self._id)


class MemoryTransport:
    """``kvxfer.transport.base.Transport`` without sockets: pass the same ``network`` to every
    agent that should reach the others (``Agent(..., transport=MemoryTransport(network))``)."""

    def __init__(self, network: MemoryNetwork | None = None) -> None:
        self.network = network or MemoryNetwork()

    def listener(self, host: str, port: int, make_session: Callable[[], ServerSession], *,
                 max_bytes: int = DEFAULT_MAX_BYTES, pinned=None, authenticated=None,
                 express_port: int | None = None) -> MemoryListener:
        """A listener in ``network`` (``express_port`` is ignored: requests are answered in the caller's thread)."""
        return MemoryListener(self.network, host, port, make_session, max_bytes)

    def channel(self, host: str, port: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> MemoryChannel:
        return MemoryChannel(self.network, host, int(port), max_bytes)
