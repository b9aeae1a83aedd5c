"""ZMQ side channel: one ROUTER listener per agent and one DEALER client per remote agent (layer: transport; the only kvxfer module that imports zmq; imports kvxfer.protocol, errors and types, never nixl).

This module moves opaque frames; every decision about their content is made by the sans-IO
sessions in ``kvxfer.protocol``. The server runs one daemon thread that owns its socket;
the client is used under a lock, one request in flight at a time, each with a deadline.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import math
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxfer.errors import (
    ClosedError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    TransferTimeoutError,
)
from kvxfer.protocol import DEFAULT_MAX_BYTES, PeerInfo, ServerSession
from kvxfer.transport.sessions import LogLimiter, SessionTable

__all__ = ["PendingReply", "SideChannelClient", "SideChannelServer", "is_loopback"]

log = logging.getLogger(__name__)

_POLL_MS = 50  # how often the server thread checks for close(); not a correctness bound
_context_lock = threading.Lock()
_context: zmq.Context | None = None
_monitor_ids = itertools.count()  # unique inproc names, even when a socket's fd is reused


def _shared_context() -> zmq.Context:
    """One private context for kvxfer's sockets (one I/O thread), never terminated."""
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            _context = zmq.Context()
        return _context


def _endpoint(host: str, port: int | str) -> str:
    if not isinstance(host, str) or not host:
        raise ConfigError(f"side channel host must be a non-empty string; got {host!r}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check_port(port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"side channel port must be an integer in [0, 65535]; got {port!r}")
    return port


class SideChannelServer:
    """A ROUTER socket bound at ``tcp://host:port``, served by one daemon thread.

    Each client identity gets its own ``ServerSession`` from ``make_session``. A session is
    kept only once its client has completed a handshake, so hostile frames from new
    identities leave the table untouched. Kept sessions are bounded (``SessionTable``: per
    client address and in all; Hello-only and idle sessions are evicted first, never a
    ``pinned`` one) and dropped as soon as their connection closes (the socket monitor's
    DISCONNECTED event names the connection's socket), so their memory is returned. ZMQ itself drops a connection that sends a frame over ``max_bytes``.
    Rejected frames are counted by reason and logged at most once per reason per ``log_interval``.

    Args:
        host, port: where to listen; port 0 picks an ephemeral port.
        make_session: builds a fresh ``ServerSession``.
        max_bytes: largest frame the socket accepts.
        max_clients: handshaken sessions kept in all.
        per_address: handshaken sessions kept per client IP address.
        pinned: sessions it returns True for are never evicted (e.g. claims in flight).
        authenticated: whether frames carry an HMAC (``Codec.authenticated``); ``False`` on a
            non-loopback address logs one warning at ``start``. ``None``: unknown, no warning.
        log_interval: seconds between two log lines of one rejection reason.
    """

    def __init__(self, host: str, port: int, make_session: Callable[[], ServerSession],
                 max_bytes: int = DEFAULT_MAX_BYTES, max_clients: int = 4096, per_address: int = 256,
                 pinned: Callable[[ServerSession], bool] | None = None,
                 authenticated: bool | None = None, log_interval: float = 10.0):
        _endpoint(host, _check_port(port))
        self.host, self.port = host, port
        self._make_session = make_session
        self._max_bytes = max_bytes
        self._table = SessionTable(max_clients, per_address, pinned)
        self._limiter = LogLimiter(log, log_interval)
        self._authenticated = authenticated
        self._frames = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._closed = False

    def start(self) -> tuple[str, int]:
        """Bind and start serving; returns the bound ``(host, port)``.

        Raises:
            ConfigError: the address cannot be bound (names host:port; e.g. port taken).
            ClosedError: after ``close()``.
        """
        if self._closed:
            raise ClosedError("side channel server was closed")
        if self._thread is not None:
            return self.host, self.port
        sock = _shared_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(_endpoint(self.host, self.port or "*"))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(
                f"side channel cannot listen on {self.host}:{self.port}: {exc.strerror} "
                "(is another agent on this port? set KVXFER_SIDE_CHANNEL_PORT or pass another port)"
            ) from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(bound.rsplit(":", 1)[1])
        address = f"inproc://kvxfer-server-monitor-{next(_monitor_ids)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        self._monitor = _shared_context().socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._sock = sock
        self._thread = threading.Thread(
            target=self._serve, name=f"kvxfer-side-channel:{self.port}", daemon=True
        )
        self._thread.start()
        log.info("side channel listening on %s", bound)
        if self._authenticated is False and not is_loopback(self.host):
            log.warning(
                "side channel listening on %s without a shared key: anyone who can reach this address "
                "may handshake, claim, heartbeat or abort requests; set AgentConfig.auth_key (env "
                "KVXFER_AUTH_KEY) on every agent. The key authenticates side-channel frames only, "
                "not NIXL's data path", bound)
        return self.host, self.port

    def peers(self) -> list[PeerInfo]:
        """PeerInfo of every handshaken client, most recently active last."""
        with self._lock:
            return [s.peer for s in self._table.sessions() if s.peer is not None]

    def counters(self) -> dict:
        """Counts for metrics: ``sessions`` kept now, ``frames`` received, ``rejected`` frames by
        reason (a ``Reject`` code, or ``parts`` for a message of the wrong shape), sessions
        ``evicted``, ``refused`` (table full of pinned sessions) and ``disconnected``."""
        with self._lock:
            return {"sessions": len(self._table), "frames": self._frames,
                    "rejected": dict(self._limiter.counts), "evicted": self._table.evicted,
                    "refused": self._table.refused, "disconnected": self._table.disconnected}

    def _serve(self) -> None:
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                # Disconnects first: a socket number may be reused by the next connection.
                self._drain_disconnects(monitor)
                while True:  # drain everything that is ready
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(sock, parts)
        except Exception:  # the listener dying silently would strand every client
            log.exception("side channel server on port %s stopped", self.port)
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
            monitor.close(linger=0)

    def _drain_disconnects(self, monitor: zmq.Socket) -> None:
        """Forget the sessions of every connection that closed (their memory is returned)."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                with self._lock:
                    self._table.disconnect(int(event["value"]))

    def _handle(self, sock: zmq.Socket, frames: list) -> None:
        """Answer one message; keep the session once it has handshaken (see the class docstring)."""
        parts = [f.bytes for f in frames]
        identity = parts[0]
        with self._lock:
            self._frames += 1
        if len(parts) == 2:          # DEALER client: [identity, frame]
            envelope, frame = parts[:1], parts[1]
        elif len(parts) == 3 and parts[1] == b"":  # REQ client: [identity, b"", frame]
            envelope, frame = parts[:2], parts[2]
        else:
            self._rejected("parts", f"dropped a message of {len(parts)} parts")
            return
        with self._lock:
            session = self._table.get(identity)
        fresh = session is None
        if fresh:
            session = self._make_session()
        before = session.rejected
        reply = session.receive(frame)
        if session.rejected != before:
            self._rejected(session.last_reject[0], session.last_reject[1])
        if fresh and session.state == "ready":
            address, fd = _peer_of(frames[-1])
            with self._lock:
                kept = self._table.add(identity, address, session, fd)
            if not kept:
                reply = session.refuse_busy("every session this server may keep is in use")
                self._rejected("busy", "a handshake was refused: every session is pinned by claims in flight")
        elif not fresh:
            with self._lock:
                self._table.touch(identity, request=session.state == "ready" and session.rejected == before)
        try:
            sock.send_multipart([*envelope, reply], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went away or its queue is full
            self._rejected("unsent", f"reply not sent: {exc}")

    def _rejected(self, reason: str, detail: str) -> None:
        with self._lock:
            self._limiter.event(reason, detail)

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving and join the thread (waits at most ``timeout`` s); idempotent."""
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("side channel thread did not stop within %.1f s", timeout)

    def __enter__(self) -> "SideChannelServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peer_of(frame) -> tuple[str, int]:
    """The client's IP address and our socket's number for its connection, as ZMQ reports them
    for a received frame (``""`` and -1 when it cannot tell)."""
    try:
        return frame.get("Peer-Address") or "", int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "", -1


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (``0.0.0.0`` and ``::`` are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class SideChannelClient:
    """Request/response to one remote agent's side channel over a DEALER socket.

    Thread-safe: requests are serialised by a lock. After a failed request the socket is
    discarded, so a late reply can never be taken for the answer to a later request.

    Args:
        host, port: the remote listener.
        max_bytes: largest reply accepted; ZMQ drops a connection that sends more.
    """

    def __init__(self, host: str, port: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.endpoint = _endpoint(host, _check_port(port))
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._connected = False
        self._dropped = False
        self._ever_dropped = False  # sticky until the socket is replaced: see ``stale``
        self._closed = False
        self.generation = 0  # bumped whenever the socket (and so our identity at the server) is replaced

    def stale(self) -> bool:
        """Whether a session handshaken on this client may be gone at the server: its socket was
        replaced (a new identity the server never saw) or its connection dropped since (the peer
        may have restarted; ZMQ reconnects silently). Never blocks; False before the first request."""
        if self._closed:
            return True
        if not self._lock.acquire(blocking=False):
            return False  # a request is in flight: it will find out itself
        try:
            self._drain_monitor()
            return self._ever_dropped
        finally:
            self._lock.release()

    def _ensure(self) -> zmq.Socket:
        if self._sock is None:
            sock = _shared_context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            if self.endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            address = f"inproc://kvxfer-monitor-{next(_monitor_ids)}"
            sock.monitor(address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._monitor = _shared_context().socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            sock.connect(self.endpoint)
            self._sock, self._connected, self._dropped = sock, False, False
        return self._sock

    def _drain_monitor(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._dropped = self._dropped or self._connected
                self._ever_dropped = self._ever_dropped or self._connected
                self._connected = False

    def _reset(self) -> None:
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._sock is not None or self._monitor is not None:
            self.generation += 1
        self._sock = self._monitor = None
        self._connected = self._dropped = self._ever_dropped = False

    def request(self, frame: bytes, timeout: float) -> bytes:
        """Send ``frame`` and return the reply frame, within ``timeout`` seconds.

        Raises:
            PeerLostError: nobody accepted the connection by the deadline, or the
                connection dropped while waiting (peer died or restarted).
            TransferTimeoutError: connected, but no reply by the deadline.
            ProtocolError: ``frame`` is larger than ``max_bytes``, or the reply has extra parts.
            ClosedError: after ``close()``.
            ConfigError: ``timeout`` is not a positive finite number.
        """
        return self.send(frame, timeout).reply()

    def send(self, frame: bytes, timeout: float) -> "PendingReply":
        """Send ``frame`` now and return at once; ``reply()`` on the result waits for the answer.

        The caller can work while the request travels. The channel stays held until the reply
        is taken or ``cancel()`` is called: other requests on this client wait until then.
        ``timeout`` counts from this call. Raises as ``request`` does for what fails before the
        reply is awaited.
        """
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds; got {timeout!r}")
        if len(frame) > self._max_bytes:
            raise ProtocolError(f"frame too large: expected <= {self._max_bytes} bytes; got {len(frame)}")
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise TransferTimeoutError(
                f"side channel {self.endpoint}: another request held the channel for {timeout} s"
            )
        try:
            self._send_locked(frame)
        except BaseException:
            self._lock.release()
            raise
        return PendingReply(self, timeout, deadline)

    def _send_locked(self, frame: bytes) -> None:
        if self._closed:
            raise ClosedError(f"side channel client for {self.endpoint} was closed")
        sock = self._ensure()
        self._drain_monitor()
        self._dropped = False  # a drop before this request is healed by ZMQ's reconnect
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._reset()
            raise PeerLostError(f"side channel {self.endpoint}: cannot send: {exc}") from None

    def _await_locked(self, timeout: float, deadline: float) -> bytes:
        sock = self._sock
        if sock is None:  # closed since the send
            raise ClosedError(f"side channel client for {self.endpoint} was closed")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while (remaining := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, math.ceil(remaining * 1000))))
            if self._monitor in ready:
                self._drain_monitor()
                if self._dropped:
                    self._reset()
                    raise PeerLostError(
                        f"side channel {self.endpoint}: connection dropped while waiting for a reply"
                    )
            if sock in ready:
                parts = sock.recv_multipart()
                if len(parts) != 1:
                    self._reset()
                    raise ProtocolError(f"reply: expected 1 frame; got {len(parts)} parts")
                return parts[0]
        self._drain_monitor()
        connected = self._connected
        self._reset()
        if connected:
            raise TransferTimeoutError(f"side channel {self.endpoint}: no reply within {timeout} s")
        raise PeerLostError(
            f"side channel {self.endpoint}: no connection within {timeout} s (is the peer running?)"
        )

    def close(self) -> None:
        """Discard the socket; later requests raise ClosedError. Idempotent."""
        with self._lock:
            self._closed = True
            self._reset()

    def __enter__(self) -> "SideChannelClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingReply:
    """A request ``SideChannelClient.send`` sent; it holds the client until finished."""

    def __init__(self, client: SideChannelClient, timeout: float, deadline: float) -> None:
        self._client, self._timeout, self._deadline = client, timeout, deadline
        self._open = True

    def reply(self) -> bytes:
        """Wait for the reply frame (raises as ``SideChannelClient.request``); once only."""
        if not self._open:
            raise ProtocolError("this request's reply was already taken or cancelled")
        try:
            return self._client._await_locked(self._timeout, self._deadline)
        finally:
            self._finish()

    def cancel(self) -> None:
        """Give the reply up: the socket is discarded, so it can never answer a later request."""
        if self._open:
            try:
                self._client._reset()
            finally:
                self._finish()

    def _finish(self) -> None:
        self._open = False
        self._client._lock.release()
