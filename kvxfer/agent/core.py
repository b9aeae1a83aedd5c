"""``Agent``: the public face of kvxfer (layer: agent, the composition root; may import every layer).

An Agent is one TP rank's endpoint: it registers the rank's KV cache, listens on the side
channel, holds blocks for consumers (producer role), reads or writes blocks of a request
from or to peers (consumer role), and reports what finished. A background progress thread
polls transfers, notifications and lease expiry; every user-facing wait takes a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Sequence

import msgspec
import numpy as np

from kvxfer.engine.paths.kit import PathKit
from kvxfer.engine.paths.packing import PackServer
from kvxfer.agent.claims import Claims
from kvxfer.agent.notices import DoneSender
from kvxfer.agent.peers import PeerDirectory, PeerLink
from kvxfer.engine.paths.reading import plan_read
from kvxfer.agent.metrics import AgentMetrics
from kvxfer.agent.reports import AgentStats, Finished, Reports
from kvxfer.agent.service import ProducerService
from kvxfer.backend.base import Backend
from kvxfer.clock import Clock, MonotonicClock
from kvxfer.config import AgentConfig, progress_thread_wanted
from kvxfer.engine.handles import TransferHandle
from kvxfer.engine.leases import LeaseTable
from kvxfer.engine.staging import StagingAllocator
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import (
    ClosedError, ConfigError, KvxferError, LeaseExpiredError, PeerLostError, RegistrationError,
    TransferTimeoutError,
)
from kvxfer.layout import CacheView, KVSpec, build_plan, notify_ranks, peer_ranks
from kvxfer.layout.request import check_block_ids
from kvxfer.memory import MemoryRegistry, host_view
from kvxfer.protocol import (
    Codec, Heartbeat, compat_hash, decode_notification, encode_notification, make_peer_info, new_engine_id,
)
from kvxfer.transport.address import side_channel_address
from kvxfer.transport.base import Listener, Transport
from kvxfer.transport.zmq import ZmqTransport
from kvxfer.types import (
    AbortOutcome, Direction, KeepaliveResult, MemKind, ReleaseOutcome, ReleaseReason, RequestState, TransferPath,
)

__all__ = ["Agent", "Finished"]

log = logging.getLogger("kvxfer.agent")

_MAX_BLOCK_ID = (1 << 63) - 1  # remote ids are checked against the peer's cache by the plan


class Agent:
    """One TP rank's KV-transfer endpoint. Use as a context manager, or call ``close``.

    Args:
        name: a readable name (the engine id adds a random nonce to it).
        spec: this rank's cache shape.
        config: side channel, backends, leases, timeouts (``AgentConfig.from_env()`` by default).
        backend: a ``Backend``; default a ``NixlBackend`` with ``config.backends``.
        clock: the clock leases and deadlines use (tests pass a ``ManualClock``).
        transport: the side channel's transport; default ``ZmqTransport()`` (tests may pass
            ``kvxfer.testing.MemoryTransport`` to need no ports).
    """

    def __init__(self, name: str, spec: KVSpec, config: AgentConfig | None = None, *,
                 backend: Backend | None = None, clock: Clock | None = None,
                 transport: Transport | None = None) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec; got {type(spec).__name__}")
        self.spec = spec
        self.config = config or AgentConfig.from_env()
        self.engine_id = new_engine_id(name)
        self._clock = clock or MonotonicClock()
        if backend is None:
            from kvxfer.backend.nixl import NixlBackend  # lazy: only this module of the agent needs nixl

            thread = progress_thread_wanted(self.config.nixl_progress_thread)
            log.info("agent %s: NIXL progress thread %s%s", self.engine_id, "on" if thread else "off",
                     " (auto: by this process's cores)" if self.config.nixl_progress_thread is None else "")
            backend = NixlBackend(f"{self.engine_id}", self.config.backends, progress_thread=thread)
        self._backend = backend
        self._codec = Codec(compat_hash(spec), key=self.config.auth_key,
                            max_bytes=self.config.max_message_bytes)
        self._registry = MemoryRegistry(backend)
        self._view: CacheView | None = None
        self._engine: TransferEngine | None = None
        self._reports = Reports()
        self._leases = LeaseTable(self.config.lease_timeout, self._clock, self._on_release)
        self._service = ProducerService(self)
        self._transport: Transport = transport or ZmqTransport()
        self._server: Listener | None = None
        self._address: tuple[str, int] | None = None
        self._peers = PeerDirectory(self._codec, self._peer_info, backend.add_peer,
                                    backend.remove_peer, self.config.handshake_timeout,
                                    getattr(backend, "connect", None), channel=self._transport.channel,
                                    express=self.config.express_port is not None)
        self._claims = Claims(self._peers, self.engine_id, self.config.handshake_timeout)
        self._kit: PathKit | None = None        # the IPC and staged paths (set by register)
        self._done = DoneSender(self.engine_id, self._claims.ask_engine, notify=self._notify_done)
        self._packer: PackServer | None = None  # serves staged reads as a producer
        self._closed = False
        self._setup = threading.Lock()  # register and listen run once each, whichever thread calls
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._progress_loop, name=f"kvxfer-{name}", daemon=True)
        self._thread.start()
        self._metrics: AgentMetrics | None = None
        if self.config.metrics_port is not None:
            try:
                self._metrics = AgentMetrics(self.stats, self.config.metrics_port,
                                             self.config.side_channel_host, self.engine_id,
                                             rank=self.config.dp_rank * spec.tp_size + spec.tp_rank)
            except BaseException:
                self.close()
                raise

    # ---- set-up --------------------------------------------------------------------
    def register(self, tensors) -> None:
        """Register this rank's KV cache (shapes as ``spec.tensor_shapes()``). Blocks while NIXL
        registers the memory (and a host staging area is faulted in). Thread-safe: of two calls,
        one registers and the other raises.

        Raises:
            RegistrationError: the tensors do not match the spec, or a cache is already registered.
        """
        with self._setup:
            self._register(tensors)

    def _register(self, tensors) -> None:
        self._check_open()
        if self._view is not None:
            raise RegistrationError("a KV cache is already registered with this agent")
        geometry = self._registry.register(self.spec, tensors)
        self._view = CacheView(self.spec, geometry)
        staging, base = None, 0
        if self.config.staging_bytes and geometry.kind is MemKind.DRAM:
            self._staging_buf = np.empty(self.config.staging_bytes, dtype=np.uint8)
            self._staging_buf.fill(0)  # fault the pages in now, not during the first transfer
            region = self._registry.register_buffer(self._staging_buf)
            staging, base = StagingAllocator(self.config.staging_bytes), region.addr
        self._kit = PathKit(self._backend, self.config, self._view, clock=self._clock)
        self._packer = PackServer(self._kit, self._view, self._leases, self.config.lease_timeout)
        self._engine = TransferEngine(self._backend, geometry.kind, clock=self._clock,
                                      staging_base=base, staging=staging, unpack=self._unpack,
                                      on_reclaimed=self._reports.reclaimed)

    def listen(self) -> tuple[str, int]:
        """Start the side-channel listener; returns the bound (host, port). Idempotent and
        thread-safe (one listener however many threads call). Blocks until the socket is bound."""
        with self._setup:
            return self._listen()

    def _listen(self) -> tuple[str, int]:
        self._check_open()
        self._require_cache()
        if self._address is not None:
            return self._address
        host, port = side_channel_address(
            self.config.side_channel_host, self.config.side_channel_port,
            dp_rank=self.config.dp_rank, tp_rank=self.spec.tp_rank, tp_size=self.spec.tp_size)
        express = self.config.express_port
        if express:  # a fixed base port: offset by rank like the side channel
            express += self.config.dp_rank * self.spec.tp_size + self.spec.tp_rank
            if express > 65535:
                raise ConfigError(f"express_port {self.config.express_port} + rank offset passes 65535")
        self._server = self._transport.listener(host, port, self._service.make_session,
                                                max_bytes=self.config.max_message_bytes,
                                                pinned=self._service.pinned,
                                                authenticated=self._codec.authenticated,
                                                express_port=express)
        self._address = self._server.start()
        log.info("agent %s listening on %s:%d", self.engine_id, *self._address)
        return self._address

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where Prometheus metrics are served (``config.metrics_port``), or None when off."""
        return self._metrics.address if self._metrics is not None else None

    @property
    def address(self) -> tuple[str, int] | None:
        """The side-channel (host, port) once listening."""
        return self._address

    @property
    def cache(self) -> CacheView:
        """The registered cache's view (spec and geometry). Raises RegistrationError before ``register``."""
        return self._require_cache()

    # ---- producer ------------------------------------------------------------------
    def hold(self, request_id: str, block_ids, consumers: int | None = None,
             lease: float | None = None, consumer_engines: Sequence[str] | None = None, *,
             replace: bool = False) -> None:
        """Keep ``block_ids`` readable for ``request_id`` until every consumer is done, the
        request is released or aborted, or the lease expires. From this call on the blocks belong
        to kvxfer; the engine may reuse them only once ``finished()`` lists the request (in
        ``sent``, ``aborted`` or ``expired``; ``status`` says the same without draining).

        Args:
            consumers: how many consumer engines must report done. None: decided by the first
                claim, from that consumer's TP size (the consumer ranks that read or depend on
                this rank: one consumer instance). Pass a number when several instances read.
            lease: seconds an unclaimed hold lives (default ``config.lease_timeout``); claims
                and heartbeats extend it.
            consumer_engines: the consumer engines that may claim, heartbeat, abort or report
                done (agent names, or exact engine ids); None: anyone.
            replace: replace the blocks of a request already held (refused while a consumer's
                claim window is open on it, or while it is ending). Without it a second hold of
                a held request is refused.

        Does not block (a lock). Thread-safe.

        Raises:
            AlreadyHeldError: the request is held already (see ``replace``); names the request.
            BlockIdError: ids that are not distinct integers in range.
            ConfigError: ``consumers`` < 1, ``lease`` <= 0, bad ``consumer_engines``.
            ClosedError: the agent is closed.
        """
        self._check_open()
        self._leases.hold(request_id, block_ids, self.spec.num_blocks, consumers, lease,
                          named=tuple(consumer_engines or ()), replace=replace)
        self._reports.forget(request_id)
        self._wake.set()

    def release(self, request_id: str) -> ReleaseOutcome:
        """Producer-side abort: end the hold of ``request_id``; new claims are refused from now.

        The blocks may be reused at once only when this returns ``ReleaseOutcome.FREE_NOW`` (or
        NOT_HELD: nothing was held). FREE_WHEN_FINISHED: a consumer's claim window is open, a
        read may still be moving the blocks: reuse them only once ``finished()`` lists the
        request (in ``aborted``, even if that read completes). ALREADY_ENDING: an earlier
        release, abort or expiry is already waiting on a window: the same rule. See
        ``ReleaseOutcome``. Does not block; never raises for the request's state; thread-safe.
        """
        return self._leases.release(request_id, ReleaseReason.ABORTED)

    def holding(self, request_id: str) -> bool:
        """True until ``request_id``'s blocks are really free (also while a release waits on a
        claim window). Does not block, drains nothing."""
        return self._leases.held(request_id)

    def status(self, request_id: str) -> RequestState:
        """Where ``request_id`` stands on this agent, without draining anything: any number of
        parts of an engine may ask (``finished()`` has one reader: it drains).

        Producer: HELD, CLAIMED, ENDING, then SENT, ABORTED or EXPIRED (the blocks are free).
        Consumer: IN_FLIGHT once the transfer is posted (while ``read`` is still claiming, the
        request's previous state), then RECEIVED, FAILED, or QUARANTINED and later RECLAIMED. UNKNOWN:
        never seen here, or forgotten: ended requests are remembered for the most recent
        ``kvxfer.agent.reports.STATUS_MEMORY`` (10,000) of them, oldest forgotten first. A
        write's sender sees IN_FLIGHT and then UNKNOWN (its handle has the outcome). Does not
        block (locks only); thread-safe. See ``RequestState``.
        """
        live = self._leases.state(request_id)
        if live is not None:
            return live
        if self._engine is not None and self._engine_has(request_id):
            return RequestState.IN_FLIGHT
        return self._reports.ended(request_id) or RequestState.UNKNOWN

    def _engine_has(self, request_id: str) -> bool:
        """Whether the engine has ``request_id`` posted and not ended (draining included).

        Reads the engine's table without its lock: one dict lookup is atomic under the GIL, and a
        request that ends meanwhile shows as ended in the reports a moment later."""
        engine = self._engine
        return request_id in engine._requests or request_id in engine._posting

    # ---- consumer ------------------------------------------------------------------
    def connect(self, host: str, port: int, *, refresh: bool = False) -> PeerLink:
        """Handshake with the agent at host:port (cached; ``refresh``: handshake again). Blocks for
        one handshake, at most ``config.handshake_timeout``; a cached link returns at once.
        Thread-safe (one handshake per address however many threads ask).

        Raises:
            PeerLostError: nobody answers. IncompatiblePeerError, AuthenticationError: a peer
                that must not be used.
        """
        self._check_open()
        self._require_cache()
        return self._peers.get(host, port, refresh=refresh)

    def read(self, remote: tuple[str, int], local_blocks, remote_blocks, request_id: str, *,
             timeout: float | None = None) -> TransferHandle:
        """Pull ``remote_blocks`` of ``request_id`` from the instance at ``remote`` into ``local_blocks``.

        ``remote`` is the remote instance's rank-0 side-channel address (its base port for
        its DP rank); kvxfer contacts every remote TP rank this rank needs heads from.

        ``timeout`` (default ``config.transfer_timeout``) bounds the whole read, handshake and
        claim included; it is also the transfer window the claim asks the producer for. The
        handle succeeds only if every byte arrived inside that window, so the producer's blocks
        were still held: exactly the bytes held, or a typed error. A failed read's handle ends
        once its transfers have ended (no byte lands afterwards), or its blocks are reported
        quarantined (``stats().quarantined_blocks``, ``finished().reclaimed``).

        Raises (at once): PeerLostError, IncompatiblePeerError, LayoutError, BlockIdError (ids
        that are not distinct integers in range, or a quarantined destination), LeaseExpiredError
        (the producer no longer holds the request), TransferTimeoutError (no time left). Errors
        during the transfer surface from the handle. On the same-host IPC path the kernel starts
        before the claim's answer (the round trip overlaps it): when the claim is refused, the
        destination ``local_blocks`` may have been written; nothing else is.
        """
        started = time.perf_counter()
        self._check_open()
        view = self._require_cache()
        timeout = self.config.transfer_timeout if timeout is None else timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds or None; got {timeout!r}")
        # The read's window starts now, before any claim is sent: the producer counts the same
        # window from its receipt of the claim, so it frees the blocks no earlier than we stop.
        deadline = None if timeout is None else self._clock.now() + timeout
        local = check_block_ids("local", local_blocks, self.spec.num_blocks)
        remote_ids = check_block_ids("remote", remote_blocks, _MAX_BLOCK_ID)
        note = encode_notification(request_id, self.engine_id, self.config.auth_key)
        route, parts, notify_only, claimed = self._route_and_claim(remote, view, local, remote_ids, request_id,
                                                                    note, deadline, timeout)
        on_success = None
        done_links = list(notify_only)
        if route.chunked:  # no chunk's NIXL notification tells the producer: the last Done does
            done_links += route.links
        if done_links:  # replicas we depend on but did not read from, and chunked reads: tell them
            on_success = lambda: [self._done.send(link, request_id) for link in done_links]  # noqa: E731
        try:
            if not parts:
                parts = route.start(self._kit, view, timeout, self._time_left(deadline, request_id))
            for link, part in zip(route.links, parts):
                if part.job is not None:  # no NIXL transfer carries its completion: tell the producer
                    part.on_done = partial(self._done.send, link, request_id)
            handle = self._engine.submit(request_id, Direction.READ, parts, deadline=deadline, blocks=local,
                                         on_success=on_success,
                                         mode=None if route.mode is TransferPath.DIRECT else route.mode,
                                         setup_seconds=time.perf_counter() - started, claim_seconds=claimed)
        except KvxferError:
            _cancel_jobs(parts)
            route.drop_packs(self._kit)
            self._claims.give_back(request_id)
            raise
        handle.add_done_callback(self._on_read_done)
        if self._metrics is not None:
            handle.add_done_callback(partial(self._metrics.observe, "read", route.mode))
        self._wake.set()
        return handle

    def _route_and_claim(self, remote, view, local, remote_ids, request_id: str, note: bytes,
                         deadline: float | None, timeout: float | None):
        """Choose the read's path and claim it on every producer rank it depends on.

        Returns ``(route, parts, notify_only, claim_seconds)``; ``parts`` is already started for
        the IPC path (its kernel runs while the claim travels), else empty. A peer that
        restarted since our handshake (``PeerLostError``) gets one fresh handshake and a second
        attempt, within the read's deadline. Raises what the read raises at once."""
        parts: list = []
        route = None
        for attempt in (1, 2):  # a peer that restarted since our handshake gets one fresh handshake
            links, notify_only = self._links_for(remote, self._time_left(deadline, request_id))
            try:
                route = plan_read(self._kit, self.config.transfer_path, view, links, local, remote_ids,
                                  request_id, note, self.config.allow_conversion)
                claim_started = time.perf_counter()
                # The answers are awaited no longer than the read's own timeout: a producer that
                # stalls (SIGSTOP, a long pause) fails the read within it, typed.
                sent = self._claims.send(request_id, remote_ids, links + notify_only,
                                        window=self._time_left(deadline, request_id, cap=None),
                                        timeout=self._time_left(deadline, request_id))
                try:
                    if route.mode is TransferPath.IPC:
                        # Launch while the claim travels, so its round trip overlaps the kernel. The
                        # kernel only reads the producer's (mapped) cache; if the claim is refused,
                        # the read fails and only this request's own destination blocks were written.
                        parts = route.start(self._kit, view, timeout, self._time_left(deadline, request_id))
                    elif route.mode is TransferPath.STAGED:
                        # The pack request rides right behind the claim on the same session: the
                        # producer checks the claim first, and the two round trips overlap.
                        route.send_packs(self._kit, view, timeout, self._time_left(deadline, request_id))
                except BaseException:
                    self._claims.undo(request_id, sent)
                    raise
                self._claims.answers(request_id, sent)
                claimed = time.perf_counter() - claim_started
                return route, parts, notify_only, claimed
            except KvxferError as exc:
                _cancel_jobs(parts)
                parts = []
                if route is not None:
                    route.drop_packs(self._kit)
                if not isinstance(exc, PeerLostError):
                    raise
                for link in links + notify_only:
                    self._peers.drop(link)
                if attempt == 2 or (deadline is not None and self._clock.now() >= deadline):
                    raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _time_left(self, deadline: float | None, request_id: str, cap: float | None = -1.0) -> float:
        """Seconds left of a read's window, capped by the handshake timeout (``cap=None``: uncapped,
        0 meaning no window). Raises TransferTimeoutError when none is left."""
        limit = self.config.handshake_timeout if cap == -1.0 else cap
        if deadline is None:
            return limit if limit is not None else 0.0
        left = deadline - self._clock.now()
        if left <= 0:
            raise TransferTimeoutError(f"read of {request_id!r}: its timeout passed before the transfer started")
        return left if limit is None else min(left, limit)

    def write(self, remote: tuple[str, int], local_blocks, remote_blocks, request_id: str, *,
              timeout: float | None = None) -> TransferHandle:
        """Push this producer rank's ``local_blocks`` into a consumer instance's ``remote_blocks``.

        Every consumer rank that needs heads this rank holds is written; the consumer's
        ``finished().received`` reports the request once the writes it expects arrived
        (see ``expect_writes``). A write always moves byte ranges (no staging step): layouts
        that match only in small pieces (NHD with a TP change) are written piece by piece.
        """
        self._check_open()
        view = self._require_cache()
        local = check_block_ids("local", local_blocks, self.spec.num_blocks)
        remote_ids = check_block_ids("remote", remote_blocks, _MAX_BLOCK_ID)
        head = self._peers.get(*remote)
        parts = []
        for rank in range(head.spec.tp_size):
            link = head if rank == head.spec.tp_rank else self._peers.get(remote[0], _rank_port(head, rank))
            if self.spec.tp_rank not in peer_ranks(link.spec, self.spec.tp_size):
                continue
            plan = link.plans.get("write")
            if plan is None:  # a write has no staging step: byte ranges, however small the pieces
                plan = link.plans["write"] = build_plan(link.view, view, allow_conversion=False, mode="direct")
            req = plan.for_request(remote_ids, local)
            note = encode_notification(request_id, self.engine_id, self.config.auth_key)
            parts.append(Part(link.agent_name, _Reversed(req), link.view.geometry.kind, note))
        timeout = self.config.transfer_timeout if timeout is None else timeout
        handle = self._engine.submit(request_id, Direction.WRITE, parts, timeout=timeout)
        if self._metrics is not None:
            handle.add_done_callback(partial(self._metrics.observe, "write", "direct"))
        self._wake.set()
        return handle

    def expect_writes(self, request_id: str, producers: int = 1, *, writes: int = 1) -> None:
        """Consumer side of WRITE: report ``request_id`` in ``finished().received`` only once each
        of ``producers`` producer ranks (distinct engines) has completed ``writes`` writes of it
        into this rank. Without this call a request is received at its first write.

        ``producers``: the producer ranks that write into this rank (P's TP over D's when P's is
        larger, else 1). ``writes``: how many ``write`` calls each producer makes under the id
        (a request written in chunks: one per chunk). Call it before the writes can arrive.
        Does not block; thread-safe.

        Raises:
            ConfigError: ``producers`` or ``writes`` not an integer >= 1 (names the value).
        """
        for name, value in (("producers", producers), ("writes", writes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1; got {value!r}")
        self._reports.expect_writes(request_id, producers, writes)

    def abort(self, request_id: str, remote: tuple[str, int] | None = None) -> AbortOutcome:
        """Consumer-side abort: cancel an in-flight read and tell the producer ranks to release.

        ``remote`` reaches a producer this agent has not claimed from yet (abort before read).
        A lost session or a restarted producer gets one fresh handshake. Never raises for the
        producer's state: returns what happened (``AbortOutcome``; the worst rank's outcome):
        NOT_TOLD when this agent has no claim for the request and no ``remote`` was given.

        Blocks for side-channel round trips to the producer ranks: at most
        ``config.handshake_timeout`` each (plus one handshake per lost link). The cancelled
        read's handle fails once its transfer ended (its blocks may be quarantined: see the
        error). Raises only ``ClosedError`` (a closed agent). Thread-safe.
        """
        self._check_open()
        links = self._claims.pop(request_id)  # before cancelling: the handle's callback drops it
        if self._engine is not None:
            self._engine.cancel(request_id, LeaseExpiredError(f"request {request_id!r} aborted by the consumer"))
        if links is None and remote is not None:
            try:
                links = [link for group in self._links_for(remote) for link in group]
            except KvxferError as exc:
                log.warning("abort of %r at %s:%s: %s", request_id, remote[0], remote[1], exc)
                return AbortOutcome.UNREACHABLE
        if not links:
            return AbortOutcome.NOT_TOLD
        return AbortOutcome.combine([self._claims.abort_at(link, request_id) for link in links])

    def keepalive(self, remote: tuple[str, int], request_ids: Sequence[str]) -> KeepaliveResult:
        """Heartbeat: extend the producer's leases of requests still wanted, at every rank of the
        instance at ``remote`` this rank depends on.

        Returns a ``KeepaliveResult``: ``gone`` (requests a rank no longer holds: stop waiting on
        them) and ``unreachable`` (ranks that could not be reached even after one fresh
        handshake; like ``abort``, this never raises for the producer's state).

        Blocks for one side-channel round trip per rank, at most ``config.handshake_timeout``
        each (plus one handshake per lost link). Thread-safe.

        Raises:
            ClosedError: the agent is closed.
        """
        self._check_open()
        beat = Heartbeat(list(request_ids), self.engine_id)
        try:
            links = [link for group in self._links_for(remote) for link in group]
        except KvxferError as exc:
            log.warning("keepalive at %s:%s: %s", remote[0], remote[1], exc)
            return KeepaliveResult(unreachable=((remote[0], int(remote[1])),))
        gone: set[str] = set()
        unreachable: list[tuple[str, int]] = []
        for link in links:
            try:
                ack = self._peers.call(link.host, link.port,
                                       lambda lk: lk.ask(beat, self.config.handshake_timeout))
            except ClosedError:
                raise
            except KvxferError as exc:
                log.warning("keepalive at %s (%s:%d): %s", link.engine_id, link.host, link.port, exc)
                unreachable.append((link.host, link.port))
                continue
            gone.update(ack.gone)
        return KeepaliveResult(tuple(sorted(gone)), tuple(unreachable))

    # ---- reporting -----------------------------------------------------------------
    def finished(self) -> Finished:
        """Drain and return what finished since the last call: each request is listed once,
        to whichever caller drains first, so one part of an engine should own this call (others
        ask ``status(request_id)``, which drains nothing). Does not block; thread-safe."""
        return self._reports.drain()

    def stats(self) -> AgentStats:
        """A snapshot of what this agent holds now (holds, claims, in-flight and quarantined
        transfers, side-channel sessions, rejected frames); see ``AgentStats``. Does not block
        (short locks); drains nothing; thread-safe."""
        holds = self._leases.counts()
        engine = self._engine.counts() if self._engine is not None else None
        counters = getattr(self._server, "counters", None)
        side = counters() if callable(counters) else {}
        return AgentStats(
            held_requests=holds.requests, held_blocks=holds.blocks, claimed_requests=holds.claimed,
            ending_requests=holds.ending,
            in_flight=engine.in_flight if engine else 0, draining=engine.draining if engine else 0,
            quarantined_blocks=engine.quarantined_blocks if engine else 0,
            sessions=int(side.get("sessions", 0)), rejected_frames=dict(side.get("rejected", {})),
            express_lanes=int(side.get("express", 0)))

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Stop listening, fail in-flight transfers (``ClosedError`` on their handles), deregister
        memory. Blocks up to ~5 s for the progress thread, plus up to 0.25 s per in-flight
        transfer to confirm its end. Idempotent and thread-safe; calls racing it, or made after
        it, raise ``ClosedError``. Holds end with the agent: nothing reports them afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        if self._engine is not None:
            self._engine.close()
        if self._packer is not None:
            self._packer.close()
        self._done.close()
        self._peers.close()
        if self._kit is not None:
            self._kit.close()
        self._registry.close()
        self._backend.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"agent {self.engine_id} is closed")

    def _require_cache(self) -> CacheView:
        if self._view is None:
            raise RegistrationError("register the KV cache before listening or transferring")
        return self._view

    def _peer_info(self):
        host, port = self._address or ("", 0)
        info = make_peer_info(self.engine_id, self._backend.name, self.spec, self._view.geometry,
                              self._backend.metadata(), host, port, self.config.lease_timeout,
                              express_port=getattr(self._server, "express_port", 0))
        return msgspec.structs.replace(info, **self._kit.peer_fields()) if self._kit is not None else info

    def _links_for(self, remote: tuple[str, int],
                   timeout: float | None = None) -> tuple[list[PeerLink], list[PeerLink]]:
        """Links to the remote ranks this rank reads from, and to those it only notifies."""
        host, port = remote
        head = self._peers.get(host, int(port), timeout=timeout)
        tp = head.spec.tp_size
        read = set(peer_ranks(self.spec, tp))

        def link(rank: int) -> PeerLink:
            return head if rank == head.spec.tp_rank else self._peers.get(host, _rank_port(head, rank),
                                                                          timeout=timeout)

        ranks = notify_ranks(self.spec, tp)
        return [link(r) for r in ranks if r in read], [link(r) for r in ranks if r not in read]

    def _notify_done(self, link: PeerLink, request_id: str) -> None:
        """Tell a producer that predates ``Done`` that this consumer is done (its NIXL notification)."""
        note = encode_notification(request_id, self.engine_id, self.config.auth_key)
        self._backend.notify(link.agent_name, note)

    def _on_read_done(self, handle: TransferHandle) -> None:  # a done-callback: runs on the completing thread
        self._claims.pop(handle.request_id)
        self._reports.read_done(handle)

    def _on_release(self, request_id: str, why: str) -> None:
        if self._packer is not None:
            self._packer.cancel(request_id, why)
        self._reports.released(request_id, why)

    def _unpack(self, plan, staging_addr: int) -> None:
        staging = host_view(staging_addr, plan.staging_bytes)
        geometry, spec = self._view.geometry, self.spec
        plan.unpack_numpy(staging, lambda layer, kv: host_view(int(geometry.bases[layer, kv]), spec.region_bytes))

    def _on_notification(self, peer: str, data: bytes) -> None:
        if self._kit is not None and self._kit.router.deliver(peer, data):
            return  # a staged pipeline's message, routed to its transfer
        try:
            request_id, engine_id = decode_notification(data, self.config.auth_key)
        except KvxferError as exc:
            log.warning("dropping a bad notification from %s: %s", peer, exc)
            return
        if self._leases.done(request_id, engine_id) or self._leases.held(request_id):
            return
        self._reports.write_arrived(request_id, engine_id)

    def _progress_loop(self) -> None:
        last_expire = 0.0
        while not self._closed:
            busy = False
            try:
                if self._engine is not None:
                    busy = self._engine.in_flight() > 0
                    if busy:
                        self._engine.progress()
                    if self._kit.router.active():
                        busy = True  # pipelines wait on notifications: deliver them at once
                        self._packer.reap()
                for peer, data in self._backend.notifications():
                    self._on_notification(peer, data)
                now = self._clock.now()
                if now - last_expire > 0.01:
                    self._leases.expire()
                    last_expire = now
            except ClosedError:
                return
            except Exception:  # the loop must survive anything a peer can cause
                log.exception("kvxfer progress loop")
            if busy:
                # UCX moves shared-memory data inside our polls: spin while transfers are in flight
                if self.config.progress_interval:
                    self._wake.wait(self.config.progress_interval)
                else:
                    time.sleep(0)
            else:
                self._wake.wait(0.001 if len(self._leases) else 0.005)
            self._wake.clear()


class _Reversed:
    """A RequestPlan seen from the writer: its local side is the plan's remote side."""

    def __init__(self, req) -> None:
        self.local, self.remote = req.remote, req.local
        self.num_bytes, self.staging_bytes = req.num_bytes, 0


def _cancel_jobs(parts) -> None:
    """Stop the parts that move their own bytes (an IPC kernel is waited for, not recalled)."""
    for part in parts:
        if part.job is not None:
            part.job.cancel()


def _rank_port(head: PeerLink, rank: int) -> int:
    """Side-channel port of another TP rank of the head's instance (ranks use consecutive ports)."""
    return head.port - head.spec.tp_rank + rank
