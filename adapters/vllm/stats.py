"""KvxferConnector's transfer stats in vLLM's own KV-connector stats (adapter; vLLM's metrics API
and kvxfer's public API only).

vLLM asks each worker's connector for ``get_kv_connector_stats()`` after a step, aggregates the
workers' objects, ships ``to_dict()`` to the engine core's loggers and rebuilds them there with
``build_kv_connector_stats(data)``: ``reduce()`` feeds the periodic "KV Transfer metrics" log
line and ``KvxferPromMetrics.observe`` vLLM's /metrics (``vllm:kvxfer_*``), as NixlConnector does
with ``vllm:nixl_*``. The payload is a dict of lists, one entry per observation, so aggregation
is concatenation and the object stays serializable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvxfer import TransferStats

__all__ = ["KvxferKVConnectorStats", "KvxferPromMetrics"]

#: Per-transfer observations (successful loads), then failure/expiry counts (one ``1`` each).
_SERIES = ("transfer_duration", "setup_duration", "claim_duration", "bytes_transferred", "num_descriptors")
_COUNTS = ("num_failed_transfers", "num_expired_reqs", "num_token_reads")


@dataclass
class KvxferKVConnectorStats(KVConnectorStats):
    """What this worker's loads and holds did since vLLM last asked.

    ``transfer_duration``: seconds from post to completion; ``setup_duration``: from the read call
    to the post (claim included); ``claim_duration``: the claim round trips; then bytes and
    descriptors per load. ``num_token_reads``: successful loads that read by the producer's hold
    token (no claim). ``num_failed_transfers``: loads that failed (refused, lost peer,
    timeout; cancelled loads are not failures). ``num_expired_reqs``: producer holds that ended
    without every consumer done (lease expiry or a consumer's abort).
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float | int]] = {key: [] for key in _SERIES + _COUNTS}

    def record_transfer(self, stats: TransferStats) -> None:
        self.data["transfer_duration"].append(stats.seconds)
        self.data["setup_duration"].append(stats.setup_seconds)
        self.data["claim_duration"].append(stats.claim_seconds)
        self.data["bytes_transferred"].append(stats.num_bytes)
        self.data["num_descriptors"].append(stats.descriptors)
        if getattr(stats, "by_token", False):  # proved by the producer's hold token: no claim (issue 35)
            self.data["num_token_reads"].append(1)

    def record_failed_transfer(self) -> None:
        self.data["num_failed_transfers"].append(1)

    def record_expired_req(self) -> None:
        self.data["num_expired_reqs"].append(1)

    def clone_and_reset(self) -> "KvxferKVConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def is_empty(self) -> bool:
        return all(not self.data.get(key) for key in _SERIES + _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One interval's summary for vLLM's log line (timings of successful loads only)."""
        n = self.num_successful_transfers
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num expired reqs": len(self.data["num_expired_reqs"]),
        }
        if n == 0:
            return out
        seconds = self.data["transfer_duration"]
        total_mb = sum(self.data["bytes_transferred"]) / 2**20
        total_s = sum(seconds)
        out.update({
            "Num token reads": len(self.data.get("num_token_reads", ())),
            "Avg xfer time (ms)": round(total_s / n * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
            "Avg setup time (ms)": round(sum(self.data["setup_duration"]) / n * 1e3, 3),
            "Avg claim time (ms)": round(sum(self.data["claim_duration"]) / n * 1e3, 3),
            "Avg MB per transfer": round(total_mb / n, 3),
            "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0.0,
            "Avg number of descriptors": round(sum(self.data["num_descriptors"]) / n, 1),
        })
        return out


_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_BYTES = [2 ** (10 + i) for i in range(1, 25, 2)]     # 2 KiB .. 8 GiB
_DESCRIPTORS = [1, 10, 50, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]

# data key -> (metric name, help, buckets)
_HISTOGRAMS = {
    "transfer_duration": ("vllm:kvxfer_xfer_time_seconds", "Seconds from post to completion of kvxfer KV loads.",
                          _SECONDS),
    "setup_duration": ("vllm:kvxfer_setup_time_seconds",
                       "Seconds from a kvxfer read call to its post (handshake, claim, plan).", _SECONDS),
    "claim_duration": ("vllm:kvxfer_claim_time_seconds", "Seconds of a kvxfer read's claim round trips.",
                       _SECONDS),
    "bytes_transferred": ("vllm:kvxfer_bytes_transferred", "Bytes per kvxfer KV load.", _BYTES),
    "num_descriptors": ("vllm:kvxfer_num_descriptors", "Descriptors per kvxfer KV load.", _DESCRIPTORS),
}
_COUNTERS = {
    "num_failed_transfers": ("vllm:kvxfer_num_failed_transfers",
                             "kvxfer KV loads that failed (refused, peer lost, timed out)."),
    "num_token_reads": ("vllm:kvxfer_num_token_reads",
                        "kvxfer KV loads that proved the prefill's hold by its hold token, with no claim."),
    "num_expired_reqs": ("vllm:kvxfer_num_expired_reqs",
                         "Prefill holds that ended without every decoder done (lease expiry or abort); "
                         "counted on the prefill instance."),
}


class KvxferPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvxfer_*`` histograms and counters, one child per engine, fed by ``observe``."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {
            key: self._per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                      labelnames=labelnames))
            for key, (name, doc, buckets) in _HISTOGRAMS.items()}
        self._counters = {
            key: self._per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, (name, doc) in _COUNTERS.items()}

    def _per_engine(self, metric) -> dict:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                children[engine_idx].observe(value)
        for key, children in self._counters.items():
            count = sum(transfer_stats_data.get(key, ()))
            if count:
                children[engine_idx].inc(count)
