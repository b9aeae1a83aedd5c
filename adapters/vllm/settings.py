"""What the operator configured, read once from vLLM's config and the environment (no vLLM import at module level)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvxfer import AgentConfig, ConfigError
from kvxfer.config import parse_flag, parse_seconds

#: Seconds a prefill instance keeps blocks nobody claimed (the seed guide's variable; vLLM 0.32 dropped it from vllm.envs).
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"

ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class Settings:
    """The connector's configuration.

    Args:
        role: ``kv_producer``, ``kv_consumer`` or ``kv_both`` (kv_transfer_config.kv_role).
        failure_policy: ``fail`` or ``recompute`` (kv_transfer_config.kv_load_failure_policy;
            vLLM's scheduler applies it, the connector reports failures).
        backends: NIXL backends (kv_connector_extra_config.backends); None: kvxfer's default
            (``KVXFER_BACKENDS``, else UCX).
        allow_conversion: enable_permute_local_kv: allow HND <-> NHD conversion.
        cross_layers: kv_connector_extra_config.enable_cross_layers_blocks.
        buffer_device: kv_transfer_config.kv_buffer_device.
        lease: seconds a producer holds unclaimed blocks (VLLM_NIXL_ABORT_REQUEST_TIMEOUT,
            else kvxfer's KVXFER_LEASE_TIMEOUT / default).
        transfer_timeout: seconds one read may take (kv_connector_extra_config.transfer_timeout).
        handshake_timeout: seconds one side-channel round trip may take
            (kv_connector_extra_config.handshake_timeout).
        dp_rank: this engine's data-parallel rank (side-channel port offset).
    """

    role: str = "kv_both"
    failure_policy: str = "fail"
    backends: tuple[str, ...] | None = None
    allow_conversion: bool = False
    cross_layers: bool = False
    buffer_device: str = "cpu"
    lease: float | None = None
    transfer_timeout: float | None = None
    handshake_timeout: float | None = None
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"kv_role must be one of {ROLES}; got {self.role!r}")
        if self.failure_policy not in POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {POLICIES}; got {self.failure_policy!r}")

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_vllm(cls, vllm_config: Any, environ: Mapping[str, str] | None = None) -> "Settings":
        """Read ``vllm_config.kv_transfer_config``, its extra config, the parallel config and the environment."""
        env = os.environ if environ is None else environ
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        backends = extra.get("backends")  # None: kvxfer's KVXFER_BACKENDS, then UCX
        if isinstance(backends, str):
            backends = [b.strip() for b in backends.split(",") if b.strip()]
        lease = None
        if env.get(ABORT_TIMEOUT_ENV):
            lease = parse_seconds(env[ABORT_TIMEOUT_ENV], ABORT_TIMEOUT_ENV)
        timeout = extra.get("transfer_timeout")
        handshake = extra.get("handshake_timeout")
        return cls(
            role=ktc.kv_role or "kv_both",
            failure_policy=getattr(ktc, "kv_load_failure_policy", "fail") or "fail",
            backends=None if backends is None else tuple(backends),
            allow_conversion=parse_flag(getattr(ktc, "enable_permute_local_kv", False), "enable_permute_local_kv"),
            cross_layers=parse_flag(extra.get("enable_cross_layers_blocks", False), "enable_cross_layers_blocks"),
            buffer_device=str(getattr(ktc, "kv_buffer_device", "cpu") or "cpu"),
            lease=lease,
            transfer_timeout=None if timeout is None else parse_seconds(timeout, "transfer_timeout"),
            handshake_timeout=None if handshake is None else parse_seconds(handshake, "handshake_timeout"),
            dp_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0),
        )

    def agent_config(self) -> AgentConfig:
        """The kvxfer AgentConfig: side-channel host/port from the environment (KVXFER_*, then VLLM_NIXL_*)."""
        overrides: dict[str, Any] = {"dp_rank": self.dp_rank, "allow_conversion": self.allow_conversion}
        if self.backends is not None:
            overrides["backends"] = self.backends
        if self.lease is not None:
            overrides["lease_timeout"] = self.lease
        if self.transfer_timeout is not None:
            overrides["transfer_timeout"] = self.transfer_timeout
        if self.handshake_timeout is not None:
            overrides["handshake_timeout"] = self.handshake_timeout
        return AgentConfig.from_env(**overrides)
