"""The layout layer: KV cache specs and the translator between two caches (pure; numpy only, no nixl/zmq/torch)."""

from kvxfer.layout.plan import CacheView, TransferPlan, build_plan
from kvxfer.layout.request import RequestPlan
from kvxfer.layout.spec import DTYPE_SIZES, CacheGeometry, KVSpec, Layout, Storage
from kvxfer.layout.tp import expected_notifications, head_range, notify_ranks, peer_ranks

__all__ = [
    "DTYPE_SIZES",
    "CacheGeometry",
    "CacheView",
    "KVSpec",
    "Layout",
    "RequestPlan",
    "Storage",
    "TransferPlan",
    "build_plan",
    "expected_notifications",
    "head_range",
    "notify_ranks",
    "peer_ranks",
]
