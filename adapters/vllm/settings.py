"""What the operator configured, read once from vLLM's config and the environment (no vLLM import at module level)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvxfer import AgentConfig, ConfigError
from kvxfer.config import check_count, parse_flag, parse_seconds

log = logging.getLogger("vllm.kvxfer_vllm.settings")

#: Seconds a prefill instance keeps blocks nobody claimed (the seed guide's variable; vLLM 0.32 dropped it
#: from vllm.envs and reads ``kv_lease_duration`` instead, which wins here too).
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"

#: vLLM 0.32's NixlConnector defaults for the keys it reads from kv_connector_extra_config.
DEFAULT_LEASE_DURATION = 30.0     # kv_lease_duration
DEFAULT_NUM_THREADS = 4           # num_threads
DEFAULT_DECODER_TTL = 480.0       # decoder_kv_blocks_ttl (used with bidirectional_kv_xfer)
DEFAULT_ENGINE_TTL = 3600.0       # engine_ttl: forget a remote engine unused that long (<= 0: never)
DEFAULT_RECOMPUTE_THRESHOLD = 64  # kv_recompute_threshold (likewise)

#: Keys of kv_connector_extra_config this adapter understands (docs/vllm.md, "Configuration keys"):
#: vLLM 0.32 NixlConnector's and kvxfer's own. Others are logged once (vLLM ignores unknown keys).
KNOWN_KEYS = frozenset({
    "backends", "enable_cross_layers_blocks", "kv_lease_duration", "engine_ttl", "enforce_handshake_compat",
    "num_threads", "bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "kv_recompute_threshold",
    "transfer_timeout", "handshake_timeout", "use_hold_tokens",
})

_warned_unknown: set[str] = set()   # unknown keys already logged by this process

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
        lease: seconds a producer holds unclaimed blocks (kv_connector_extra_config.kv_lease_duration,
            else VLLM_NIXL_ABORT_REQUEST_TIMEOUT, else KVXFER_LEASE_TIMEOUT, else vLLM's 30 s;
            None: kvxfer's AgentConfig decides). A decode instance heartbeats the requests waiting in
            its queue every ``lease / 6`` seconds (``heartbeat_interval``).
        num_threads: NIXL worker threads of each backend that takes them (kv_connector_extra_config
            .num_threads, vLLM's default 4; 0: the plugin's own default).
        transfer_timeout: seconds one read may take (kv_connector_extra_config.transfer_timeout).
        handshake_timeout: seconds one side-channel round trip may take
            (kv_connector_extra_config.handshake_timeout).
        dp_rank: this engine's data-parallel rank (side-channel port offset).
        bidirectional: kv_connector_extra_config.bidirectional_kv_xfer: a decode instance keeps the
            blocks of every request it decoded for a prefill instance's next turn (``decoder_ttl``
            seconds, a kvxfer hold with that lease) and answers their kv_transfer_params; a prefill
            instance handed those params with a request loads the tokens they cover instead of
            computing them (unless fewer than ``recompute_threshold``), whatever ``role`` says.
        decoder_ttl: kv_connector_extra_config.decoder_kv_blocks_ttl (vLLM's 480 s).
        engine_ttl: kv_connector_extra_config.engine_ttl (vLLM's 3,600 s): a producer's link unused
            that long is forgotten (``AgentConfig.peer_idle_ttl``; its session closed, its NIXL
            metadata dropped; a later load handshakes afresh); <= 0: never.
        recompute_threshold: kv_connector_extra_config.kv_recompute_threshold (vLLM's 64 tokens; 0: always load).
        use_hold_tokens: a decode instance's loads read by the producer's ``remote_hold_token``
            (no claim: none of the prefill instance's CPU; docs/reliability.md, "hold tokens")
            where it proves the hold (kv_connector_extra_config.use_hold_tokens, default true;
            false: every load claims, as a decoder from before hold tokens does). A prefill
            instance always answers its hold's token (``AgentConfig.hold_words`` slots, 65,536).
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
    num_threads: int = 0
    bidirectional: bool = False
    decoder_ttl: float = DEFAULT_DECODER_TTL
    recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    use_hold_tokens: bool = True
    engine_ttl: float = DEFAULT_ENGINE_TTL

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"kv_role must be one of {ROLES}; got {self.role!r}")
        if self.failure_policy not in POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {POLICIES}; got {self.failure_policy!r}")

    @property
    def heartbeat_interval(self) -> float | None:
        """Seconds between a decode instance's heartbeats for queued requests (vLLM: lease / 6)."""
        return None if self.lease is None else self.lease / 6

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
        _check_extra_keys(extra)
        check_cache_dtype(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None))
        lease = _lease(extra, env)
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
            num_threads=_count(extra.get("num_threads", DEFAULT_NUM_THREADS), "num_threads"),
            bidirectional=parse_flag(extra.get("bidirectional_kv_xfer", False),
                                     "kv_connector_extra_config.bidirectional_kv_xfer"),
            decoder_ttl=parse_seconds(extra.get("decoder_kv_blocks_ttl", DEFAULT_DECODER_TTL),
                                      "kv_connector_extra_config.decoder_kv_blocks_ttl"),
            recompute_threshold=_count(extra.get("kv_recompute_threshold", DEFAULT_RECOMPUTE_THRESHOLD),
                                       "kv_recompute_threshold"),
            use_hold_tokens=parse_flag(extra.get("use_hold_tokens", True), "kv_connector_extra_config.use_hold_tokens"),
            engine_ttl=_number(extra.get("engine_ttl", DEFAULT_ENGINE_TTL), "engine_ttl"),
        )

    @property
    def hold_words(self) -> int:
        """Slots of each worker's table of hold words (``AgentConfig.hold_words``; 0: no tokens)."""
        return self.agent_config().hold_words

    def agent_config(self) -> AgentConfig:
        """The kvxfer AgentConfig: side-channel host/port from the environment (KVXFER_*, then VLLM_NIXL_*)."""
        overrides: dict[str, Any] = {"dp_rank": self.dp_rank, "allow_conversion": self.allow_conversion,
                                     "num_threads": self.num_threads,
                                     "peer_idle_ttl": self.engine_ttl if 0 < self.engine_ttl < float("inf") else None}
        if self.backends is not None:
            overrides["backends"] = self.backends
        if self.lease is not None:
            overrides["lease_timeout"] = self.lease
        if self.transfer_timeout is not None:
            overrides["transfer_timeout"] = self.transfer_timeout
        if self.handshake_timeout is not None:
            overrides["handshake_timeout"] = self.handshake_timeout
        return AgentConfig.from_env(**overrides)


def _count(value: Any, name: str) -> int:
    """An integer >= 0 from a config value (JSON number or numeric string, as vLLM's CLI passes both)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return check_count(value, f"kv_connector_extra_config.{name}")


def _number(value: Any, name: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{name} must be a number; got {value!r}") from None
    if number != number:
        raise ConfigError(f"kv_connector_extra_config.{name} must be a number; got {value!r}")
    return number


def _lease(extra: Mapping[str, Any], env: Mapping[str, str]) -> float:
    """kv_lease_duration, else VLLM_NIXL_ABORT_REQUEST_TIMEOUT, else KVXFER_LEASE_TIMEOUT, else 30 s."""
    if extra.get("kv_lease_duration") is not None:
        return parse_seconds(extra["kv_lease_duration"], "kv_connector_extra_config.kv_lease_duration")
    if env.get(ABORT_TIMEOUT_ENV):
        return parse_seconds(env[ABORT_TIMEOUT_ENV], ABORT_TIMEOUT_ENV)
    if env.get("KVXFER_LEASE_TIMEOUT"):
        return parse_seconds(env["KVXFER_LEASE_TIMEOUT"], "KVXFER_LEASE_TIMEOUT")
    return DEFAULT_LEASE_DURATION


#: vLLM KV-cache dtypes whose pages kvxfer describes (docs/vllm.md, "GPU attention backends' caches"):
#: one vector per token and head, of 16-bit or fp8 elements. The others (NVFP4, whose pages keep K data,
#: K scales, V data and V scales as separate per-head slots; per-token-head quantized caches with their
#: scales; TurboQuant, ...) are refused at start-up rather than moved by a description that misplaces them.
CACHE_DTYPES = ("auto", "float16", "half", "bfloat16", "float", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_cache_dtype(cache_dtype: Any) -> None:
    """Refuse a ``--kv-cache-dtype`` whose cache kvxfer cannot describe, at start-up, naming it.

    Raises:
        ConfigError: any dtype outside ``CACHE_DTYPES`` (NVFP4, per-token-head quantized, ...).
    """
    name = "auto" if cache_dtype is None else str(cache_dtype)
    if name not in CACHE_DTYPES:
        raise ConfigError(
            f"--kv-cache-dtype {name!r} is not supported by KvxferConnector: its pages hold quantized values and "
            f"their scales in an order kvxfer does not describe; supported: {', '.join(CACHE_DTYPES)}")


def _check_extra_keys(extra: Mapping[str, Any]) -> None:
    """Refuse the NixlConnector keys kvxfer cannot honour; log unknown keys once.

    Raises:
        ConfigError: ``enforce_handshake_compat`` false (kvxfer always checks).
    """
    if not parse_flag(extra.get("enforce_handshake_compat", True), "kv_connector_extra_config.enforce_handshake_compat"):
        raise ConfigError(
            "kv_connector_extra_config.enforce_handshake_compat=false cannot be honoured: kvxfer always compares "
            "the model, dtype, head size and layers and refuses a peer whose bytes it cannot place exactly; it "
            "translates TP sizes, block sizes and layouts where its description of the cache allows (docs/vllm.md)")
    unknown = sorted(set(extra) - KNOWN_KEYS - _warned_unknown)
    if unknown:
        _warned_unknown.update(unknown)
        log.warning("kvxfer: ignoring unknown kv_connector_extra_config key(s) %s (vLLM ignores them too); "
                    "known: %s", unknown, sorted(KNOWN_KEYS))
