"""Remote agents this agent has handshaken with (layer: agent, the composition root).

A ``PeerLink`` is one remote TP rank reached over the side channel: its identity, spec,
geometry, backend name, the plan from our cache to its cache (built once) and how long each
phase of its handshake took. A
``PeerDirectory`` caches links by (host, port) and re-handshakes when a peer restarted
(same address, new engine id) so stale metadata is never used.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvxfer.errors import KvxferError, TransferTimeoutError
from kvxfer.layout import CacheView, build_plan
from kvxfer.protocol import ClientSession, Codec, PeerInfo
from kvxfer.transport.zmq import SideChannelClient

__all__ = ["PeerLink", "PeerDirectory", "PendingAnswer"]

log = logging.getLogger("kvxfer.agent")


@dataclass
class PeerLink:
    """One handshaken remote rank."""

    host: str
    port: int
    info: PeerInfo
    view: CacheView
    agent_name: str              # the backend's name for the peer (from add_peer)
    client: SideChannelClient
    session: ClientSession
    plans: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    paths: dict = field(default_factory=dict)      # per-peer state of the GPU paths (IPC mapping)
    on_close: list = field(default_factory=list)   # called once on close (e.g. unmap the peer's cache)
    timings: dict = field(default_factory=dict)    # handshake phase -> seconds: hello, metadata, connect

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
        with self.lock:
            frame = self.session.request(message)
            reply = self.client.request(frame, timeout)
            return self.session.response(reply, message)

    def send(self, message, timeout: float) -> "PendingAnswer":
        """Send a request now; ``answer()`` on the result waits for the reply (see ``ask``).

        The link is held (other requests on it wait) until the answer is taken or cancelled."""
        if not self.lock.acquire(timeout=timeout):
            raise TransferTimeoutError(f"link to {self.engine_id}: another request held it for {timeout} s")
        try:
            pending = self.client.send(self.session.request(message), timeout)
        except BaseException:
            self.lock.release()
            raise
        return PendingAnswer(self, message, pending)

    def close(self) -> None:
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
        self._open = True

    def answer(self):
        """The decoded reply (raises as ``PeerLink.ask``)."""
        try:
            return self.link.session.response(self._pending.reply(), self._message)
        finally:
            self._finish()

    def cancel(self) -> None:
        try:
            self._pending.cancel()
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._open:
            self._open = False
            self.link.lock.release()


class PeerDirectory:
    """Handshakes with peers on first use and keeps the links. Thread-safe."""

    def __init__(self, codec: Codec, local_info: Callable[[], PeerInfo], add_peer: Callable[[bytes], str],
                 remove_peer: Callable[[str], None], timeout: float,
                 connect: Callable[[str], None] | None = None) -> None:
        self._codec = codec
        self._local_info = local_info
        self._add_peer = add_peer
        self._remove_peer = remove_peer
        self._timeout = timeout
        self._connect = connect
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._lock = threading.Lock()

    def get(self, host: str, port: int, *, refresh: bool = False) -> PeerLink:
        """The link to host:port, handshaking if new (or if ``refresh``).

        Raises:
            PeerLostError: nobody answered within the handshake timeout.
            IncompatiblePeerError, ProtocolError: the peer refused us or answered badly.
        """
        key = (host, int(port))
        with self._lock:
            link = self._links.get(key)
        if link is not None and not refresh:
            return link
        new = self._handshake(host, int(port))
        with self._lock:
            old = self._links.get(key)
            self._links[key] = new
        if old is not None:
            self._forget(old, replaced_by=new)
        return new

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

    def _handshake(self, host: str, port: int) -> PeerLink:
        started = time.perf_counter()
        client = SideChannelClient(host, port)
        try:
            session = ClientSession(self._codec, self._local_info())
            reply = client.request(session.start(), self._timeout)
            info = session.receive_welcome(reply)  # validates the peer's spec and geometry
            welcomed = time.perf_counter()
            agent_name = self._add_peer(info.backend_metadata)
            loaded = time.perf_counter()
            if self._connect is not None:
                self._connect(agent_name)  # open the transport now, not on the first transfer
        except BaseException:
            client.close()
            raise
        timings = {"hello": welcomed - started, "metadata": loaded - welcomed,
                   "connect": time.perf_counter() - loaded}
        spec = session.peer_spec
        log.info("handshake with %s:%d: engine %s, tp %d/%d, %s %s (hello %.1f ms, metadata load %.1f ms, "
                 "connect %.1f ms)", host, port, info.engine_id, spec.tp_rank, spec.tp_size,
                 spec.layout.value, spec.storage.value, timings["hello"] * 1e3, timings["metadata"] * 1e3,
                 timings["connect"] * 1e3)
        return PeerLink(host, port, info, CacheView(spec, session.peer_geometry), agent_name, client, session,
                        timings=timings)

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


