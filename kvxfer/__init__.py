"""kvxfer: move LLM KV caches between processes and hosts over NIXL, for disaggregated prefill/decode.

    from kvxfer import Agent, AgentConfig, KVSpec

See docs/api.md for the public API and docs/architecture.md for the layers.
"""

from kvxfer.config import AgentConfig
from kvxfer.engine.handles import TransferHandle, TransferStats
from kvxfer.engine.holdwords import TokenBook, hold_tag
from kvxfer.errors import (
    AbortedError,
    AlreadyHeldError,
    AuthenticationError,
    BackendError,
    BlockIdError,
    ClosedError,
    ConfigError,
    IncompatiblePeerError,
    KvxferError,
    LayoutError,
    LeaseExpiredError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    RequestInFlightError,
    TransferError,
    TransferFailedError,
    TransferTimeoutError,
    WaitTimeout,
)
from kvxfer.layout.groups import AttentionGroup, HybridSpec, StateGroup
from kvxfer.layout.spec import CacheGeometry, KVSpec, Layout, Storage
from kvxfer.layout.state import StateSpec, StateTensor
from kvxfer.types import (
    AbortOutcome, Direction, HoldToken, KeepaliveResult, MemKind, ReadRequest, ReleaseOutcome, ReleaseReason, RequestState,
    TransferPath,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Agent pulls in the side channel (zmq) and the protocol; load it on first use so
    # `import kvxfer` stays light for tools that only need specs, errors or the proxy.
    if name in ("Agent", "AgentStats", "Announcement", "Finished", "WriteStream"):
        from kvxfer import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")


__all__ = [
    "AbortOutcome",
    "AbortedError",
    "Agent",
    "AgentConfig",
    "AgentStats",
    "AlreadyHeldError",
    "Announcement",
    "AttentionGroup",
    "AuthenticationError",
    "BackendError",
    "BlockIdError",
    "CacheGeometry",
    "ClosedError",
    "ConfigError",
    "Direction",
    "Finished",
    "HoldToken",
    "HybridSpec",
    "IncompatiblePeerError",
    "KVSpec",
    "KeepaliveResult",
    "KvxferError",
    "Layout",
    "LayoutError",
    "LeaseExpiredError",
    "MemKind",
    "PeerLostError",
    "ProtocolError",
    "ReadRequest",
    "RegistrationError",
    "ReleaseOutcome",
    "ReleaseReason",
    "RequestInFlightError",
    "RequestState",
    "StateGroup",
    "StateSpec",
    "StateTensor",
    "Storage",
    "TokenBook",
    "TransferError",
    "TransferFailedError",
    "TransferHandle",
    "TransferPath",
    "TransferStats",
    "TransferTimeoutError",
    "WaitTimeout",
    "WriteStream",
    "hold_tag",
    "__version__",
]
