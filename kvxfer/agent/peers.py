"""Remote agents this agent has handshaken with (layer: agent, the composition root).

A ``PeerLink`` is one remote TP rank reached over the side channel: its identity, spec,
geometry, backend name, the plan from our cache to its cache (built once) and how long each
phase of its handshake took. A
``PeerDirectory`` caches links by (host, port) and re-handshakes when a peer restarted
(same address, new engine id) so stale metadata is never used.

Self-healing: a link whose session may be gone (its session is no longer ``ready``, its socket
was replaced after a failed request, or its connection dropped since the handshake) is never
handed out again: ``PeerDirectory.get`` handshakes afresh instead, and ``PeerDirectory.call``
runs an operation once more on a fresh link when the first attempt lost the peer. So no failure
can leave state that poisons later calls.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from kvxfer.errors import BackendError, KvxferError, PeerLostError
from kvxfer.layout import CacheView, build_plan
from kvxfer.protocol import ClientSession, Codec, PeerInfo, SessionState
from kvxfer.transport.base import Channel
from kvxfer.transport.zmq import SideChannelClient
from kvxfer.types import Region

__all__ = ["PeerLink", "PeerDirectory", "PendingAnswer"]

T = TypeVar("T")
EXPRESS_ATTACH_TIMEOUT = 1.0  # seconds to open and attach an express lane before staying on ZMQ

log = logging.getLogger("kvxfer.agent")


@dataclass
class PeerLink:
    """One handshaken remote rank."""

    host: str
    port: int
    info: PeerInfo
    view: CacheView
    agent_name: str              # the backend's name for the peer (from add_peer)
    client: Channel
    session: ClientSession
    plans: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)      # per-peer state of the GPU paths (IPC mapping)
    on_close: list = field(default_factory=list)   # called once on close (e.g. unmap the peer's cache)
    timings: dict = field(default_factory=dict)    # handshake phase -> seconds: hello, metadata, connect
    generation: int = 0                            # the client's socket generation at the handshake
    closed: bool = False

    def healthy(self) -> bool:
        """Whether this link's session can still be used: open, ready, on the socket it was
        handshaken on, and no connection drop seen since (see ``SideChannelClient.stale``)."""
        return (not self.closed and self.session.state is SessionState.READY
                and self.client.generation == self.generation and not self.client.stale())

    def _check_ready(self) -> None:
        if self.closed or self.session.state is not SessionState.READY:
            raise PeerLostError(f"link to {self.engine_id} at {self.host}:{self.port} lost its session "
                                f"({'closed' if self.closed else self.session.state}): handshake again")

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    @property
    def spec(self):
        return self.view.spec

    def plan(self, local: CacheView, *, allow_conversion: bool, reverse: bool = False):
        """The plan from ``local`` to this peer (``reverse``: the peer is the one that needs data)."""
        key = (reverse, allow_conversion)
        plan = self.plans.get(key)
        if plan is None:
            if reverse:
                plan = build_plan(self.view, local, allow_conversion=allow_conversion)
            else:
                plan = build_plan(local, self.view, allow_conversion=allow_conversion)
            self.plans[key] = plan
        return plan

    def ask(self, message, timeout: float):
        """One request/response on the side channel. Raises PeerLostError when the peer is gone."""
        return self.send(message, timeout).answer()

    def send(self, message, timeout: float) -> "PendingAnswer":
        """Send a request now; ``answer()`` on the result waits for the reply (see ``ask``).

        With a multiplexed peer (every current agent) other requests on this link go on
        meanwhile; with an older peer the link is held until the answer is taken or cancelled."""
        self._check_ready()
        return PendingAnswer(self, message, self.client.send(self.session.request(message), timeout))

    def try_send(self, message, timeout: float) -> "PendingAnswer | None":
        """``send`` only where it cannot wait on the peer (``SideChannelClient.try_send``): None
        when it would, or when the link is not ready, with nothing sent."""
        if self.closed or self.session.state is not SessionState.READY:
            return None
        try:
            pending = self.client.try_send(self.session.request(message), timeout)
        except KvxferError:  # e.g. a frame too large: ``send`` meets it again and reports it
            return None
        return None if pending is None else PendingAnswer(self, message, pending)

    def close(self) -> None:
        self.closed = True
        self.client.close()
        closers, self.on_close = self.on_close, []
        for fn in closers:
            try:
                fn()
            except Exception as exc:  # best effort: the link is going away
                log.warning("closing link to %s: %s", self.engine_id, exc)


class PendingAnswer:
    """A request ``PeerLink.send`` sent: ``answer()`` once, or ``cancel()``."""

    def __init__(self, link: PeerLink, message, pending) -> None:
        self.link, self._message, self._pending = link, message, pending

    def answer(self):
        """The decoded reply (raises as ``PeerLink.ask``)."""
        return self.link.session.response(self._pending.reply(), self._message)

    def ready(self, wait: float = 0.0) -> bool:
        """Whether ``answer()`` returns (or raises) without waiting on the peer, after waiting
        at most ``wait`` seconds for that. A transport that cannot tell says True: then only a
        lane's thread may take the answer (``try_send`` sends only where it can tell)."""
        ready = getattr(self._pending, "ready", None)
        return True if ready is None else bool(ready(wait))

    def cancel(self) -> None:
        self._pending.cancel()


def _probe(spec, geometry) -> Region:
    """The peer's first cache region (layer 0's first), for ``connect``, which reads from its start
    (a few bytes, then a large read so the first request's bulk protocol is set up too)."""
    return Region(int(geometry.bases[0, 0]), spec.region_bytes, geometry.device, geometry.kind)


class PeerDirectory:
    """Handshakes with peers on first use and keeps the links. Thread-safe."""

    def __init__(self, codec: Codec, local_info: Callable[[], PeerInfo], add_peer: Callable[[bytes], str],
                 remove_peer: Callable[[str], None], timeout: float,
                 connect: Callable[[str], None] | None = None, channel: Callable[..., Channel] | None = None,
                 express: bool = True, now: Callable[[], float] = time.monotonic) -> None:
        self._codec = codec
        self._local_info = local_info
        self._add_peer = add_peer
        self._remove_peer = remove_peer
        self._timeout = timeout
        self._connect = connect
        self._channel = channel or SideChannelClient  # (host, port, max_bytes=) -> Channel
        self._express = express   # attach an express lane where the peer offers one
        self._now = now           # the agent's clock (``forget_idle``)
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._used: dict[tuple[str, int], float] = {}   # when each link was last handed out (``now``)
        self._gates: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, host: str, port: int, *, refresh: bool = False, timeout: float | None = None,
            ready: bool = False) -> PeerLink:
        """The link to host:port, handshaking if new (or if ``refresh``).

        A handshake this call makes opens the transport (``connect``) without waiting for it;
        with ``ready`` (``Agent.connect``: the caller sets a peer up ahead of time) it also waits
        for the probe reads that prove the connection carries reads, small and large. Without
        ``ready`` the handshake is on a first request's path: that request's own operations
        finish the transport's set-up while its claim travels, instead of after a probe's round
        trips (measured across two hosts: the probe's wait was 11-25 ms of a first read's
        set-up, and the read after it was no faster).

        Raises:
            PeerLostError: nobody answered within the handshake timeout.
            IncompatiblePeerError, ProtocolError: the peer refused us or answered badly.
        """
        key = (host, int(port))
        with self._lock:
            link = self._links.get(key)
            gate = self._gates.setdefault(key, threading.Lock())
            self._used[key] = self._now()
        if link is not None and not refresh and link.healthy():
            return link
        with gate:  # one handshake per address at a time: concurrent callers share its link
            with self._lock:
                current = self._links.get(key)
            if current is not None and current is not link and current.healthy():
                return current  # another caller handshook while this one waited
            new = self._handshake(host, int(port), timeout, ready)
            with self._lock:
                old = self._links.get(key)
                self._links[key] = new
        if old is not None:
            self._forget(old, replaced_by=new)
        return new

    def cached(self, host: str, port: int) -> PeerLink | None:
        """The link to host:port if one is handshaken and healthy, else None; never does I/O."""
        key = (host, int(port))
        with self._lock:
            link = self._links.get(key)
            if link is not None:
                self._used[key] = self._now()
        return link if link is not None and link.healthy() else None

    def call(self, host: str, port: int, op: Callable[[PeerLink], T], *, engine_id: str | None = None) -> T:
        """``op(link)`` on the link to host:port; when that loses the peer (``PeerLostError``: the
        session is gone, the peer restarted or dropped us), drop the link, handshake again and
        run ``op`` once more on the fresh link.

        Args:
            engine_id: run ``op`` only on that engine: a peer that restarted since (another
                engine id at host:port) raises ``PeerLostError`` instead (e.g. a ``Done`` for a
                read the new engine never served).

        Raises:
            PeerLostError: nobody answers at host:port, the second attempt lost it too, or the
                engine there is not ``engine_id``.
            Whatever ``op`` raises otherwise.
        """
        for attempt in (1, 2):
            link = self.get(host, port)
            if engine_id is not None and link.engine_id != engine_id:
                raise PeerLostError(f"{host}:{port} is now engine {link.engine_id}, not {engine_id} "
                                    "(the peer restarted)")
            try:
                return op(link)
            except PeerLostError:
                self.drop(link)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def drop(self, link: PeerLink) -> None:
        """Forget a link (e.g. after the peer was lost)."""
        with self._lock:
            if self._links.get((link.host, link.port)) is link:
                del self._links[(link.host, link.port)]
        self._forget(link)

    def _forget(self, link: PeerLink, replaced_by: PeerLink | None = None) -> None:
        link.close()
        if replaced_by is None or replaced_by.agent_name != link.agent_name:
            try:
                self._remove_peer(link.agent_name)
            except KvxferError as exc:  # best effort: the peer is gone anyway
                log.debug("removing peer %s: %s", link.agent_name, exc)

    def _handshake(self, host: str, port: int, timeout: float | None = None, ready: bool = False) -> PeerLink:
        started = time.perf_counter()
        client = self._channel(host, port, max_bytes=self._codec.max_bytes)
        try:
            session = ClientSession(self._codec, self._local_info())
            reply = client.request(session.start(), timeout or self._timeout)
            info = session.receive_welcome(reply)  # validates the peer's spec and geometry
            client.multiplexed = info.multiplexed  # from now on requests carry ids (current peers)
            welcomed = time.perf_counter()
            self._attach_express(client, host, info, timeout or self._timeout)
            laned = time.perf_counter()
            try:
                agent_name = self._add_peer(info.backend_metadata)
            except BackendError as exc:
                # It answered the hello, and its transport cannot be reached now (UCX's endpoint
                # failed: "destination unreachable"): the peer went away during the handshake.
                raise PeerLostError(f"{host}:{port} ({info.engine_id}) answered the handshake, but its transport "
                                    f"cannot be reached: {exc}") from exc
            loaded = time.perf_counter()
            if self._connect is not None:
                # open the transport now, not on the first transfer; with ``ready`` the probe (the peer's
                # first cache region) lets the backend wait until the connection really carries reads,
                # large ones too; without, the first request's own reads finish the set-up
                self._connect(agent_name, probe=_probe(session.peer_spec, session.peer_geometry) if ready else None)
        except BaseException:
            client.close()
            raise
        timings = {"hello": welcomed - started, "express": laned - welcomed, "metadata": loaded - laned,
                   "connect": time.perf_counter() - loaded}
        spec = session.peer_spec
        log.info("handshake with %s:%d: engine %s, tp %d/%d, %s %s (hello %.1f ms, express lane %s %.1f ms, "
                 "metadata load %.1f ms, connect %.1f ms)", host, port, info.engine_id, spec.tp_rank, spec.tp_size,
                 spec.layout.value, spec.storage.value, timings["hello"] * 1e3,
                 "on" if getattr(client, "express", False) else "off", timings["express"] * 1e3,
                 timings["metadata"] * 1e3, timings["connect"] * 1e3)
        return PeerLink(host, port, info, CacheView(spec, session.peer_geometry), agent_name, client, session,
                        timings=timings, generation=client.generation)

    def _attach_express(self, client: Channel, host: str, info: PeerInfo, timeout: float) -> None:
        """Move the session's requests to the peer's express lane, if both sides have one; a lane
        that cannot be opened (e.g. a firewall) leaves them on the side channel, with a warning."""
        attach = getattr(client, "attach_express", None)
        if not (self._express and info.express_port and attach is not None):
            return
        try:
            # A firewall that drops the lane's packets must not stall the first read for a whole
            # handshake timeout: the lane is an optimisation, the side channel works without it.
            attach(info.express_port, min(timeout, EXPRESS_ATTACH_TIMEOUT))
        except KvxferError as exc:
            log.warning("express lane to %s (%s:%d) not opened: %s; its requests use the side channel",
                        info.engine_id, host, info.express_port, exc)

    def forget_idle(self, ttl: float, busy: Callable[[PeerLink], bool]) -> list[PeerLink]:
        """Forget the links not handed out for ``ttl`` seconds for which ``busy(link)`` is False
        (a read may still use it): each is closed and its backend peer removed, as ``drop`` does;
        the next request to that address handshakes afresh. Returns the links forgotten."""
        now = self._now()
        with self._lock:
            idle = [link for key, link in self._links.items() if now - self._used.get(key, now) >= ttl]
        gone = []
        for link in idle:
            if busy(link):
                continue
            key = (link.host, link.port)
            with self._lock:  # handed out again meanwhile: kept
                if self._links.get(key) is not link or now - self._used.get(key, now) < ttl:
                    continue
                del self._links[key]
                self._used.pop(key, None)
            self._forget(link)
            gone.append(link)
        return gone

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


