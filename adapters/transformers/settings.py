"""What the operator configured for ``kvxfer-hf serve`` (layer: adapter; stdlib + kvxfer's public API only).

The ``--kv-transfer-config`` JSON takes vLLM's keys, so one config works for both engines:
``kv_role``, ``kv_load_failure_policy``, ``enable_permute_local_kv``, ``kv_buffer_device`` and
``kv_connector_extra_config`` (``backends``, ``transfer_timeout``, ``handshake_timeout``).
``kv_connector`` is accepted and not used (this server has one connector). The side channel
comes from the environment as for vLLM: ``KVXFER_SIDE_CHANNEL_HOST/PORT``, else
``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``; the producer lease from ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``,
else ``KVXFER_LEASE_TIMEOUT``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvxfer import AgentConfig, ConfigError
from kvxfer.config import parse_flag, parse_seconds

ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
_KNOWN = {"kv_connector", "kv_role", "kv_load_failure_policy", "enable_permute_local_kv", "kv_buffer_device",
          "kv_connector_extra_config", "kv_connector_module_path", "engine_id", "kv_rank", "kv_parallel_size"}


@dataclass(frozen=True)
class ServeSettings:
    """The KV-transfer part of a ``kvxfer-hf serve`` configuration.

    Args:
        enabled: a ``--kv-transfer-config`` was given (else no Agent: plain local serving).
        role: ``kv_producer``, ``kv_consumer`` or ``kv_both``.
        failure_policy: ``fail`` (a failed load answers HTTP 500) or ``recompute`` (prefill locally).
        allow_conversion: ``enable_permute_local_kv``; default on, since this pool is NHD and
            vLLM's CPU and GPU caches are HND.
        backends: NIXL backends; None: kvxfer's default (``KVXFER_BACKENDS``, else UCX).
        lease: seconds a prefill holds blocks nobody claimed (None: kvxfer's default).
        transfer_timeout, handshake_timeout: seconds (None: kvxfer's defaults).
    """

    enabled: bool = False
    role: str = "kv_both"
    failure_policy: str = "fail"
    allow_conversion: bool = True
    backends: tuple[str, ...] | None = None
    lease: float | None = None
    transfer_timeout: float | None = None
    handshake_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"kv_role must be one of {ROLES}; got {self.role!r}")
        if self.failure_policy not in POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {POLICIES}; got {self.failure_policy!r}")

    @property
    def produces(self) -> bool:
        return self.enabled and self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.enabled and self.role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, raw: str | None, device: str = "cpu",
              environ: Mapping[str, str] | None = None) -> "ServeSettings":
        """Read the ``--kv-transfer-config`` JSON (None: transfers off) and the environment.

        Raises:
            ConfigError: not a JSON object, an unknown key, a bad value, or ``kv_buffer_device``
                naming another device kind than the one the model runs on.
        """
        env = os.environ if environ is None else environ
        if raw is None:
            return cls()
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"--kv-transfer-config must be a JSON object; got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - _KNOWN)
        if unknown:
            raise ConfigError(f"--kv-transfer-config has unknown keys {unknown}; known: {sorted(_KNOWN)}")
        buffer = str(cfg.get("kv_buffer_device") or device.split(":")[0])
        if buffer != device.split(":")[0]:
            raise ConfigError(f"kv_buffer_device is {buffer!r} but the model runs on {device!r}; the pool lives "
                              f"with the model (set kv_buffer_device to {device.split(':')[0]!r})")
        extra = cfg.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be an object; got {extra!r}")
        backends = extra.get("backends")
        if isinstance(backends, str):
            backends = [b.strip() for b in backends.split(",") if b.strip()]
        lease = env.get(ABORT_TIMEOUT_ENV)
        return cls(
            enabled=True,
            role=cfg.get("kv_role") or "kv_both",
            failure_policy=cfg.get("kv_load_failure_policy") or "fail",
            allow_conversion=parse_flag(cfg.get("enable_permute_local_kv", True), "enable_permute_local_kv"),
            backends=None if backends is None else tuple(backends),
            lease=parse_seconds(lease, ABORT_TIMEOUT_ENV) if lease else None,
            transfer_timeout=None if extra.get("transfer_timeout") is None
            else parse_seconds(extra["transfer_timeout"], "transfer_timeout"),
            handshake_timeout=None if extra.get("handshake_timeout") is None
            else parse_seconds(extra["handshake_timeout"], "handshake_timeout"),
        )

    def agent_config(self) -> AgentConfig:
        """kvxfer's AgentConfig: side channel from the environment (KVXFER_*, then VLLM_NIXL_*)."""
        overrides: dict[str, Any] = {"allow_conversion": self.allow_conversion}
        for key, value in (("backends", self.backends), ("lease_timeout", self.lease),
                           ("transfer_timeout", self.transfer_timeout),
                           ("handshake_timeout", self.handshake_timeout)):
            if value is not None:
                overrides[key] = value
        return AgentConfig.from_env(**overrides)
