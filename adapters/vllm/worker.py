"""Worker side of KvxferConnector: one kvxfer Agent per worker (TP rank) that holds, reads and reports.

Engine-thread calls stay short: holds and releases are local table updates; reads, aborts
and producer releases (which may handshake with a peer) run on one background thread, in
order, so a slow or dead peer never stalls a forward step.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvxfer import Agent, ConfigError, KvxferError, TransferHandle

from kvxfer_vllm.cache import CacheDescription, describe_cache
from kvxfer_vllm.metadata import LoadOrder, ReleaseOrder, StepOrders, WorkerAddress
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.stats import KvxferKVConnectorStats

log = logging.getLogger("vllm.kvxfer_vllm.worker")


class LoadRefused(KvxferError):
    """The adapter will not start this load (it could not be exact)."""


@dataclass
class _Load:
    order: LoadOrder
    started: Future                       # resolves to a TransferHandle, or raises
    cancelled: bool = False


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
                 single_group: bool) -> None:
        self._settings = settings
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._model, self._block_size = model, block_size
        self._num_kv_heads, self._head_size, self._mla = num_kv_heads, head_size, mla
        self._single_group = single_group
        self._agent: Agent | None = None
        self._cache: CacheDescription | None = None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvxfer-read-{tp_rank}")
        self._loads: dict[str, _Load] = {}
        self._kept: set[str] = set()        # producer requests vLLM keeps until we report them
        self._released: set[str] = set()    # producer requests the agent let go, not yet reported
        self._ignored: set[str] = set()     # holds dropped on vLLM's behalf: never reported
        self._stats = KvxferKVConnectorStats()  # since vLLM last asked (get_kv_connector_stats)

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
        for request_id, blocks in orders.holds.items():
            agent.hold(request_id, blocks, replace=True)  # the scheduler re-holds a request decoded past its prompt
        self._kept |= orders.kept
        for request_id in orders.dropped:
            self._ignored.add(request_id)
            agent.release(request_id)
        for order in orders.loads:
            self._loads[order.request_id] = _Load(order, self._reader.submit(self._start_read, order))
        for release in orders.releases:
            self._reader.submit(self._release_remote, release)
        for request_id in orders.cancels:
            load = self._loads.get(request_id)
            if load is not None and not load.cancelled:
                load.cancelled = True
                self._reader.submit(self._abort, load.order)

    def collect(self) -> _Reports:
        """Completions since the last call (sending, receiving, failed receives and their blocks)."""
        out = _Reports()
        if self._agent is None:
            return out
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
        for request_id, load in list(self._loads.items()):
            error = self._outcome(load)
            if error is False:
                continue
            del self._loads[request_id]
            out.recving.add(request_id)
            if error is None:
                self._stats.record_transfer(load.started.result().wait(0))
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
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- internals -----------------------------------------------------------------
    def _require_agent(self) -> Agent:
        if self._agent is None:
            raise KvxferError("the KV cache was not registered with kvxfer yet")
        return self._agent

    @staticmethod
    def _outcome(load: _Load) -> "KvxferError | None | bool":
        """False while running; None on success; the error otherwise."""
        if not load.started.done():
            return False
        error = load.started.exception()
        if error is not None:
            return error
        handle: TransferHandle = load.started.result()
        if not handle.done():
            return False
        error = handle.exception()
        if error is None:
            stats = handle.wait(0)
            log.info("kvxfer read %s: %d bytes, %d descriptors, %.3f ms (%s)", load.order.request_id,
                     stats.num_bytes, stats.descriptors, stats.seconds * 1e3, stats.mode)
        return error

    def _start_read(self, order: LoadOrder) -> TransferHandle:
        cache = self._cache
        if cache is not None and not cache.head_slices_exact and order.remote_tp_size != self._tp_size:
            raise LoadRefused(
                f"{cache.note}: a peer with TP {order.remote_tp_size} needs head slices, which this "
                f"cache description cannot place exactly (local TP {self._tp_size})")
        agent = self._require_agent()
        if cache is not None and cache.same_format_only:
            peer = agent.connect(order.host, order.port).spec
            mine = cache.spec
            if (peer.layout, peer.storage, peer.block_size) != (mine.layout, mine.storage, mine.block_size):
                raise LoadRefused(
                    f"{cache.note}: a peer with layout {peer.layout.value}, storage {peer.storage.value}, "
                    f"block size {peer.block_size} needs a conversion this cache cannot take exactly "
                    f"(local {mine.layout.value}, {mine.storage.value}, block size {mine.block_size})")
        return agent.read((order.host, order.port), list(order.local_blocks),
                          list(order.remote_blocks), order.remote_request_id)

    def _abort(self, order: LoadOrder) -> None:
        try:
            self._require_agent().abort(order.remote_request_id, remote=(order.host, order.port))
        except KvxferError as exc:
            log.warning("kvxfer: abort of %s at %s:%d: %s", order.remote_request_id, order.host, order.port, exc)

    def _release_remote(self, release: ReleaseOrder) -> None:
        try:
            self._require_agent().abort(release.remote_request_id, remote=(release.host, release.port))
        except KvxferError as exc:
            log.warning("kvxfer: release of %s at %s:%d: %s", release.remote_request_id, release.host,
                        release.port, exc)
