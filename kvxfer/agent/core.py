"""``Agent``: the public face of kvxfer (layer: agent, the composition root; may import every layer).

An Agent is one TP rank's endpoint: it registers the rank's KV cache, listens on the side
channel, holds blocks for consumers (producer role), reads or writes blocks of a request
from or to peers (consumer role), and reports what finished. A background progress thread
polls transfers, notifications and lease expiry; every user-facing wait takes a deadline.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Sequence

import msgspec
import numpy as np

from kvxfer.agent.announce import Announcement, AnnouncementBook, start_announce
from kvxfer.agent.claims import Claims, lane_key
from kvxfer.agent.heartbeats import send_keepalive, tell_abort
from kvxfer.agent.hybrid import hybrid_config, hybrid_hold_ids, hybrid_reads, hybrid_spec, refuse_hybrid
from kvxfer.agent.progress import drive_once, run_progress
from kvxfer.agent.streams import WriteStream
from kvxfer.agent.notices import DoneSender
from kvxfer.agent.lanes import PeerLanes
from kvxfer.agent.peers import PeerDirectory, PeerLink
from kvxfer.agent.reads import ReadFlow, links_for
from kvxfer.agent.tokens import TokenReads, reserve_token
from kvxfer.agent.args import address, request_id as checked_id, request_ids as checked_ids
from kvxfer.agent.jobs import Deferred
from kvxfer.agent.submit import AbortJob, Submissions
from kvxfer.agent.metrics import AgentMetrics
from kvxfer.agent.parts import AgentParts
from kvxfer.agent.reports import AgentStats, Finished, Reports
from kvxfer.agent.service import ProducerService
from kvxfer.backend.base import Backend
from kvxfer.clock import Clock, MonotonicClock
from kvxfer import starter
from kvxfer.config import (AgentConfig, check_count, check_flag as flag, progress_delay_wanted,
                           progress_thread_wanted)
from kvxfer.engine.handles import TransferHandle
from kvxfer.engine.holdwords import HoldWords
from kvxfer.engine.leases import LeaseTable
from kvxfer.engine.readpaths import ReadPaths
from kvxfer.engine.staging import StagingAllocator
from kvxfer.engine.transfers import TransferEngine
from kvxfer.errors import (
    AbortedError, ClosedError, ConfigError, RegistrationError,
)
from kvxfer.layout import CacheView, KVSpec
from kvxfer.memory import MemoryRegistry, host_view
from kvxfer.memory.hybrid import register_hybrid
from kvxfer.protocol import (
    Codec, compat_hash, encode_notification, make_peer_info, new_engine_id,
)
from kvxfer.transport.address import side_channel_address
from kvxfer.transport.base import Listener, Transport
from kvxfer.transport.zmq import ZmqTransport
from kvxfer.types import (
    AbortOutcome, HoldToken, KeepaliveResult, MemKind, ReadRequest, ReleaseOutcome, ReleaseReason, RequestState,
)

__all__ = ["Agent", "Finished"]

log = logging.getLogger("kvxfer.agent")


def _part(name: str) -> property:
    """An attribute of the Agent kept in its ``AgentParts``, where the modules doing its work read it."""
    return property(lambda self: getattr(self._parts, name),
                    lambda self, value: setattr(self._parts, name, value))


class Agent:
    """One TP rank's KV-transfer endpoint. Use as a context manager, or call ``close``.

    Args:
        name: a readable name (the engine id adds a random nonce to it).
        spec: this rank's cache shape: a ``KVSpec``, or a ``HybridSpec`` (several KV-cache groups:
            docs/api.md, "Hybrid caches"; ``spec`` is then its flat-id carrier and ``hybrid`` the groups).
        config: side channel, backends, leases, timeouts (``AgentConfig.from_env()`` by default).
        backend: a ``Backend``; default a ``NixlBackend`` with ``config.backends``.
        clock: the clock leases and deadlines use (tests pass a ``ManualClock``).
        transport: the side channel's transport; default ``ZmqTransport()`` (tests may pass
            ``kvxfer.testing.MemoryTransport`` to need no ports).
    """

    # The Agent's parts live in one ``AgentParts`` (``self._parts``), handed to the modules doing
    # its work; these private names are the Agent's own views of them.
    _clock, _backend, _codec, _registry = _part("clock"), _part("backend"), _part("codec"), _part("registry")
    _reports, _announced, _leases, _service = _part("reports"), _part("announced"), _part("leases"), _part("service")
    _peers, _claims, _done, _reads = _part("peers"), _part("claims"), _part("done"), _part("reads")
    _tokens, _submit, _lanes, _metrics = _part("tokens"), _part("submit"), _part("lanes"), _part("metrics")
    _view, _paths, _engine, _words = _part("view"), _part("paths"), _part("engine"), _part("words")
    _address, _closed, _expired_at, _wake = _part("address"), _part("closed"), _part("expired_at"), _part("wake")
    _read_remotes = _part("read_remotes")

    def __init__(self, name: str, spec: KVSpec, config: AgentConfig | None = None, *,
                 backend: Backend | None = None, clock: Clock | None = None,
                 transport: Transport | None = None) -> None:
        spec = hybrid_spec(spec)  # a HybridSpec: its flat-id carrier (kvxfer/agent/hybrid.py)
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec; got {type(spec).__name__}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty str; got {name!r}")
        if config is not None and not isinstance(config, AgentConfig):
            raise ConfigError(f"config must be an AgentConfig or None; got {type(config).__name__}")
        self.spec = spec
        self.config = hybrid_config(spec, config or AgentConfig.from_env())
        self.engine_id = new_engine_id(name)
        if self.config.switch_interval is not None and sys.getswitchinterval() != self.config.switch_interval:
            log.info("agent %s: the interpreter's switch interval %.4f s -> %.4f s (switch_interval)",
                     self.engine_id, sys.getswitchinterval(), self.config.switch_interval)
            sys.setswitchinterval(self.config.switch_interval)
        clock = clock or MonotonicClock()
        if backend is None:
            from kvxfer.backend.nixl import NixlBackend  # lazy: only this module of the agent needs nixl

            thread = progress_thread_wanted(self.config.nixl_progress_thread)
            delay = progress_delay_wanted(self.config.nixl_progress_delay_us) if thread else 0
            log.info("agent %s: NIXL progress thread %s", self.engine_id,
                     ("spinning" if not delay else f"waiting up to {delay} us for UCX events") if thread else "off")
            backend = NixlBackend(f"{self.engine_id}", self.config.backends, self.config.num_threads,
                                  progress_thread=thread, progress_delay_us=delay)
        self._parts = parts = AgentParts(spec, self.config, self.engine_id, clock, backend)
        # hooks look the Agent's method up at each call (an instance may replace one)
        parts.check_open = lambda: self._check_open()
        parts.require_cache = lambda: self._require_cache()
        parts.links_for = lambda *args, **kwargs: self._links_for(*args, **kwargs)
        parts.peer_info = lambda: self._peer_info()
        parts.on_reads_done = lambda handles: self._on_reads_done(handles)
        self._codec = Codec(compat_hash(spec), key=self.config.auth_key,
                            max_bytes=self.config.max_message_bytes)
        self._registry = MemoryRegistry(backend)
        self._reports = Reports(clock=self._clock.now)
        self._announced = AnnouncementBook(self.config.lease_timeout, clock=self._clock.now)
        self._words_addr = 0                  # their address as registered with the backend (0: not)
        self._leases = LeaseTable(self.config.lease_timeout, self._clock, self._on_release, on_hold=self._on_hold,
                                  on_end=self._on_end)
        self._service = ProducerService(parts)
        self._transport: Transport = transport or ZmqTransport()
        self._server: Listener | None = None
        self._peers = PeerDirectory(self._codec, self._peer_info, backend.add_peer,
                                    backend.remove_peer, self.config.handshake_timeout,
                                    getattr(backend, "connect", None), channel=self._transport.channel,
                                    express=self.config.express_port is not None, now=self._clock.now)
        self._claims = Claims(self._peers, self.engine_id, self.config.handshake_timeout, defer=self._defer)
        self._done = DoneSender(self.engine_id, self._claims.ask_engine, notify=self._notify_done)
        self._reads = ReadFlow(parts)
        self._tokens = TokenReads(parts)
        self._submit = Submissions(parts)
        self._lanes = PeerLanes("kvxfer-peer", self._submit.run_lane, self._submit.lane_crashed)
        self._setup = threading.Lock()  # register and listen run once each, whichever thread calls
        self._thread = threading.Thread(target=self._progress_loop, name=f"kvxfer-{name}", daemon=True)
        self._thread.start()
        starter.ready()  # threads started later (lanes, prepared lists, pipelines) cost a read nothing
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
        hybrid = self.hybrid
        geometry = (register_hybrid(self._registry, hybrid, tensors) if hybrid is not None
                    else self._registry.register(self.spec, tensors))
        self._view = CacheView(self.spec, geometry)
        staging, base = None, 0
        if self.config.staging_bytes and geometry.kind is MemKind.DRAM:
            self._staging_buf = np.empty(self.config.staging_bytes, dtype=np.uint8)
            self._staging_buf.fill(0)  # fault the pages in now, not during the first transfer
            region = self._registry.register_buffer(self._staging_buf)
            staging, base = StagingAllocator(self.config.staging_bytes), region.addr
        self._paths = ReadPaths(self._backend, self.config, self._view, self._leases, self._clock)
        self._open_words()
        self._engine = TransferEngine(self._backend, geometry.kind, clock=self._clock,
                                      staging_base=base, staging=staging, unpack=self._unpack,
                                      on_reclaimed=self._reports.reclaimed,
                                      wake=self._wake.set)

    def _open_words(self) -> None:
        """The table of hold words (``config.hold_words`` slots), registered with the backend for
        consumers on other hosts; without it (0 slots, no /dev/shm) every read claims."""
        if not self.config.hold_words:
            return
        try:
            self._words = HoldWords(self.engine_id, self.config.hold_words)
        except OSError as exc:
            log.info("agent %s: no hold-word table (%s): every read of it claims", self.engine_id, exc)
            return
        try:
            self._words_addr = self._registry.register_buffer(self._words.array).addr
        except Exception as exc:  # noqa: BLE001 - same-host consumers still map it by path
            log.debug("agent %s: hold words not registered with the backend: %s", self.engine_id, exc)

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
    def hybrid(self):
        """The ``HybridSpec`` of a hybrid cache (None: one group)."""
        return getattr(self.spec, "hybrid", None)

    @property
    def cache(self) -> CacheView:
        """The registered cache's view (spec and geometry). Raises RegistrationError before ``register``."""
        return self._require_cache()

    # ---- producer ------------------------------------------------------------------
    def hold(self, request_id: str, block_ids, consumers: int | None = None,
             lease: float | None = None, consumer_engines: Sequence[str] | None = None, *,
             replace: bool = False, token: HoldToken | None = None) -> None:
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
            token: the hold's token, chosen by the caller (``TokenBook``: an engine whose answer
                leaves before this hold is made; issue 35); None: the table chooses one. Its tag
                must be ``hold_tag(request_id, block_ids)``, its slot free (or this request's) and
                its epoch above the slot's last.

        Does not block (a lock). Thread-safe.

        Raises:
            AlreadyHeldError: the request is held already (see ``replace``); names the request.
            BlockIdError: ids that are not distinct integers in range.
            ConfigError: ``consumers`` < 1, ``lease`` <= 0, bad ``consumer_engines``; a
                ``token`` that does not fit (above), with ``consumer_engines``, or with no table.
            ClosedError: the agent is closed.
        """
        self._check_open()
        checked_id(request_id)
        flag(replace, "replace")
        block_ids = hybrid_hold_ids(self.spec, block_ids)  # a hybrid cache: one list per group
        if token is not None:  # issue 35: the caller's token (kvxfer/engine/holdwords.py, reserve)
            reserve_token(self._words, request_id, block_ids, self.spec.num_blocks, token, consumer_engines)
        try:
            self._leases.hold(request_id, block_ids, self.spec.num_blocks, consumers, lease,
                              named=consumer_engines or (), replace=replace)
        except BaseException:
            if token is not None:
                self._words.unreserve(request_id)
            raise
        self._reports.forget(request_id)
        self._wake.set()

    def hold_token(self, request_id: str) -> HoldToken | None:
        """The token of ``request_id``'s current hold, to send to its consumer with the block
        ids (``ReadRequest.token``; ``kv_transfer_params``' ``remote_hold_token``): a read that
        carries it needs no claim, and so none of this process's CPU (docs/reliability.md, "hold
        tokens"). None when there is none: the request is not held, the hold names consumer
        engines (its reads claim, so the names are checked), the table is off
        (``config.hold_words=0``) or full. A ``replace`` gives a new token (the old one fails).
        Does not block; thread-safe; ConfigError for a bad ``request_id``."""
        checked_id(request_id)
        return self._words.token(request_id) if self._words is not None else None

    def release(self, request_id: str) -> ReleaseOutcome:
        """Producer-side abort: end the hold of ``request_id``; new claims are refused from now.

        The blocks may be reused at once only when this returns ``ReleaseOutcome.FREE_NOW`` (or
        NOT_HELD: nothing was held). FREE_WHEN_FINISHED: a consumer's claim window is open, a
        read may still be moving the blocks: reuse them only once ``finished()`` lists the
        request (in ``aborted``, even if that read completes). ALREADY_ENDING: an earlier
        release, abort or expiry is already waiting on a window: the same rule. See
        ``ReleaseOutcome``. Does not block; never raises for the request's state (ConfigError for
        a ``request_id`` that is not a non-empty str); thread-safe.
        """
        return self._leases.release(checked_id(request_id), ReleaseReason.ABORTED)

    def holding(self, request_id: str) -> bool:
        """True until ``request_id``'s blocks are really free (also while a release waits on a
        claim window). Does not block, drains nothing."""
        return self._leases.held(checked_id(request_id))

    def status(self, request_id: str) -> RequestState:
        """Where ``request_id`` stands on this agent, without draining anything: any number of
        parts of an engine may ask (``finished()`` has one reader: it drains).

        Producer: HELD, CLAIMED, ENDING, then SENT, ABORTED or EXPIRED (the blocks are free).
        Consumer: IN_FLIGHT from the ``read`` call (claiming included), then RECEIVED, FAILED, or QUARANTINED and later RECLAIMED. UNKNOWN:
        never seen here, or forgotten: ended requests are remembered for the most recent
        ``kvxfer.agent.reports.STATUS_MEMORY`` (10,000) of them, oldest forgotten first. A
        write's sender sees IN_FLIGHT and then UNKNOWN (its handle has the outcome). Does not
        block (locks only); thread-safe. See ``RequestState``.
        """
        live = self._leases.state(checked_id(request_id))
        if live is not None:
            return live
        if self._engine is not None and self._engine.has(request_id):
            return RequestState.IN_FLIGHT
        return self._reports.ended(request_id) or RequestState.UNKNOWN

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
        host, port = address((host, port), "connect's (host, port)")
        flag(refresh, "refresh")
        return self._peers.get(host, port, refresh=refresh, ready=True)

    def read(self, remote: tuple[str, int], local_blocks, remote_blocks, request_id: str, *,
             timeout: float | None = None, num_tokens: int | None = None) -> TransferHandle:
        """Pull ``remote_blocks`` of ``request_id`` from the instance at ``remote`` into ``local_blocks``.

        Returns at once, without waiting for any peer: the handshake (a new peer), the claim and
        the transfer run on kvxfer's own thread for that producer (one per producer, so a slow
        or frozen producer delays only its own reads). Every failure on the way surfaces on the
        handle, typed, within ``timeout``. ``read_many`` submits many reads as one step.

        ``remote`` is the remote instance's rank-0 side-channel address (its base port for
        its DP rank); kvxfer contacts every remote TP rank this rank needs heads from.

        ``num_tokens`` (default None: every token of both lists, which must cover the same
        tokens) moves exactly the first ``num_tokens`` tokens: each list holds
        ``ceil(num_tokens / its block size)`` blocks, its last one possibly partial, and no byte
        past token ``num_tokens`` of the last local block is written. Such a read whose last
        blocks are partial moves by descriptors (``transfer_path`` "direct"; "ipc" and "staged"
        refuse it with a ConfigError on the handle).

        ``timeout`` (default ``config.transfer_timeout``) bounds the whole read, handshake and
        claim included; it is also the transfer window the claim asks the producer for (a
        producer grants at most 480 s, or the hold's lease where longer; a read then ends by the
        window granted, and ``None`` asks for the hold's lease). The
        handle succeeds only if every byte arrived inside that window and the producer granted
        the claim: exactly the bytes held, or a typed error. A failed read's handle ends once its
        transfers have ended (no byte lands afterwards), or its blocks are reported quarantined
        (``stats().quarantined_blocks``, ``finished().reclaimed``).

        Raises (at once, before anything is sent): ConfigError (a bad ``timeout``),
        RequestInFlightError (``request_id`` already has a read or write in flight here, or is
        quarantined: the first one and the producer's hold are untouched), BlockIdError (ids
        that are not distinct integers in range, or a quarantined destination block; a
        ``num_tokens`` that is negative, not an integer, or that the local list does not hold
        with at most its last block partial), ClosedError, RegistrationError (no cache registered).

        On the handle: PeerLostError, IncompatiblePeerError, LayoutError, BlockIdError (remote ids
        past the producer's cache, or a remote list that does not fit ``num_tokens``),
        LeaseExpiredError (the producer no longer holds the request), TransferTimeoutError,
        TransferFailedError. A read may start moving bytes while its claim
        travels (IPC and direct paths): when the claim is refused, only this read's own
        destination ``local_blocks`` may have been written, and they stay in flight (or
        quarantined) until that move has ended.
        """
        return self.read_many([ReadRequest(remote, local_blocks, remote_blocks, request_id, timeout,
                                           num_tokens=num_tokens)])[0]

    def read_many(self, requests: Sequence[ReadRequest]) -> list[TransferHandle]:
        """Submit many reads as one step; returns one handle per request, in order, at once.

        Reads to the same producer instance go together: one claim message per producer rank
        for all of them, one kernel launch per rank for those on the same-host IPC path, and
        each direct read posted while the claims travel. Each request still completes or fails
        on its own: a refused claim fails only its request, and no block of one request is ever
        written into another's destination. Reads to different producers never wait on each
        other.

        ``requests``: a list, or any iterable (read once), of ``ReadRequest``.

        Raises (at once, nothing submitted): what ``read`` raises at once, for any request of the
        batch (two requests of the batch with one id: RequestInFlightError); ConfigError when
        ``requests`` is not an iterable of ``ReadRequest``.
        """
        started = time.perf_counter()
        self._check_open()
        self._require_cache()
        requests = hybrid_reads(self.spec, requests)  # a hybrid cache: one list per group -> flat ids
        return self._submit.reads(requests, started)

    def write(self, remote: tuple[str, int], local_blocks, remote_blocks, request_id: str, *,
              timeout: float | None = None) -> TransferHandle:
        """Push this producer rank's ``local_blocks`` into a consumer instance's ``remote_blocks``.

        Returns at once, like ``read``: the handshake and the posts run on the consumer's lane,
        and their failures surface on the handle. Every consumer rank that needs heads this rank
        holds is written; the consumer's ``finished().received`` reports the request once the
        writes it expects arrived (see ``expect_writes``). A write always moves byte ranges (no
        staging step): layouts that match only in small pieces (NHD with a TP change) are
        written piece by piece.

        Raises (at once): ConfigError, RequestInFlightError (``request_id`` already has a read or
        write in flight here), BlockIdError, ClosedError.
        """
        self._check_open()
        self._require_cache()
        refuse_hybrid(self.spec, "a write")
        return self._submit.write(remote, local_blocks, remote_blocks, request_id, timeout)

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
        producers, writes = check_count(producers, "producers", 1), check_count(writes, "writes", 1)
        self._reports.expect_writes(checked_id(request_id), producers, writes)

    # ---- push, consumer first (kvxfer/agent/announce.py, streams.py) -------------------
    def announce(self, remote: tuple[str, int], request_id: str, block_ids, *, payload: bytes = b"",
                 producers: int = 1, timeout: float | None = None) -> None:
        """Consumer first: tell the producer rank at ``remote`` (its own side-channel address) to
        push ``request_id`` into this rank's ``block_ids``, with ``payload`` (the engine's bytes,
        at most ``kvxfer.protocol.MAX_PAYLOAD``) for it. The blocks belong to the request from now
        until it is received, failed or aborted.

        ``request_id`` is received (``finished().received``, ``status``) once each of
        ``producers`` producer ranks has finished its write stream into this rank (every chunk
        landed and its ``WritesDone`` arrived); ``take_aux`` then gives their aux payloads. It
        fails (``finished().failed``, status FAILED) when the producer cannot be reached or
        refuses (PeerLostError, TransferFailedError), or when ``timeout`` (default
        ``config.transfer_timeout``) passes first (TransferTimeoutError). Needs ``listen()``:
        producers write to this rank's listener. Returns at once; the round trip runs on the
        producer's lane. Announcing to several producer ranks: one call each, same ``producers``.

        Raises (at once): BlockIdError, ConfigError (``producers``, ``timeout``, ``payload``, no
        listener), ClosedError.
        """
        refuse_hybrid(self.spec, "a push (announce)")
        start_announce(self._parts, remote, request_id, block_ids, payload, producers, timeout)

    def announced(self, request_id: str) -> tuple[Announcement, ...]:
        """Producer: the consumers' announcements of ``request_id`` (``Announcement``: consumer
        address, engine, destination blocks, payload), in arrival order; empty until one arrives,
        and again after a consumer's ``abort`` (then ``status`` says ABORTED) or ``forget_announced``.
        Kept at most ``config.lease_timeout`` seconds. Does not block; drains nothing."""
        return self._announced.get(checked_id(request_id))

    def forget_announced(self, request_id: str) -> None:
        """Producer: drop the announcements of ``request_id`` (it is pushed, or given up)."""
        self._announced.forget(checked_id(request_id))

    def open_writes(self, remote: tuple[str, int], request_id: str, *,
                    timeout: float | None = None) -> WriteStream:
        """Producer: a ``WriteStream`` pushing ``request_id`` in chunks into the consumer rank at
        ``remote`` (an ``Announcement.remote``): ``write`` each chunk, ``finish(aux)`` once, and
        ``stream.handle`` completes once (every chunk landed and the consumer took the aux).
        ``timeout`` (default ``config.transfer_timeout``) bounds each chunk's write. Does not block.

        Raises: ConfigError (``remote``, a bad ``timeout``), ClosedError, RegistrationError.
        """
        self._check_open()
        self._require_cache()
        timeout = self.config.transfer_timeout if timeout is None else timeout
        return WriteStream(self._parts, address(remote), checked_id(request_id), timeout)

    def take_aux(self, request_id: str) -> dict[str, bytes]:
        """Consumer: the aux payloads that came with a received push of ``request_id``, by producer
        engine id (empty when none). Taken once; the most recent 1,024 wait to be taken."""
        return self._reports.take_aux(checked_id(request_id))

    def abort(self, request_id: str, remote: tuple[str, int] | None = None, *,
              wait: bool = True) -> AbortOutcome | None:
        """Consumer-side abort: cancel an in-flight read and tell the producer ranks to release.

        ``remote`` reaches a producer this agent has not claimed from yet (abort before read).
        A lost session or a restarted producer gets one fresh handshake. Never raises for the
        producer's state: returns what happened (``AbortOutcome``; the worst rank's outcome):
        NOT_TOLD when this agent has no claim for the request, no read of it queued, and no
        ``remote`` was given.

        The local read is cancelled at once either way; its handle fails once its transfer ended
        (its blocks may be quarantined: see the error). ``wait=False`` returns None at once and
        tells the producer from its lane (after any read of it queued before), for an engine
        thread that must not wait on a peer. Otherwise this call blocks for side-channel round
        trips to the producer ranks: at most ``config.handshake_timeout`` each (plus one
        handshake per lost link). Raises only ``ClosedError`` (a closed agent) and, before it
        changes anything, ``ConfigError`` (a ``request_id`` that is not a non-empty str, a
        ``remote`` that is not a (host, port) pair). Thread-safe.
        """
        self._check_open()
        checked_id(request_id)
        flag(wait, "wait")
        if remote is not None:
            remote = address(remote)
        if remote is None:  # a read not yet claimed (still on its lane): its producer is known
            remote = self._read_remotes.get(request_id)
        links = self._claims.pop(request_id)  # before cancelling: the handle's callback drops it
        self._reports.cancel(request_id)      # a push (announce) of it: late writes are dropped
        if self._engine is not None:
            self._engine.cancel(request_id, AbortedError(f"request {request_id!r} aborted by the consumer"))
        if not wait:
            key = address(remote) if remote is not None else (lane_key(links[0]) if links else None)
            if key is not None:
                self._lanes.put(key, AbortJob(request_id, remote, links))
            return None
        return tell_abort(self._parts, request_id, remote, links)

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
            ConfigError: ``remote`` is not a (host, port) pair, or ``request_ids`` is not a list of
                request ids (a lone str is refused: pass ``[request_id]``).
        """
        self._check_open()
        return send_keepalive(self._parts, address(remote), checked_ids(request_ids))

    # ---- an engine's step -------------------------------------------------------------
    def poll(self) -> int:
        """Move every transfer of this agent on, on the calling thread: an engine calls it once
        per step (before ``finished()``, or before looking at its handles).

        Takes the claims' answers that have come (a granted direct read is posted here), polls
        every transfer, completes or fails the handles whose transfer ended (their done-callbacks
        run here), drains failed ones, delivers the producer-side notices that came (a read
        reported done, a write arrived: ``finished()`` lists them at once) and expires leases.
        Never waits on a peer; returns at once when another thread is doing the same. kvxfer's
        own thread does all of this too, for engines that never call it; calling it only takes
        that thread's hand-over out of the read's time.

        Returns how many of this agent's transfers are still in flight (draining and
        quarantined ones included). Raises ClosedError once closed.
        """
        self._check_open()
        drive_once(self._parts)
        return self._engine.in_flight() if self._engine is not None else 0

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
        transfer to confirm its end, plus up to 2 s for staged pipelines still writing into the
        staging area (which stays allocated if one has not ended). Idempotent and thread-safe;
        calls racing it, or made after it, raise ``ClosedError``. Holds end with the agent:
        nothing reports them afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:
            self._metrics.close()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._words is not None:  # every token read still moving fails: the memory goes away
            self._words.close()
        self._lanes.close()
        if self._server is not None:
            self._server.close()
        if self._engine is not None:
            self._engine.close()
        self._done.close()
        self._peers.close()
        if self._paths is not None:
            self._paths.close()
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
        words = self._words
        if words is not None:
            info = msgspec.structs.replace(info, hold_words=words.path, hold_slots=words.slots,
                                           hold_words_addr=self._words_addr)
        return msgspec.structs.replace(info, **self._paths.peer_fields()) if self._paths is not None else info

    def _links_for(self, remote: tuple[str, int],
                   timeout: float | None = None) -> tuple[list[PeerLink], list[PeerLink]]:
        """Links to the remote ranks this rank reads from, and to those it only notifies."""
        return links_for(self._peers, self.spec, address(remote), timeout)

    def _defer(self, key: tuple | None, fn) -> None:
        """Run ``fn`` on ``key``'s lane (a round trip that must not wait on the caller's thread)."""
        if key is None:
            return
        try:
            self._lanes.put(key, Deferred(fn, "giving a claim back"))
        except RuntimeError:  # closed: the producer's lease ends the hold
            log.debug("a claim's give-back after close: dropped")

    def _notify_done(self, link: PeerLink, request_id: str) -> None:
        """Tell a producer that predates ``Done`` that this consumer is done (its NIXL notification)."""
        note = encode_notification(request_id, self.engine_id, self.config.auth_key)
        self._backend.notify(link.agent_name, note)

    def _on_reads_done(self, handles: list[TransferHandle]) -> None:
        """Reads ended (a step's together): forget their producers and grants, report each
        (``finished``, ``status``). Runs on the completing thread, once their handles are complete
        and before their own done-callbacks (``TransferEngine``'s ``on_end``)."""
        parts = self._parts  # once: each ``_part`` property is a call
        parts.read_remotes.forget(handles)
        parts.claims.pop_many([handle.request_id for handle in handles])
        parts.reports.reads_done(handles)

    def _on_hold(self, request_id: str, ids, named: tuple, fresh: bool) -> int | None:  # inside the lease lock
        """Write the hold's word; returns its epoch (None: no token)."""
        words, token = self._words, None
        if words is not None:
            if named:  # its reads must claim (the names are checked there): no token
                words.retire(request_id)
            else:
                token = words.issue(request_id, ids)
        if fresh:  # a replace that found the old hold just ended: it replaces that hold, whose end is not reported
            self._reports.withdraw(request_id)
        return token.epoch if token is not None else None

    def _on_end(self, request_id: str, why: str) -> None:  # inside the lease table's lock
        """A hold leaves the lease table: its word changes, then its end is reported (``finished``,
        ``status``), both before ``holding`` turns False and before any next hold of the id."""
        if self._words is not None:
            self._words.retire(request_id)
        self._reports.released(request_id, why)

    def _on_release(self, request_id: str, why: str) -> None:  # after the hold left the table
        if self._paths is not None:
            self._paths.packer.cancel(request_id, why)

    def _unpack(self, plan, staging_addr: int) -> None:
        staging = host_view(staging_addr, plan.staging_bytes)
        geometry, spec = self._view.geometry, self.spec
        plan.unpack_numpy(staging, lambda layer, kv: host_view(int(geometry.bases[layer, kv]), spec.region_bytes))

    def _progress_loop(self) -> None:
        run_progress(self._parts)
