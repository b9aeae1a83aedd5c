"""The server end of the express lane (layer: transport; stdlib and kvxfer.transport.express only, never zmq or nixl).

``ExpressPort`` is a listening TCP socket and its connections, driven by the side-channel
server's one thread: the server polls the sockets ``ExpressPort`` registers and hands every
ready one to ``handle``. Nothing here decides what a frame means: an attached connection's
frames go to ``answer(identity, payload)``, which runs the session's sans-IO ``ServerSession``.

Bounds, so a hostile client costs little: at most ``max_connections`` connections (and at most a
quarter of the process's file-descriptor limit; more are closed at once, and a failed ``accept``
pauses listening for 0.1 s rather than spinning), a connection that has not attached within ``attach_timeout`` seconds is
closed, a frame over ``max_bytes`` closes its connection (before it attaches: a frame longer than
an attach), and a client that stops reading its
replies is closed once ``4 * max_bytes`` of them wait. A connection whose session is gone
(evicted, its ZMQ connection closed) is closed on its next frame, so its client handshakes anew.
"""

from __future__ import annotations

import resource
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from kvxfer.errors import ConfigError, ProtocolError
from kvxfer.transport.express import ATTACH, ATTACHED, FrameReader, frame

__all__ = ["ExpressPort"]

POLLIN, POLLOUT = 1, 4  # the values zmq.Poller and select.poll share
_RECV_BYTES = 1 << 16  # below malloc's mmap threshold: a larger recv buffer costs a map and unmap per call
#: The largest frame a connection may send before it attaches (an attach: ATTACH and a ZMQ routing
#: id, at most 255 bytes): a crowd of unattached connections buffers little, not ``max_bytes`` each.
_ATTACH_BYTES = len(ATTACH) + 256


@dataclass
class _Conn:
    sock: socket.socket
    reader: FrameReader
    opened: float = field(default_factory=time.monotonic)
    identity: bytes | None = None
    out: bytearray = field(default_factory=bytearray)
    pollout: bool = False  # registered for POLLOUT (replies are waiting for room in the socket)


class ExpressPort:
    """A listening TCP socket for express lanes (see the module docstring).

    Args:
        host, port: where to listen (port 0: ephemeral; ``port`` then names the bound one).
        max_bytes: largest frame accepted.
        answer: ``answer(identity, payload)``: the reply to a request of the session ``identity``,
            or None when that session is gone (the connection is then closed).
        known: whether a session of that routing id is kept now (the attach check).
        rejected: ``rejected(reason, detail)`` counts and logs a refused connection or frame.
        max_connections, attach_timeout: the bounds above.

    Raises:
        ConfigError: host:port cannot be bound.
    """

    def __init__(self, host: str, port: int, max_bytes: int, answer: Callable[[bytes, bytes], bytes | None],
                 known: Callable[[bytes], bool], rejected: Callable[[str, str], None], *,
                 max_connections: int = 4096, attach_timeout: float = 10.0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(256)
        except OSError as exc:
            listener.close()
            raise ConfigError(f"express lane cannot listen on {host}:{port}: {exc.strerror or exc} "
                              "(set AgentConfig.express_port to another port, or None to turn the lane off)") from None
        listener.setblocking(False)
        self.host, self.port = host, listener.getsockname()[1]
        self._listener = listener
        self._max_bytes = max_bytes
        self._answer, self._known, self._rejected = answer, known, rejected
        # never so many that the process runs out of file descriptors (the side channel, NIXL
        # and the engine need theirs too)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            max_connections = min(max_connections, max(16, soft // 4))
        self._max_connections, self._attach_timeout = max_connections, attach_timeout
        self._paused_until = 0.0  # accept() failed (e.g. no descriptor left): listen again then
        self._conns: dict[int, _Conn] = {}
        self._unattached: dict[int, _Conn] = {}

    def register(self, poller) -> None:
        """Register the listening socket with ``poller`` (a ``zmq.Poller`` or alike)."""
        poller.register(self._listener.fileno(), POLLIN)

    def owns(self, fd: int) -> bool:
        return fd == self._listener.fileno() or fd in self._conns

    def handle(self, fd: int, events: int, poller) -> None:
        """Serve one ready socket: accept, read and answer frames, or write what waits."""
        if fd == self._listener.fileno():
            self._accept(poller)
            return
        conn = self._conns.get(fd)
        if conn is None:
            return
        if events & POLLOUT:
            self._flush(fd, conn, poller)
        if events & ~POLLOUT and fd in self._conns:
            self._read(fd, conn, poller)

    def sweep(self, poller) -> None:
        """Close connections that did not attach within ``attach_timeout``; listen again after a
        pause that a failed ``accept`` started."""
        if self._paused_until and time.monotonic() >= self._paused_until:
            self._paused_until = 0.0
            poller.register(self._listener.fileno(), POLLIN)
        if not self._unattached:
            return
        limit = time.monotonic() - self._attach_timeout
        for fd, conn in list(self._unattached.items()):
            if conn.opened < limit:
                self._rejected("express-attach", "closed an express connection that never attached")
                self._drop(fd, poller)

    def connections(self) -> int:
        return len(self._conns)

    def _accept(self, poller) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: stop listening for 0.1 s, or
                self._rejected("express-accept", f"accept failed: {exc}")  # the poll would spin
                poller.unregister(self._listener.fileno())
                self._paused_until = time.monotonic() + 0.1
                return
            if len(self._conns) >= self._max_connections:
                self._rejected("express-full", f"closed an express connection: {self._max_connections} open")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, FrameReader(min(_ATTACH_BYTES, self._max_bytes)))
            fd = sock.fileno()
            self._conns[fd] = self._unattached[fd] = conn
            poller.register(fd, POLLIN)

    def _read(self, fd: int, conn: _Conn, poller) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(fd, poller)
            return
        try:
            frames = conn.reader.feed(data)
        except ProtocolError as exc:
            self._rejected("express-size", f"closed an express connection: {exc}")
            self._drop(fd, poller)
            return
        for request_id, payload in frames:
            if conn.identity is None:
                identity = payload[len(ATTACH):]
                if request_id != 0 or payload[:len(ATTACH)] != ATTACH or not self._known(identity):
                    self._rejected("express-attach", "closed an express connection: it named no session kept here")
                    self._drop(fd, poller)
                    return
                conn.identity = identity
                conn.reader.allow(self._max_bytes)
                del self._unattached[fd]
                reply = ATTACHED
            else:
                reply = self._answer(conn.identity, payload)
                if reply is None:  # the session is gone: the client handshakes again
                    self._drop(fd, poller)
                    return
            conn.out += frame(request_id, reply)
        self._flush(fd, conn, poller)

    def _flush(self, fd: int, conn: _Conn, poller) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(fd, poller)
                return
            del conn.out[:sent]
        if len(conn.out) > 4 * self._max_bytes:
            self._rejected("express-unread", "closed an express connection whose client stopped reading")
            self._drop(fd, poller)
            return
        if bool(conn.out) != conn.pollout:  # the poller is told only when that changes
            conn.pollout = bool(conn.out)
            poller.modify(fd, POLLIN | POLLOUT if conn.pollout else POLLIN)

    def _drop(self, fd: int, poller) -> None:
        conn = self._conns.pop(fd, None)
        self._unattached.pop(fd, None)
        if conn is None:
            return
        try:
            poller.unregister(fd)
        except KeyError:
            pass
        conn.sock.close()

    def close(self, poller=None) -> None:
        """Close every connection and the listening socket. Idempotent."""
        for fd in list(self._conns):
            if poller is not None:
                self._drop(fd, poller)
            else:
                self._conns.pop(fd).sock.close()
        self._unattached.clear()
        self._listener.close()
