"""ZMQ side-channel client: one DEALER socket per remote agent, requests multiplexed by id (layer: transport; imports zmq, kvxfer.protocol, errors; never nixl).

One socket carries one session. With a peer that announced ``PeerInfo.multiplexed`` every request
carries an id and the server echoes it on its reply, so any
number of requests (claims, Done, Abort, heartbeats) are in flight at once and replies are matched
by id. The id rides in the same ZMQ frame (``MUX_MAGIC``, u64 id, the protocol frame; one frame
each way costs one send, where a separate id frame measured slower). A peer that did not announce it (an older release) gets one request at a time, as before.

Threads: ZMQ sockets are not thread-safe, so one lock (``_io``) guards every socket operation.
No thread of its own: a caller waiting for a reply becomes the *leader*; it polls the socket and
files every reply it receives under its id, waking the other waiters (a condition). A caller that
wants to send while the leader polls knocks (a byte on a socketpair the leader also polls): the
leader steps aside at once, so a send never waits for another request's reply.
"""

from __future__ import annotations

import itertools
import math
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvxfer.errors import ClosedError, ConfigError, KvxferError, PeerLostError, ProtocolError, TransferTimeoutError
from kvxfer.protocol import DEFAULT_MAX_BYTES
from kvxfer.transport.express import ExpressLane

__all__ = ["MUX_HEADER", "MUX_MAGIC", "PendingReply", "SideChannelClient", "check_port", "endpoint", "shared_context"]

monitor_ids = itertools.count()  # unique inproc names, even when a socket's fd is reused
#: ``stale`` looks at the socket's monitor at most this often (seconds): a read's critical path
#: asks it for every link it uses, and a drop is reported asynchronously anyway (ZMQ's I/O thread).
MONITOR_LOOK = 0.001
MUX_MAGIC = b"KVXM"  # a multiplexed request or reply: MUX_MAGIC, its id (u64 big-endian), the frame
MUX_HEADER = len(MUX_MAGIC) + 8
_context_lock = threading.Lock()
_context: zmq.Context | None = None


def shared_context() -> zmq.Context:
    """One private context for kvxfer's sockets (one I/O thread), never terminated."""
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            _context = zmq.Context()
        return _context


def endpoint(host: str, port: int | str) -> str:
    if not isinstance(host, str) or not host:
        raise ConfigError(f"side channel host must be a non-empty string; got {host!r}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_port(port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"side channel port must be an integer in [0, 65535]; got {port!r}")
    return port


class SideChannelClient:
    """Requests to one remote agent's side channel over a DEALER socket. Thread-safe.

    Attributes:
        multiplexed: set once the peer announced ``PeerInfo.multiplexed``: requests then carry
            ids and run concurrently. False (the default, and the handshake itself): one at a time.
        generation: bumped whenever the socket is replaced (the server then no longer knows us).

    Args:
        host, port: the remote listener.
        max_bytes: largest reply accepted; ZMQ drops a connection that sends more.
    """

    def __init__(self, host: str, port: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.endpoint = endpoint(host, check_port(port))
        self._host = host
        self._identity = b""                   # this socket's routing id (names the session to an express lane)
        self._lane: ExpressLane | None = None  # carries the requests once attached
        self.multiplexed = False
        self.generation = 0
        self._max_bytes = max_bytes
        self._io = threading.Lock()            # every socket operation
        self._state = threading.Condition()    # everything below, and waking waiters
        self._serial = threading.Semaphore(1)  # one request in flight unless multiplexed
        self._ids = itertools.count(1)
        self._waiting: dict[int, float] = {}   # ids sent, neither answered nor given up -> their deadline
        self._replies: dict[int, bytes] = {}
        self._failed: dict[int, KvxferError] = {}
        self._leader = False
        self._knocks = 0
        self._knock_r, self._knock_w = socket.socketpair()
        self._knock_r.setblocking(False)
        self._knock_w.setblocking(False)
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None  # socket, monitor and knocks (rebuilt with the socket)
        self._connected = False
        self._dropped = False       # the connection dropped during the current wait
        self._ever_dropped = False  # sticky until the socket is replaced: see ``stale``
        self._monitor_due = 0.0     # ``stale``'s next look at the monitor (``time.monotonic``)
        self._closed = False

    # ---- the socket (callers hold _io) -----------------------------------------------
    @contextmanager
    def _socket_turn(self, timeout: float | None = None) -> Iterator[None]:
        """Hold ``_io``; a leader polling for replies is asked to step aside first."""
        with self._state:
            self._knocks += 1
            polling = self._leader
        try:
            if polling:  # else a leader to come sees ``_knocks`` before it polls
                try:
                    self._knock_w.send(b"k")
                except OSError:  # the pipe is full of knocks already: the leader will wake
                    pass
            if not self._io.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                raise TransferTimeoutError(f"side channel {self.endpoint}: the socket stayed busy for {timeout} s")
        finally:
            with self._state:
                self._knocks -= 1
                self._state.notify_all()
        try:
            yield
        finally:
            self._io.release()

    def _ensure(self) -> zmq.Socket:
        if self._sock is None:
            ctx = shared_context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            if self.endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            self._identity = b"\x01" + secrets.token_bytes(15)  # ZMQ reserves ids that start with 0
            sock.setsockopt(zmq.ROUTING_ID, self._identity)
            address = f"inproc://kvxfer-monitor-{next(monitor_ids)}"
            sock.monitor(address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._monitor = ctx.socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            sock.connect(self.endpoint)
            self._sock, self._connected, self._dropped, self._ever_dropped = sock, False, False, False
        return self._sock

    def _drain_monitor(self) -> None:
        while self._monitor is not None and self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
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

    def _reset(self, error: KvxferError | None = None) -> None:
        """Discard the socket; every request in flight fails with ``error`` (a late reply can never
        answer a later request: the next socket is a new identity)."""
        if self._lane is not None:
            self._lane.close(error or PeerLostError(f"side channel {self.endpoint}: the socket was reset"))
            self._lane = None
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(linger=0)
            self.generation += 1
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sock = self._monitor = self._poller = None
        self._connected = self._dropped = self._ever_dropped = False
        with self._state:
            for rid in self._waiting:
                self._failed[rid] = error or PeerLostError(f"side channel {self.endpoint}: the socket was reset")
            self._waiting.clear()
            self._state.notify_all()

    def _pump(self, timeout: float) -> None:
        """Poll up to ``timeout`` s; file the replies that arrived; fail everything on a drop."""
        sock = self._sock
        if sock is None or self._knocks:  # someone waits to send: step aside first
            return
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._poller.register(self._knock_r, zmq.POLLIN)
        ready = dict(self._poller.poll(max(0, math.ceil(timeout * 1000))))
        if self._knock_r.fileno() in ready:
            try:
                while self._knock_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        if self._monitor in ready:
            self._drain_monitor()
            if self._dropped:
                self._reset(PeerLostError(f"side channel {self.endpoint}: connection dropped while waiting "
                                          "for a reply"))
                return
        if sock in ready:
            self._receive_all(sock)

    def _receive_all(self, sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 1:
                continue  # a stray or malformed reply: nobody asked for it
            reply = parts[0]
            with self._state:
                if self.multiplexed and reply[:len(MUX_MAGIC)] == MUX_MAGIC and len(reply) >= MUX_HEADER:
                    rid, reply = int.from_bytes(reply[len(MUX_MAGIC):MUX_HEADER], "big"), reply[MUX_HEADER:]
                elif not self.multiplexed and len(self._waiting) == 1:
                    rid = next(iter(self._waiting))
                else:
                    continue
                deadline = self._waiting.pop(rid, None)
                if deadline is None:
                    continue  # a request given up: its late reply is dropped
                late = time.monotonic() - deadline
                if late > 0:  # came after its deadline: never an answer in time
                    self._failed[rid] = TransferTimeoutError(
                        f"side channel {self.endpoint}: the reply came {late:.3f} s after the deadline")
                else:
                    self._replies[rid] = reply
                self._state.notify_all()

    # ---- requests -------------------------------------------------------------------
    def request(self, frame: bytes, timeout: float) -> bytes:
        """Send ``frame`` and return the reply frame, within ``timeout`` seconds.

        Raises:
            PeerLostError: nobody accepted the connection by the deadline, or the
                connection dropped while waiting (peer died or restarted).
            TransferTimeoutError: connected, but no reply by the deadline.
            ProtocolError: ``frame`` is larger than ``max_bytes``.
            ClosedError: after ``close()``.
            ConfigError: ``timeout`` is not a positive finite number.
        """
        return self.send(frame, timeout).reply()

    def try_send(self, frame: bytes, timeout: float):
        """``send``, only where it cannot wait: over the express lane, when no other send holds it
        and its socket takes the frame now (``ExpressLane.try_send``); else None, nothing sent."""
        lane = self._lane
        if lane is None or self._closed or not isinstance(timeout, (int, float)) \
                or not math.isfinite(timeout) or timeout <= 0:
            return None
        return lane.try_send(frame, timeout)

    def send(self, frame: bytes, timeout: float) -> "PendingReply":
        """Send ``frame`` now and return at once; ``reply()`` on the result waits for the answer.

        ``timeout`` counts from this call. Multiplexed, other requests go on meanwhile; otherwise
        the channel is held until the reply is taken or ``cancel()`` is called. Raises as
        ``request`` does for what fails before the reply is awaited.
        """
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds; got {timeout!r}")
        lane = self._lane
        if lane is not None:
            if self._closed:
                raise ClosedError(f"side channel client for {self.endpoint} was closed")
            return lane.send(frame, timeout)
        serial = not self.multiplexed
        limit = self._max_bytes - (0 if serial else MUX_HEADER)  # the id travels in the same ZMQ frame
        if len(frame) > limit:
            raise ProtocolError(f"frame too large: expected <= {limit} bytes; got {len(frame)}")
        deadline = time.monotonic() + timeout
        if serial and not self._serial.acquire(timeout=timeout):
            raise TransferTimeoutError(
                f"side channel {self.endpoint}: another request held the channel for {timeout} s")
        try:
            rid = next(self._ids)
            with self._socket_turn(deadline - time.monotonic()):
                if self._closed:
                    raise ClosedError(f"side channel client for {self.endpoint} was closed")
                sock = self._ensure()
                self._drain_monitor()
                self._dropped = False  # a drop before this request is healed by ZMQ's reconnect
                with self._state:
                    self._waiting[rid] = deadline
                try:
                    sock.send(frame if serial else MUX_MAGIC + rid.to_bytes(8, "big") + frame, zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    self._reset()
                    with self._state:
                        self._failed.pop(rid, None)
                    raise PeerLostError(f"side channel {self.endpoint}: cannot send: {exc}") from None
        except BaseException:
            if serial:
                self._serial.release()
            raise
        return PendingReply(self, rid, timeout, deadline, serial)

    def _await(self, rid: int, timeout: float, deadline: float) -> bytes:
        while True:
            with self._state:
                if rid in self._replies:
                    return self._replies.pop(rid)
                if rid in self._failed:
                    raise self._failed.pop(rid)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if self._leader or self._knocks:
                    self._state.wait(remaining)
                    continue
                self._leader = True
            try:
                with self._io:
                    self._pump(remaining)
            finally:
                with self._state:
                    self._leader = False
                    self._state.notify_all()
        return self._give_up(rid, timeout)

    def _give_up(self, rid: int, timeout: float) -> bytes:
        """No reply by the deadline: forget ``rid`` and raise the error that says why."""
        with self._state:
            self._waiting.pop(rid, None)
        with self._socket_turn():
            self._drain_monitor()
            connected = self._connected
            if not self.multiplexed:
                self._reset()  # the late reply must not answer the next request
        with self._state:
            self._failed.pop(rid, None)
            self._replies.pop(rid, None)
        if connected:
            raise TransferTimeoutError(f"side channel {self.endpoint}: no reply within {timeout} s")
        raise PeerLostError(f"side channel {self.endpoint}: no connection within {timeout} s (is the peer running?)")

    def _cancel(self, rid: int) -> None:
        with self._state:
            waiting = self._waiting.pop(rid, None) is not None
            self._replies.pop(rid, None)
            self._failed.pop(rid, None)
        if waiting and not self.multiplexed:
            with self._socket_turn():
                self._reset()  # the late reply must not answer the next request

    def attach_express(self, port: int, timeout: float) -> None:
        """Carry this session's later requests on an express lane to ``port`` on the peer's host
        (``kvxfer.transport.express``); call after the handshake, once the peer announced the port.

        Raises:
            PeerLostError, TransferTimeoutError: no lane (the caller may go on over ZMQ).
            ClosedError: after ``close()``.
        """
        with self._socket_turn(timeout):
            if self._closed:
                raise ClosedError(f"side channel client for {self.endpoint} was closed")
            self._ensure()
            identity, generation = self._identity, self.generation
        lane = ExpressLane(self._host, check_port(port), identity, self._max_bytes, timeout)
        with self._socket_turn():
            if self._closed or self.generation != generation:
                lane.close()
                raise PeerLostError(f"side channel {self.endpoint}: the socket was reset while the express "
                                    "lane attached")
            old, self._lane = self._lane, lane
        if old is not None:
            old.close()

    @property
    def express(self) -> bool:
        """Whether requests travel on an express lane."""
        return self._lane is not None

    def stale(self) -> bool:
        """Whether a session handshaken on this client may be gone at the server: the client was
        closed, its express lane failed, or its connection dropped since (the peer may have
        restarted; ZMQ reconnects silently). Never blocks: False while another caller holds the socket.
        A drop reaches the monitor asynchronously; it is looked at once per ``MONITOR_LOOK`` at most."""
        lane = self._lane
        if self._closed or (lane is not None and lane.dead):
            return True
        if self._ever_dropped:
            return True
        now = time.monotonic()
        if now < self._monitor_due or not self._io.acquire(blocking=False):
            return False
        try:
            self._drain_monitor()
            self._monitor_due = now + MONITOR_LOOK
            return self._ever_dropped
        finally:
            self._io.release()

    def close(self) -> None:
        """Discard the socket; requests in flight and later ones raise ClosedError. Idempotent."""
        with self._socket_turn():
            self._closed = True
            self._reset(ClosedError(f"side channel client for {self.endpoint} was closed"))
        self._knock_r.close()
        self._knock_w.close()

    def __enter__(self) -> "SideChannelClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingReply:
    """A request ``SideChannelClient.send`` sent: ``reply()`` once, or ``cancel()``."""

    def __init__(self, client: SideChannelClient, rid: int, timeout: float, deadline: float,
                 serial: bool) -> None:
        self._client, self._rid, self._timeout, self._deadline = client, rid, timeout, deadline
        self._serial = serial
        self._open = True

    def reply(self) -> bytes:
        """Wait for the reply frame (raises as ``SideChannelClient.request``); once only."""
        if not self._open:
            raise ProtocolError("this request's reply was already taken or cancelled")
        try:
            return self._client._await(self._rid, self._timeout, self._deadline)
        finally:
            self._finish()

    def cancel(self) -> None:
        """Give the reply up; it can never answer another request."""
        if self._open:
            try:
                self._client._cancel(self._rid)
            finally:
                self._finish()

    def _finish(self) -> None:
        if self._open:
            self._open = False
            if self._serial:
                self._client._serial.release()
