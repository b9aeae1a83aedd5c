"""The layout layer: KV cache specs and the translator between two caches (pure; numpy only, no nixl/zmq/torch)."""

from kvxfer.layout.groups import AttentionGroup, GroupKind, HybridSpec, HybridView, StateGroup, group_kind
from kvxfer.layout.hybrid import (
    HybridPlan, HybridRequest, build_hybrid_plan, hybrid_expected_notifications, hybrid_notify_ranks,
    hybrid_peer_ranks,
)
from kvxfer.layout.plan import CacheView, TransferPlan, build_plan
from kvxfer.layout.request import RequestPlan
from kvxfer.layout.spec import DTYPE_SIZES, CacheGeometry, KVSpec, Layout, Storage
from kvxfer.layout.ssm import gdn_state, mamba1_state, mamba2_state
from kvxfer.layout.state import StateSpec, StateTensor, StateView
from kvxfer.layout.stateplan import StatePlan, build_state_plan
from kvxfer.layout.tp import expected_notifications, head_range, notify_ranks, peer_ranks

__all__ = [
    "DTYPE_SIZES",
    "AttentionGroup",
    "CacheGeometry",
    "CacheView",
    "GroupKind",
    "HybridPlan",
    "HybridRequest",
    "HybridSpec",
    "HybridView",
    "KVSpec",
    "Layout",
    "RequestPlan",
    "StateGroup",
    "StatePlan",
    "StateSpec",
    "StateTensor",
    "StateView",
    "Storage",
    "TransferPlan",
    "build_hybrid_plan",
    "build_plan",
    "build_state_plan",
    "expected_notifications",
    "gdn_state",
    "group_kind",
    "head_range",
    "hybrid_expected_notifications",
    "hybrid_notify_ranks",
    "hybrid_peer_ranks",
    "mamba1_state",
    "mamba2_state",
    "notify_ranks",
    "peer_ranks",
]
