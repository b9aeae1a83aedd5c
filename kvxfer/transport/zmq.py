"""ZMQ side channel: one ROUTER listener per agent (layer: transport; with ``zmq_client`` the only kvxfer modules that import zmq; imports kvxfer.protocol, errors and types, never nixl).

This module moves opaque frames; every decision about their content is made by the sans-IO
sessions in ``kvxfer.protocol``. The server runs one daemon thread that owns its socket. The
client (one DEALER per remote agent, requests multiplexed by id) lives in ``zmq_client`` and is
re-exported here.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxfer.errors import ClosedError, ConfigError
from kvxfer.protocol import DEFAULT_MAX_BYTES, PeerInfo, ServerSession, SessionState
from kvxfer.transport.express_server import ExpressPort
from kvxfer.transport.sessions import LogLimiter, SessionTable
from kvxfer.transport.zmq_client import (
    MUX_HEADER, MUX_MAGIC, PendingReply, SideChannelClient, check_port, endpoint, monitor_ids, shared_context,
)

__all__ = ["PendingReply", "SideChannelClient", "SideChannelServer", "ZmqTransport", "is_loopback"]

log = logging.getLogger(__name__)

_POLL_MS = 50  # how often the server thread checks for close(); not a correctness bound


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
        express_port: also listen for express lanes on this port of ``host`` (0: ephemeral;
            None: no lane, every request on ZMQ); see ``kvxfer.transport.express``. The bound
            port is ``express_port`` after ``start`` (0 when off).
    """

    def __init__(self, host: str, port: int, make_session: Callable[[], ServerSession],
                 max_bytes: int = DEFAULT_MAX_BYTES, max_clients: int = 4096, per_address: int = 256,
                 pinned: Callable[[ServerSession], bool] | None = None,
                 authenticated: bool | None = None, log_interval: float = 10.0,
                 express_port: int | None = None):
        endpoint(host, check_port(port))
        self._express_wanted = None if express_port is None else check_port(express_port)
        self._express: ExpressPort | None = None
        self.express_port = 0
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
        sock = shared_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint(self.host, self.port or "*"))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(
                f"side channel cannot listen on {self.host}:{self.port}: {exc.strerror} "
                "(is another agent on this port? set KVXFER_SIDE_CHANNEL_PORT or pass another port)"
            ) from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(bound.rsplit(":", 1)[1])
        if self._express_wanted is not None:
            try:
                self._express = ExpressPort(self.host, self._express_wanted, self._max_bytes, self._answer_known,
                                            self._known, self._rejected, max_connections=self._table.max_sessions)
            except ConfigError:
                sock.close(linger=0)
                raise
            self.express_port = self._express.port
        address = f"inproc://kvxfer-server-monitor-{next(monitor_ids)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        self._monitor = shared_context().socket(zmq.PAIR)
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
                    "express": self._express.connections() if self._express is not None else 0,
                    "rejected": dict(self._limiter.counts), "evicted": self._table.evicted,
                    "refused": self._table.refused, "disconnected": self._table.disconnected}

    def _serve(self) -> None:
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        express = self._express
        if express is not None:
            express.register(poller)
        try:
            while not self._stop.is_set():
                events = poller.poll(_POLL_MS)
                if express is not None:
                    express.sweep(poller)
                    for fd, flags in events:
                        if isinstance(fd, int) and express.owns(fd):
                            express.handle(fd, flags, poller)
                # Only the sockets the poll named: a request on an express lane wakes this
                # thread without a ROUTER frame or a monitor event to read.
                ready = {item for item, _ in events if not isinstance(item, int)}
                if monitor in ready:  # disconnects first: a socket number may be reused next
                    self._drain_disconnects(monitor)
                if sock not in ready:
                    continue
                while True:  # drain everything that is ready
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(sock, parts)
        except Exception:  # the listener dying silently would strand every client
            log.exception("side channel server on port %s stopped", self.port)
        finally:
            if express is not None:
                express.close(poller)
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
        if len(parts) == 2:          # DEALER client, one request at a time: [identity, frame]
            envelope, frame = parts[:1], parts[1]
        elif len(parts) == 3 and parts[1] == b"":  # REQ client: [identity, b"", frame]
            envelope, frame = parts[:2], parts[2]
        else:
            self._rejected("parts", f"dropped a message of {len(parts)} parts")
            return
        mux = b""
        if frame[:len(MUX_MAGIC)] == MUX_MAGIC and len(frame) >= MUX_HEADER:  # multiplexed: id, frame
            mux, frame = frame[:MUX_HEADER], frame[MUX_HEADER:]
        with self._lock:
            session = self._table.get(identity)
        if session is not None:
            reply = self._answer(identity, session, frame)
        else:
            session = self._make_session()
            reply, _ = self._receive(session, frame)
            if session.state is SessionState.READY:
                address, fd = _peer_of(frames[-1])
                with self._lock:
                    kept = self._table.add(identity, address, session, fd)
                if not kept:
                    reply = session.refuse_busy("every session this server may keep is in use")
                    self._rejected("busy", "a handshake was refused: every session is pinned by claims in flight")
        try:
            sock.send_multipart([*envelope, mux + reply], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went away or its queue is full
            self._rejected("unsent", f"reply not sent: {exc}")

    def _receive(self, session: ServerSession, frame: bytes) -> tuple[bytes, bool]:
        """``session``'s reply to one frame, and whether it took the frame (a refusal is counted)."""
        before = session.rejected
        reply = session.receive(frame)
        if session.rejected != before:
            self._rejected(session.last_reject[0], session.last_reject[1])
        return reply, session.rejected == before

    def _answer(self, identity: bytes, session: ServerSession, frame: bytes) -> bytes:
        """A kept session's reply to one frame (from ZMQ or its express lane)."""
        reply, taken = self._receive(session, frame)
        with self._lock:
            self._table.touch(identity, request=session.state is SessionState.READY and taken)
        return reply

    def _answer_known(self, identity: bytes, frame: bytes) -> bytes | None:
        """An express lane's frame: answered by its session, or None when that session is gone."""
        with self._lock:
            self._frames += 1
            session = self._table.get(identity)
        return None if session is None else self._answer(identity, session, frame)

    def _known(self, identity: bytes) -> bool:
        with self._lock:
            return self._table.get(identity) is not None

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


class ZmqTransport:
    """The real side-channel transport (``kvxfer.transport.base.Transport``): ZMQ over TCP."""

    def listener(self, host: str, port: int, make_session: Callable[[], ServerSession], *,
                 max_bytes: int = DEFAULT_MAX_BYTES, pinned: Callable[[ServerSession], bool] | None = None,
                 authenticated: bool | None = None, express_port: int | None = None) -> SideChannelServer:
        return SideChannelServer(host, port, make_session, max_bytes=max_bytes, pinned=pinned,
                                 authenticated=authenticated, express_port=express_port)

    def channel(self, host: str, port: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> SideChannelClient:
        return SideChannelClient(host, port, max_bytes=max_bytes)
