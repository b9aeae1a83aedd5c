"""The express lane: a session's per-request frames over one plain TCP connection (layer: transport; stdlib and kvxfer.errors only, never zmq or nixl).

Why it exists: every ZMQ frame passes through ZMQ's I/O thread on both sides, so a round trip
wakes four threads; on a quiet host each wake-up after idle costs tens to hundreds of
microseconds (docs/benchmarks.md, "Claim round trip"). A claim, ``Done``, abort or heartbeat is
one small frame each way: over a plain socket it wakes the caller and the server's thread only.

The handshake stays on the ZMQ side channel. The server announces its express port in
``PeerInfo.express_port``; the client then opens a TCP connection to it and *attaches* it to its
ZMQ session by naming the session's routing id (16 random bytes the client chose, never sent
anywhere else). From then on the session's requests travel on the lane, answered by the same
sans-IO ``ServerSession``, so every check (keys, who may act, limits) is the same.

Wire format, both directions: ``HEADER`` (payload length u32, request id u64, big-endian), then
the payload. The first frame is the attach request (id 0, ``ATTACH`` + routing id); the server
answers ``ATTACHED`` or closes the connection. Replies carry the request's id, so requests from
several threads are in flight at once (as on the multiplexed ZMQ session).

Threads: one lock for sending; replies are read by whichever waiting caller is the *leader*
(no thread of the lane's own, so a reply wakes exactly the thread that waits for it or the one
reading for everybody).
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 - socket's first host-name lookup imports it (~1.8 ms): not inside a first read
import fcntl
import itertools
import math
import select
import socket
import struct
import termios
import threading
import time

from kvxfer.errors import ClosedError, KvxferError, PeerLostError, ProtocolError, TransferTimeoutError

__all__ = ["ATTACH", "ATTACHED", "HEADER", "ExpressLane", "FrameReader", "frame"]

HEADER = struct.Struct(">IQ")  # payload length, request id
ATTACH = b"KVXA"
ATTACHED = ATTACH + b"\x01"
#: Seconds ``try_send`` may wait to finish a frame the socket took only part of (it sends only
#: into a socket with room for the whole frame, so this should not happen); past it the peer is
#: taken as not reading and the lane fails (its requests get ``PeerLostError``).
TRY_SEND_REST = 0.01
_RECV_BYTES = 1 << 16  # below malloc's mmap threshold: a larger recv buffer costs a map and unmap per call


def frame(request_id: int, payload: bytes) -> bytes:
    """One frame on the lane: header, then ``payload``."""
    return HEADER.pack(len(payload), request_id) + payload


class FrameReader:
    """Splits a byte stream into ``(request id, payload)`` frames of at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_bytes

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Append ``data``; return every frame now complete.

        Raises:
            ProtocolError: a header announces more than ``max_bytes`` (nothing more is parsed).
        """
        self._buf += data
        frames = []
        start = 0
        while len(self._buf) - start >= HEADER.size:
            size, request_id = HEADER.unpack_from(self._buf, start)
            if size > self._max:
                raise ProtocolError(f"express frame of {size} bytes: expected <= {self._max}")
            end = start + HEADER.size + size
            if end > len(self._buf):
                break
            frames.append((request_id, bytes(self._buf[start + HEADER.size:end])))
            start = end
        if start:
            del self._buf[:start]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def allow(self, max_bytes: int) -> None:
        """Accept frames of up to ``max_bytes`` from now on (a server's connection, once attached)."""
        self._max = max_bytes


class ExpressLane:
    """The client end of one express connection, attached to the session named ``identity``.

    Args:
        host, port: the server's express port (on the side channel's host).
        identity: the ZMQ routing id of the session to attach to.
        max_bytes: largest frame sent or accepted.
        timeout: seconds for connecting and attaching.

    Raises:
        PeerLostError: nobody accepts at host:port, or the server refused the attach.
        TransferTimeoutError: connected, but no answer to the attach within ``timeout``.
    """

    def __init__(self, host: str, port: int, identity: bytes, max_bytes: int, timeout: float) -> None:
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._max = max_bytes
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._ids = itertools.count(1)
        self._waiting: dict[int, float] = {}  # request id -> its deadline (time.monotonic)
        self._replies: dict[int, bytes] = {}
        self._failed: dict[int, KvxferError] = {}
        self._leader = False
        self._error: KvxferError | None = None
        self._reader = FrameReader(max_bytes)
        self._outq = bytearray(4)  # TIOCOUTQ's answer: bytes queued, not yet taken by the peer
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLostError(f"express lane {self.endpoint}: cannot connect: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)  # every send and receive below is non-blocking (MSG_DONTWAIT)
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)
        try:
            deadline = time.monotonic() + timeout
            with self._state:
                self._waiting[0] = deadline
            self._send_all(frame(0, ATTACH + identity), deadline)
            answer = self._await(0, timeout, deadline)
            if answer != ATTACHED:
                raise PeerLostError(f"express lane {self.endpoint}: the server did not attach the session")
        except BaseException:
            self.close()
            raise

    @property
    def dead(self) -> bool:
        """Whether the connection failed or was closed (every later request raises)."""
        return self._error is not None

    def send(self, payload: bytes, timeout: float) -> "LanePending":
        """Send one request now; ``reply()`` on the result waits for its answer.

        Raises:
            ProtocolError: ``payload`` is larger than ``max_bytes``.
            PeerLostError: the connection failed (now or before).
            TransferTimeoutError: the server did not take the bytes within ``timeout``.
        """
        if len(payload) > self._max:
            raise ProtocolError(f"frame too large: expected <= {self._max} bytes; got {len(payload)}")
        deadline = time.monotonic() + timeout
        with self._state:
            if self._error is not None:
                raise _again(self._error)
            request_id = next(self._ids)
            self._waiting[request_id] = deadline
        try:
            self._send_all(frame(request_id, payload), deadline)
        except KvxferError:
            with self._state:
                self._waiting.pop(request_id, None)
                self._failed.pop(request_id, None)
            raise
        return LanePending(self, request_id, timeout, deadline)

    def try_send(self, payload: bytes, timeout: float) -> "LanePending | None":
        """``send``, only if that cannot wait: None, with nothing written, when another thread is
        sending on the lane, the lane has failed, or the socket takes no byte now. Once the first
        bytes are in the socket the rest of the frame must follow: that is ``send``'s loop, which
        waits only if the socket filled up in between (a peer that stopped reading)."""
        if len(payload) > self._max or not self._send_lock.acquire(blocking=False):
            return None
        deadline = time.monotonic() + timeout
        try:
            with self._state:
                if self._error is not None:
                    return None
                request_id = next(self._ids)
                self._waiting[request_id] = deadline
            data = frame(request_id, payload)
            try:
                # Only into a socket with room for the whole frame, with margin: a partly sent
                # frame would have to be finished here, waiting on the peer.
                sent = self._sock.send(data, socket.MSG_DONTWAIT) if self._room(len(data)) else 0
            except (BlockingIOError, OSError):
                sent = 0  # nothing written: ``send`` (on another thread) meets the same and reports it
            if not sent:
                with self._state:
                    self._waiting.pop(request_id, None)
                return None
            if sent < len(data):  # rare (a socket nearly full): finish it, but never wait long here
                self._send_rest(memoryview(data)[sent:], min(deadline, time.monotonic() + TRY_SEND_REST))
        finally:
            self._send_lock.release()
        return LanePending(self, request_id, timeout, deadline)

    def _room(self, size: int) -> bool:
        """Whether the socket's send queue has room for ``size`` more bytes, with half of its
        buffer to spare (bytes a peer has not taken stay queued there)."""
        try:
            fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, self._outq)
            limit = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            return False
        return struct.unpack("i", self._outq)[0] + size <= limit // 2

    def _send_all(self, data: bytes, deadline: float) -> None:
        if not self._send_lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TransferTimeoutError(f"express lane {self.endpoint}: another send held the lane")
        try:
            self._send_rest(memoryview(data), deadline)
        finally:
            self._send_lock.release()

    def _send_rest(self, view: memoryview, deadline: float) -> None:
        """Write ``view`` whole (the send lock is held), waiting for room until ``deadline``."""
        while view:
            try:
                view = view[self._sock.send(view, socket.MSG_DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            except OSError as exc:
                self._fail(PeerLostError(f"express lane {self.endpoint}: cannot send: {exc}"))
                raise _again(self._error) from None
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self._sock], [], left)[1]:
                # a partly sent frame leaves the stream unusable: the lane ends here
                self._fail(PeerLostError(f"express lane {self.endpoint}: the peer stopped reading"))
                raise TransferTimeoutError(f"express lane {self.endpoint}: the peer took no bytes "
                                           "before the request's deadline") from None

    def _await(self, request_id: int, timeout: float, deadline: float) -> bytes:
        while True:
            with self._state:
                if request_id in self._replies:
                    return self._replies.pop(request_id)
                if request_id in self._failed:
                    raise self._failed.pop(request_id)
                if self._error is not None:
                    raise _again(self._error)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._waiting.pop(request_id, None)
                    break
                if self._leader:
                    self._state.wait(remaining)
                    continue
                self._leader = True
            try:
                self._pump(remaining)
            finally:
                with self._state:
                    self._leader = False
                    self._state.notify_all()
        raise TransferTimeoutError(f"express lane {self.endpoint}: no reply within {timeout} s")

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for bytes; file every complete reply under its id."""
        if self._error is not None or not self._poll.poll(max(0, math.ceil(timeout * 1000))):
            return
        try:
            data = self._sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(PeerLostError(f"express lane {self.endpoint}: connection failed: {exc}"))
            return
        if not data:
            self._fail(PeerLostError(f"express lane {self.endpoint}: the peer closed the connection"))
            return
        try:
            frames = self._reader.feed(data)
        except ProtocolError as exc:
            self._fail(PeerLostError(f"express lane {self.endpoint}: {exc}"))
            return
        now = time.monotonic()
        with self._state:
            for request_id, payload in frames:
                deadline = self._waiting.pop(request_id, None)
                if deadline is None:
                    continue  # a request given up: its late reply is dropped
                if now > deadline:  # came after its deadline: never an answer in time
                    self._failed[request_id] = TransferTimeoutError(
                        f"express lane {self.endpoint}: the reply came {now - deadline:.3f} s after the deadline")
                else:
                    self._replies[request_id] = payload
            self._state.notify_all()

    def _fail(self, error: KvxferError) -> None:
        """End the lane: every request in flight and every later one raises ``error``."""
        with self._state:
            if self._error is None:
                self._error = error
            for request_id in self._waiting:
                self._failed[request_id] = _again(self._error)
            self._waiting.clear()
            self._state.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a leader polling the socket
        except OSError:
            pass

    def _cancel(self, request_id: int) -> None:
        with self._state:
            self._waiting.pop(request_id, None)
            self._replies.pop(request_id, None)
            self._failed.pop(request_id, None)

    def close(self, error: KvxferError | None = None) -> None:
        """Fail requests in flight (``error``, default ClosedError) and close the socket. Idempotent."""
        self._fail(error or ClosedError(f"express lane {self.endpoint} was closed"))
        with self._send_lock:
            self._sock.close()


class LanePending:
    """A request ``ExpressLane.send`` sent: ``reply()`` once, or ``cancel()``."""

    def __init__(self, lane: ExpressLane, request_id: int, timeout: float, deadline: float) -> None:
        self._lane, self._id, self._timeout, self._deadline = lane, request_id, timeout, deadline
        self._open = True

    def reply(self) -> bytes:
        """The reply frame (raises PeerLostError, TransferTimeoutError, ClosedError); once only."""
        if not self._open:
            raise ProtocolError("this request's reply was already taken or cancelled")
        self._open = False
        return self._lane._await(self._id, self._timeout, self._deadline)

    def ready(self, wait: float = 0.0) -> bool:
        """Whether ``reply()`` would return or raise at once: the reply came, the lane failed, or
        the request's deadline passed. Waits at most ``wait`` seconds for that (0: one look, which
        reads what the socket holds when no other thread is reading it). Never raises."""
        lane = self._lane
        end = time.monotonic() + max(wait, 0.0)
        while True:
            with lane._state:
                if not self._open or self._id in lane._replies or self._id in lane._failed \
                        or lane._error is not None:
                    return True
                now = time.monotonic()
                if now >= self._deadline:
                    return True
                left = min(end, self._deadline) - now
                lead = not lane._leader
                if lead:
                    lane._leader = True
                elif left <= 0:
                    return False
                else:
                    lane._state.wait(left)
                    continue
            try:
                lane._pump(max(left, 0.0))
            finally:
                with lane._state:
                    lane._leader = False
                    lane._state.notify_all()
            if time.monotonic() >= end:
                with lane._state:
                    return (not self._open or self._id in lane._replies or self._id in lane._failed
                            or lane._error is not None or time.monotonic() >= self._deadline)

    def cancel(self) -> None:
        """Give the reply up; it can never answer another request."""
        if self._open:
            self._open = False
            self._lane._cancel(self._id)


def _again(error: KvxferError) -> KvxferError:
    """A fresh exception like ``error`` (one instance raised in several threads mixes tracebacks)."""
    return type(error)(str(error))
