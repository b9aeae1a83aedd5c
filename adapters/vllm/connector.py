"""``KvxferConnector``: vLLM's KVConnectorBase_V1, forwarding to a scheduler-side or a worker-side object."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvxfer_vllm.groups import groups_of
from kvxfer_vllm.metadata import StepOrders
from kvxfer_vllm.scheduler import KvxferScheduler
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.stats import KvxferKVConnectorStats, KvxferPromMetrics
from kvxfer_vllm.worker import KvxferWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvxfer_vllm")


def _heads_and_size(vllm_config: "VllmConfig") -> tuple[int, int, bool]:
    model = vllm_config.model_config
    return model.get_total_num_kv_heads(), model.get_head_size(), bool(model.use_mla)


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill/decode over kvxfer. Built twice by vLLM: with role SCHEDULER in
    the engine core (a ``KvxferScheduler``) and with role WORKER in each worker (a ``KvxferWorker``).

    ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on, so a model of several KV-cache
    groups (full and sliding-window attention, Mamba state) moves one block list per group, each
    sliding group's cut to its window, each state group's to its running state's block
    (``kvxfer_vllm.groups``, ``kvxfer_vllm.state``; the prefill stops one token short). A model of
    one group takes the one-group path unchanged; a group kind the adapter cannot move (chunked
    local attention, ...) fails at start-up, typed, naming the group."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = Settings.from_vllm(vllm_config)
        parallel = vllm_config.parallel_config
        block_size = vllm_config.cache_config.block_size
        self._scheduler: KvxferScheduler | None = None
        self._worker: KvxferWorker | None = None
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        self._failed_blocks: set[int] = set()
        groups = groups_of(kv_cache_config, block_size) if kv_cache_config is not None else None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvxferScheduler(
                settings, engine_id=vllm_config.kv_transfer_config.engine_id or "",
                tp_size=parallel.tensor_parallel_size, block_size=block_size, groups=groups)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            heads, head_size, mla = _heads_and_size(vllm_config)
            count = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
            self._worker = KvxferWorker(
                settings, tp_rank=get_tensor_model_parallel_rank(), tp_size=parallel.tensor_parallel_size,
                model=str(vllm_config.model_config.model), block_size=block_size, num_kv_heads=heads,
                head_size=head_size, mla=mla, single_group=count == 1, groups=groups)

    # ---- class-level ------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Head-major blocks (cheap head slicing for heterogeneous TP); block-outer with cross-layer blocks.
        ``VLLM_KV_CACHE_LAYOUT`` still overrides; a backend that cannot comply keeps its own."""
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        if str(extra.get("enable_cross_layers_blocks", "")).lower() in ("true", "1"):
            return "BLHNC"
        return "LBHNC"

    # ---- scheduler side ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_orders(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid-manager call: one block list per KV-cache group (one list for a one-group model)."""
        return self._scheduler.finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_addresses(metadata)

    # ---- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register(kv_caches, self._num_blocks)

    def get_handshake_metadata(self) -> Any:
        return self._worker.address() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        orders = self._connector_metadata
        if isinstance(orders, StepOrders):
            self._worker.apply(orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (asynchronous), never inside a forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the decoder pulls; nothing to push

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Failed loads are reported per block when block ids are unique (one KV-cache group):
        # vLLM then keeps the valid prefix under "recompute". With several groups only the
        # request-level report is allowed.
        reports = self._worker.collect()
        by_block = self._worker.single_group
        self._failed_blocks = reports.failed_blocks if by_block else set()
        failed = set() if by_block else reports.failed
        return KVConnectorTransferResults(finished_sending=reports.sending,
                                          finished_recving=reports.recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- stats (vLLM's KV-connector stats; docs/metrics.md) ------------------------------
    def get_kv_connector_stats(self) -> KvxferKVConnectorStats | None:
        return self._worker.stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferKVConnectorStats:
        return KvxferKVConnectorStats(data=data) if data is not None else KvxferKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
