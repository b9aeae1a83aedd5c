"""The kvxfer SGLang backend's settings, from SGLang's server arguments and the environment
(pure: no SGLang import; the server arguments are read by attribute)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvxfer import ConfigError

__all__ = ["PORT_OFFSET", "Settings"]

#: Without ``KVXFER_SIDE_CHANNEL_PORT``, rank r of DP rank d listens at server port + this + d*tp + r.
PORT_OFFSET = 1000


@dataclass(frozen=True)
class Settings:
    model: str
    base_port: int
    transfer_timeout: float
    device_memory: bool
    pp_size: int = 1
    drop_kv: bool = False   # test knob (KVXFER_SGLANG_DROP_KV=1): prefill sends no KV, only the metadata row

    @classmethod
    def from_env(cls, server_args, env=None) -> "Settings":
        """Raises ConfigError naming a bad variable and its value."""
        env = os.environ if env is None else env
        raw = env.get("KVXFER_SIDE_CHANNEL_PORT")
        try:
            base = int(raw) if raw else int(server_args.port) + PORT_OFFSET
        except ValueError:
            raise ConfigError(f"KVXFER_SIDE_CHANNEL_PORT must be a port number; got {raw!r}") from None
        if not 0 < base < 65536:
            raise ConfigError(f"kvxfer side-channel base port must be in 1..65535; got {base}")
        raw = env.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT") or "300"
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError(f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT must be seconds; got {raw!r}") from None
        model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "")
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        return cls(model=str(model), base_port=base, transfer_timeout=timeout,
                   device_memory=device not in ("cpu",), pp_size=int(getattr(server_args, "pp_size", 1) or 1),
                   drop_kv=env.get("KVXFER_SGLANG_DROP_KV", "") == "1")
