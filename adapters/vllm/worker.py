"""Worker side of KvxferConnector: one kvxfer Agent per worker (TP rank) that holds, reads and reports.

Engine-thread calls stay short: holds and releases are local table updates; a step's loads are
submitted together with ``Agent.read_many``, which returns at once (a known producer's loads are
claimed from this thread without waiting on it; a new one's go to kvxfer's thread for that
producer, so a slow or frozen prefill instance delays only its own loads); ``collect`` calls
``Agent.poll()`` once per step, which posts the granted loads and completes the finished ones on
vLLM's thread. Aborts and producer releases go on the producer's lane (``abort(wait=False)``).

A failed load whose destination blocks kvxfer reports quarantined (its transfer is not confirmed
ended) is not reported to vLLM until kvxfer reclaims those blocks (``finished().reclaimed``):
vLLM keeps the blocks with the request until it sees the load finished, so it can neither
recompute into them nor give them to another request while bytes may still land.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvxfer import (
    Agent, AttentionGroup, ConfigError, HoldToken, HybridSpec, KvxferError, LayoutError, ReadRequest, StateGroup,
    TransferHandle,
)

from kvxfer_vllm.cache import CacheDescription, describe_cache
from kvxfer_vllm.groups import GroupInfo
from kvxfer_vllm.metadata import HeartbeatOrder, LoadOrder, StepOrders, WorkerAddress
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.state import describe_state
from kvxfer_vllm.stats import KvxferKVConnectorStats

log = logging.getLogger("vllm.kvxfer_vllm.worker")


class LoadRefused(KvxferError):
    """The adapter will not start this load (it could not be exact)."""


@dataclass
class _Load:
    order: LoadOrder
    handle: TransferHandle | None         # None: refused before it started (``refused``)
    refused: KvxferError | None = None
    cancelled: bool = False
    held_back: bool = False               # failed with quarantined blocks, not yet reported


@dataclass
class _Reports:
    """One step's completions, as vLLM wants them."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)


class KvxferWorker:
    """Owns this worker's Agent. Producer: holds blocks per the scheduler's orders and reports
    them sent once every consumer is done (or the lease ran out). Consumer: pulls blocks and
    reports each load finished, failed or not."""

    def __init__(self, settings: Settings, *, tp_rank: int, tp_size: int, model: str,
                 block_size: int, num_kv_heads: int, head_size: int, mla: bool,
                 single_group: bool, groups: tuple[GroupInfo, ...] | None = None) -> None:
        self._settings = settings
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._model, self._block_size = model, block_size
        self._num_kv_heads, self._head_size, self._mla = num_kv_heads, head_size, mla
        self._single_group = single_group
        self._groups = groups
        self._hybrid: HybridSpec | None = None
        self._agent: Agent | None = None
        self._cache: CacheDescription | None = None
        self._loads: dict[str, _Load] = {}
        self._reclaimed: set[str] = set()   # producer request ids whose quarantined blocks are free again
        self._kept: set[str] = set()        # producer requests vLLM keeps until we report them
        self._released: set[str] = set()    # producer requests the agent let go, not yet reported
        self._ignored: set[str] = set()     # holds dropped on vLLM's behalf: never reported
        self._stats = KvxferKVConnectorStats()  # since vLLM last asked (get_kv_connector_stats)
        self._beats: ThreadPoolExecutor | None = None  # sends heartbeats off the engine thread

    # ---- set-up --------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Describe and register this worker's cache, then start listening.

        Raises:
            ConfigError: ``kv_buffer_device`` names another device than the one holding the cache
                (a host staging copy of GPU caches is not implemented).
        """
        devices = {t.device.type for t in kv_caches.values()}
        wanted = self._settings.buffer_device
        if devices != {wanted} and not (wanted == "cuda" and devices == {"hip"}):
            raise ConfigError(
                f"kv_buffer_device is {wanted!r} but the KV cache is on {sorted(devices)}; KvxferConnector "
                f"registers the cache where it lives (set kv_buffer_device to {sorted(devices)[0]!r})")
        if self._groups is not None:
            self._register_hybrid(kv_caches, num_blocks)
            return
        self._cache = describe_cache(
            list(kv_caches.values()), num_blocks=num_blocks, block_size=self._block_size,
            num_kv_heads=self._num_kv_heads, head_size=self._head_size, tp_rank=self._tp_rank,
            tp_size=self._tp_size, model=self._model, mla=self._mla)
        agent = Agent(f"vllm-tp{self._tp_rank}", self._cache.spec, self._settings.agent_config())
        try:
            agent.register(self._cache.tensors)
            host, port = agent.listen()
        except BaseException:
            agent.close()
            raise
        self._agent = agent
        spec = self._cache.spec
        log.info("kvxfer agent %s on %s:%d: %d layers x %d blocks, %s/%s, heads %d/%d, %s%s",
                 agent.engine_id, host, port, spec.num_layers, spec.num_blocks, spec.layout.value,
                 spec.storage.value, spec.heads_per_rank, spec.num_kv_heads, spec.dtype,
                 f" ({self._cache.note})" if self._cache.note else "")

    def _register_hybrid(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Every transferred group's layers described as one group of a ``HybridSpec``: an
        ``AttentionGroup`` per attention group, a ``StateGroup`` per Mamba group (one page per
        block holding a layer's state tensors: ``kvxfer_vllm.state``). vLLM's groups share tensors
        (layer i of each group lives in one tensor), which kvxfer registers once; the block ids
        vLLM hands each group never collide.

        Raises:
            LayoutError: a group's layers missing from ``kv_caches`` (names the group and layer), or
                a group whose description only places whole blocks of one format (kvxfer's
                hybrid reads convert layouts, so they need an exact description).
        """
        groups, tensors, notes, first = [], [], [], None
        for g in self._groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise LayoutError(f"KV-cache group {g.name}: layers {missing} have no KV-cache tensor "
                                  f"(vLLM gave {sorted(kv_caches)[:6]}...)")
            if g.kind == "state":
                spec, pages = describe_state(g, [kv_caches[n] for n in g.layer_names], num_blocks=num_blocks,
                                             tp_rank=self._tp_rank, tp_size=self._tp_size, model=self._model)
                groups.append(StateGroup(spec, name=g.name))
                tensors.append(pages)
                continue
            desc = describe_cache(
                [kv_caches[n] for n in g.layer_names], num_blocks=num_blocks, block_size=g.block_size,
                num_kv_heads=self._num_kv_heads, head_size=self._head_size, tp_rank=self._tp_rank,
                tp_size=self._tp_size, model=self._model, mla=self._mla)
            if desc.same_format_only or not desc.head_slices_exact:
                notes.append(f"{g.name}: {desc.note}")
            groups.append(AttentionGroup(desc.spec, sliding_window=g.sliding_window, name=g.name))
            tensors.append(desc.tensors)
            first = first or desc
        desc = first
        self._cache = CacheDescription(desc.spec, [], head_slices_exact=not notes, same_format_only=bool(notes),
                                       note="; ".join(notes))
        self._hybrid = HybridSpec(tuple(groups))
        agent = Agent(f"vllm-tp{self._tp_rank}", self._hybrid, self._settings.agent_config())
        try:
            agent.register(tensors)
            host, port = agent.listen()
        except BaseException:
            agent.close()
            raise
        self._agent = agent
        log.info("kvxfer agent %s on %s:%d: hybrid cache of %d groups %s, %d blocks, heads %d/%d, %s%s",
                 agent.engine_id, host, port, len(groups),
                 [(g.name, len(g.layer_names), g.sliding_window) for g in self._groups], num_blocks,
                 desc.spec.heads_per_rank, desc.spec.num_kv_heads, desc.spec.dtype,
                 "".join(f"; state group {g.name}: tensors "
                         f"{[(t.name, t.dtype, t.opaque_elements) for t in g.spec.tensors]}, pages of "
                         f"{g.spec.slot_stride} bytes" for g in groups if isinstance(g, StateGroup)))

    @property
    def single_group(self) -> bool:
        """The model has one KV-cache group, so block ids name blocks unambiguously."""
        return self._single_group

    def address(self) -> WorkerAddress | None:
        if self._agent is None or self._agent.address is None:
            return None
        host, port = self._agent.address
        return WorkerAddress(host, port, self._agent.engine_id, self._tp_rank)

    # ---- per step ------------------------------------------------------------------
    def apply(self, orders: StepOrders) -> None:
        """Carry out one step's orders (called before the forward pass)."""
        agent = self._require_agent()
        for request_id in orders.dropped:  # first: their slots of hold words may be this step's holds'
            self._ignored.add(request_id)
            agent.release(request_id)
        for request_id, blocks in orders.holds.items():
            if self._groups is not None:
                blocks = [list(ids) for ids in blocks]   # one list per group
            self._hold(agent, request_id, blocks, orders.tokens.get(request_id), orders.hold_leases.get(request_id))
        self._kept |= orders.kept
        self._start_loads(agent, orders.loads)
        for release in orders.releases:
            agent.abort(release.remote_request_id, remote=(release.host, release.port), wait=False)
        for beat in orders.heartbeats:
            self._send_heartbeat(agent, beat)
        for request_id in orders.cancels:
            load = self._loads.get(request_id)
            if load is not None and not load.cancelled:
                load.cancelled = True
                agent.abort(load.order.remote_request_id, remote=(load.order.host, load.order.port), wait=False)

    def collect(self) -> _Reports:
        """Completions since the last call (sending, receiving, failed receives and their blocks)."""
        out = _Reports()
        if self._agent is None:
            return out
        # Once per step, on vLLM's own thread: the loads whose claim was answered are posted, and
        # every transfer that ended completes here, so this step's report has it (no hand-over
        # from kvxfer's threads), and the producer side's done notices are delivered.
        self._agent.poll()
        fin = self._agent.finished()
        for _ in (fin.expired | fin.aborted) - self._ignored:  # ended without every decoder done
            self._stats.record_expired_req()
        self._released |= fin.freed
        for request_id in list(self._released):
            if request_id in self._ignored:
                self._ignored.discard(request_id)
                self._released.discard(request_id)
            elif request_id in self._kept:
                self._kept.discard(request_id)
                self._released.discard(request_id)
                out.sending.add(request_id)
        self._reclaimed |= fin.reclaimed
        for request_id, load in list(self._loads.items()):
            error = self._outcome(load)
            if error is False or self._held_back(load, error):
                continue
            del self._loads[request_id]
            out.recving.add(request_id)
            if error is None:
                self._stats.record_transfer(load.handle.wait(0))
            elif not load.cancelled:
                self._stats.record_failed_transfer()
            if error is not None:
                out.failed.add(request_id)
                out.failed_blocks.update(load.order.local_blocks)
                if load.cancelled:
                    continue
                log.warning("kvxfer: load of %s (producer request %s at %s:%d) failed: %s",
                            request_id, load.order.remote_request_id, load.order.host,
                            load.order.port, error)
        return out

    def stats(self) -> KvxferKVConnectorStats | None:
        """What loads and holds did since the last call (counted in ``collect``), or None if nothing."""
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    def close(self) -> None:
        if self._beats is not None:
            self._beats.shutdown(wait=False, cancel_futures=True)
            self._beats = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- internals -----------------------------------------------------------------
    @staticmethod
    def _hold(agent: Agent, request_id: str, blocks, token, lease: float | None) -> None:
        """Hold under the scheduler's token (issue 35: its answer carries it); the scheduler
        re-holds a request decoded past its prompt (``replace``). ``lease``: the hold's own (a
        decode instance's blocks kept for the next turn), else the agent's."""
        if token is not None:
            try:
                agent.hold(request_id, blocks, replace=True, token=HoldToken(*token), lease=lease)
                return
            except ConfigError as exc:  # e.g. its slot still ends another hold: reads by that token fail typed
                log.warning("kvxfer: hold of %s without the scheduler's token (its token reads will fail and "
                            "be reported as failed loads): %s", request_id, exc)
        agent.hold(request_id, blocks, replace=True, lease=lease)

    def _send_heartbeat(self, agent: Agent, beat: HeartbeatOrder) -> None:
        """``Agent.keepalive`` on a helper thread (it waits for the producer's answer); never raises."""
        if self._beats is None:
            self._beats = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-heartbeat")

        def send() -> None:
            try:
                result = agent.keepalive((beat.host, beat.port), list(beat.remote_request_ids))
            except KvxferError as exc:  # closed while queued
                log.debug("kvxfer: heartbeat to %s:%d not sent: %s", beat.host, beat.port, exc)
                return
            if result.gone or result.unreachable:
                log.warning("kvxfer: heartbeat to %s:%d: no longer held %s, unreachable %s",
                            beat.host, beat.port, list(result.gone), list(result.unreachable))

        self._beats.submit(send)

    def _require_agent(self) -> Agent:
        if self._agent is None:
            raise KvxferError("the KV cache was not registered with kvxfer yet")
        return self._agent

    def _held_back(self, load: _Load, error) -> bool:
        """Whether a failed load waits for kvxfer to reclaim its quarantined blocks (see the module
        doc); True until ``finished().reclaimed`` named its producer request."""
        quarantined = getattr(error, "quarantined_blocks", None) if error else None
        rid = load.order.remote_request_id
        if not quarantined or rid in self._reclaimed:
            self._reclaimed.discard(rid)
            return False
        if not load.held_back:
            load.held_back = True
            log.warning("kvxfer: load of %s failed with %d blocks quarantined (its transfer is not confirmed "
                        "ended): reported to vLLM once kvxfer reclaims them (%s)", load.order.request_id,
                        len(quarantined), error)
        return True

    @staticmethod
    def _outcome(load: _Load) -> "KvxferError | None | bool":
        """False while running; None on success; the error otherwise."""
        if load.handle is None:
            return load.refused
        if not load.handle.done():
            return False
        error = load.handle.exception()
        if error is None:
            stats = load.handle.wait(0)
            log.info("kvxfer read %s: %d bytes, %d descriptors, %.3f ms (%s%s)", load.order.request_id,
                     stats.num_bytes, stats.descriptors, stats.seconds * 1e3, stats.mode,
                     ", by hold token" if stats.by_token else "")
        return error

    def _start_loads(self, agent: Agent, orders: list[LoadOrder]) -> None:
        """Submit a step's loads together (never waits on a peer); a load refused at once fails alone."""
        cache = self._cache
        ready: list[LoadOrder] = []
        state = self._hybrid is not None and any(isinstance(g, StateGroup) for g in self._hybrid.groups)
        for order in orders:
            if state and order.remote_tp_size != self._tp_size:
                self._loads[order.request_id] = _Load(order, None, LoadRefused(
                    f"a hybrid cache with a state group moves between equal TP sizes only: the producer has TP "
                    f"{order.remote_tp_size}, this decode TP {self._tp_size}"))
            elif cache is not None and not cache.head_slices_exact and order.remote_tp_size != self._tp_size:
                self._loads[order.request_id] = _Load(order, None, LoadRefused(
                    f"{cache.note}: a peer with TP {order.remote_tp_size} needs head slices, which this "
                    f"cache description cannot place exactly (local TP {self._tp_size})"))
            else:
                ready.append(order)
        same_format = bool(cache is not None and cache.same_format_only)
        requests = [ReadRequest((o.host, o.port), _ids(o.local_blocks), _ids(o.remote_blocks),
                                o.remote_request_id, same_format=same_format, num_tokens=o.num_tokens,
                                token=HoldToken(*o.hold_token) if o.hold_token is not None else None)
                    for o in ready]
        try:
            handles = agent.read_many(requests)
        except KvxferError:  # one bad load refuses the batch: submit them one by one to find it
            for order, request in zip(ready, requests):
                try:
                    self._loads[order.request_id] = _Load(order, agent.read_many([request])[0])
                except KvxferError as exc:
                    self._loads[order.request_id] = _Load(order, None, exc)
            return
        for order, handle in zip(ready, handles):
            self._loads[order.request_id] = _Load(order, handle)


def _ids(blocks: Any) -> list:
    """A load's ids as ``ReadRequest`` takes them: a flat list (one group) or one list per group."""
    blocks = list(blocks)
    return [list(g) for g in blocks] if blocks and isinstance(blocks[0], (list, tuple)) else blocks
