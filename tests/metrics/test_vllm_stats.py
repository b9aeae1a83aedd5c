"""The vLLM adapter's transfer stats in vLLM's own KV-connector stats, without vLLM servers:
two KvxferWorkers over real NIXL in one process fill them; vLLM's aggregation, serialization,
log summary and Prometheus observation are then run on what they reported."""

from __future__ import annotations

import json
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvxfer import TransferStats
from kvxfer.testing import free_port_block
from kvxfer_vllm.connector import KvxferConnector
from kvxfer_vllm.metadata import LoadOrder, ReleaseOrder, StepOrders
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.stats import KvxferKVConnectorStats, KvxferPromMetrics
from kvxfer_vllm.worker import KvxferWorker

N, BS, H, D, L = 8, 32, 2, 64, 3   # vLLM's CPU layout: [blocks, heads, tokens, 2 * dim] per layer
BLOCK_BYTES = L * H * BS * 2 * D * 2


def _worker(monkeypatch, name: str, seed: int) -> tuple[KvxferWorker, list[torch.Tensor]]:
    monkeypatch.setenv("KVXFER_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("KVXFER_SIDE_CHANNEL_PORT", str(free_port_block(1)))
    worker = KvxferWorker(Settings(handshake_timeout=5.0, transfer_timeout=30.0), tp_rank=0, tp_size=1,
                          model="m", block_size=BS, num_kv_heads=H, head_size=D, mla=False, single_group=True)
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(N, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]
    worker.register({f"layer{i}": t for i, t in enumerate(caches)}, N)
    return worker, caches


def _collect_until(worker: KvxferWorker, want: set[str], timeout: float = 30.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + timeout
    while not want <= got and time.monotonic() < deadline:
        got |= worker.collect().recving
        time.sleep(0.01)
    return got


def test_workers_report_loads_failures_and_expired_holds(monkeypatch):
    prod, src = _worker(monkeypatch, "prefill", 1)
    cons, dst = _worker(monkeypatch, "decode", 2)
    try:
        assert prod.stats() is None and cons.stats() is None          # nothing happened yet
        host, port = prod.address().host, prod.address().port
        prod.apply(StepOrders(holds={"p1": (1, 2, 5), "p2": (3,)}, kept={"p1", "p2"}))
        cons.apply(StepOrders(loads=[LoadOrder("d1", "p1", host, port, (0, 4, 6), (1, 2, 5)),
                                     LoadOrder("d2", "gone", host, port, (7,), (0,))]))
        assert _collect_until(cons, {"d1", "d2"}) == {"d1", "d2"}
        for layer in range(L):
            assert torch.equal(dst[layer][[0, 4, 6]], src[layer][[1, 2, 5]])
        cons.apply(StepOrders(releases=[ReleaseOrder("p2", host, port)]))   # nothing will read p2
        deadline = time.monotonic() + 30
        stats = None
        while stats is None and time.monotonic() < deadline:
            prod.collect()
            stats = prod.stats()
            time.sleep(0.01)
        assert stats is not None and stats.data["num_expired_reqs"] == [1]   # p2 released unread
        assert stats.num_successful_transfers == 0
        got = cons.stats()
        assert got.data["bytes_transferred"] == [3 * BLOCK_BYTES]
        assert got.data["num_failed_transfers"] == [1]                  # the load of a hold that is gone
        assert got.num_successful_transfers == 1 and got.data["transfer_duration"][0] > 0
        assert got.data["claim_duration"][0] > 0
        assert got.data["setup_duration"][0] >= got.data["claim_duration"][0]
        assert cons.stats() is None                                     # reset once handed to vLLM
    finally:
        cons.close()
        prod.close()


def _stats(seconds: float, num_bytes: int) -> TransferStats:
    return TransferStats("r", num_bytes=num_bytes, descriptors=6, seconds=seconds, setup_seconds=seconds * 3,
                         claim_seconds=seconds * 2)


def test_workers_stats_aggregate_serialize_and_reduce_as_vllm_does():
    a, b = KvxferKVConnectorStats(), KvxferKVConnectorStats()
    assert a.is_empty() and a.reduce()["Num successful transfers"] == 0
    a.record_transfer(_stats(0.002, 2 << 20))
    b.record_transfer(_stats(0.004, 6 << 20))
    b.record_failed_transfer()
    b.record_expired_req()
    total = a.aggregate(b)                                    # what vLLM does across workers
    shipped = json.loads(json.dumps(total.to_dict()))         # worker -> engine core: plain data
    rebuilt = KvxferConnector.build_kv_connector_stats(shipped)
    assert isinstance(rebuilt, KvxferKVConnectorStats) and rebuilt.data == total.data
    assert KvxferConnector.build_kv_connector_stats().is_empty()
    summary = rebuilt.reduce()
    assert summary["Num successful transfers"] == 2 and summary["Num failed transfers"] == 1
    assert summary["Num expired reqs"] == 1
    assert summary["Avg xfer time (ms)"] == 3.0 and summary["Avg MB per transfer"] == 4.0
    assert summary["Throughput (MB/s)"] == pytest.approx(8 / 0.006, rel=1e-3)
    assert summary["Avg claim time (ms)"] == 6.0 and summary["Avg setup time (ms)"] == 9.0
    only_failures = KvxferKVConnectorStats()
    only_failures.record_failed_transfer()
    assert not only_failures.is_empty()                       # failures alone are still reported
    assert only_failures.reduce() == {"Num successful transfers": 0, "Num failed transfers": 1,
                                      "Num expired reqs": 0}


def test_prom_metrics_observe_what_the_workers_reported():
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KvxferConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                              {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, KvxferPromMetrics)
    stats = KvxferKVConnectorStats()
    stats.record_transfer(_stats(0.002, 2 << 20))
    stats.record_transfer(_stats(0.004, 6 << 20))
    stats.record_failed_transfer()
    prom.observe(stats.to_dict(), engine_idx=1)
    labels = {"model_name": "m", "engine": "1"}
    sample = partial(registry.get_sample_value, labels=labels)
    assert registry.get_sample_value("vllm:kvxfer_xfer_time_seconds_count", labels) == 2
    assert sample("vllm:kvxfer_xfer_time_seconds_sum") == pytest.approx(0.006)
    assert sample("vllm:kvxfer_bytes_transferred_sum") == 8 << 20
    assert sample("vllm:kvxfer_claim_time_seconds_count") == 2
    assert sample("vllm:kvxfer_num_failed_transfers_total") == 1
    assert sample("vllm:kvxfer_num_expired_reqs_total") == 0
    assert registry.get_sample_value("vllm:kvxfer_xfer_time_seconds_count",
                                     {"model_name": "m", "engine": "0"}) == 0   # the other engine


def test_scheduler_role_connector_reports_no_stats():
    conn = KvxferConnector.__new__(KvxferConnector)   # vLLM asks the scheduler-side connector too
    conn._worker = None
    assert conn.get_kv_connector_stats() is None
