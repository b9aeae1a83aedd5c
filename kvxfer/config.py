"""Agent configuration and its environment variables (layer: config; stdlib + errors only)."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from kvxfer.errors import ConfigError
from kvxfer.types import TransferPath

__all__ = ["AgentConfig", "DEFAULT_LEASE_TIMEOUT", "PROGRESS_THREAD_MIN_CORES", "TRANSFER_PATHS", "check_count",
           "check_flag", "check_port", "check_seconds", "parse_flag", "parse_seconds", "progress_delay_wanted",
           "progress_thread_wanted"]

#: Ways ``Agent.read`` may move a request (see ``AgentConfig.transfer_path``).
TRANSFER_PATHS = ("auto", "ipc", "staged", "direct")

#: The least ``max_message_bytes`` may be: a handshake carries the NIXL agent's metadata.
MIN_MESSAGE_BYTES = 64 << 10

#: Hard cap a producer holds an unclaimed request's blocks (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default).
DEFAULT_LEASE_TIMEOUT = 480.0


def parse_flag(value: Any, name: str) -> bool:
    """A boolean as configs carry it: a JSON boolean, 0/1, or a string ("True", "off", "1", "").

    Raises:
        ConfigError: anything else (names ``name`` and the value).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be a boolean; got {value!r}")


def parse_seconds(raw: Any, name: str) -> float:
    """A positive number of seconds from a config value (number or numeric string).

    Raises:
        ConfigError: not a number, or not positive and finite (names ``name`` and the value).
    """
    if isinstance(raw, bool):
        raise ConfigError(f"{name} must be a number of seconds; got {raw!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of seconds; got {raw!r}") from None
    if not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive, finite number of seconds; got {raw!r}")
    return value


def check_seconds(value: Any, name: str, *, none: bool = False) -> float | None:
    """A positive, finite number of seconds passed in code (an int or float, numpy's included; not a
    bool or a string: text from files and the environment goes through ``parse_seconds``).

    Args:
        none: None is allowed (and returned): "no limit".

    Raises:
        ConfigError: anything else (names ``name`` and the value).
    """
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        allowed = " or None" if none else ""
        raise ConfigError(f"{name} must be a positive, finite number of seconds{allowed}; got {value!r}")
    return float(value)


def check_flag(value: Any, name: str) -> bool:
    """A switch passed in code: True or False (numpy's bool too), never a truthy string like "no".

    Raises:
        ConfigError: anything else (names ``name`` and the value).
    """
    numpy_bool = getattr(value, "dtype", None) is not None and value.dtype.kind == "b" and value.ndim == 0
    if not isinstance(value, bool) and not numpy_bool:
        raise ConfigError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def check_count(value: Any, name: str, low: int = 0, high: int | None = None) -> int:
    """An integer in ``[low, high]`` passed in code (numpy's ints too; not a bool, a float or a string).

    Raises:
        ConfigError: anything else (names ``name``, the range and the value).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be an integer {span}; got {value!r}")
    return int(value)


def check_port(value: Any, name: str) -> int:
    """A TCP port in [0, 65535] (0: any free port): an integer, or its decimal text.

    Raises:
        ConfigError: anything else (names ``name`` and the value).
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be a port number in [0, 65535]; got {value!r}")
    return int(value)


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    return None if raw is None or raw == "" else parse_seconds(raw, name)


#: ``nixl_progress_delay_us=None`` (auto) lets NIXL's progress thread spin (NIXL's own way) only
#: where the process may use at least this many cores.
PROGRESS_THREAD_MIN_CORES = 8
#: Below that, the thread waits in ``poll()`` on its UCX workers' event fds between rounds, for
#: at most this long (NIXL rounds it up to whole milliseconds): idle it takes ~1% of a core
#: instead of a whole one, and it still wakes as soon as UCX has work (docs/benchmarks.md).
PROGRESS_DELAY_US = 1000


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def progress_thread_wanted(setting: bool | None) -> bool:
    """Whether an agent runs NIXL's progress thread: ``setting`` itself; ``None`` (auto): yes."""
    return True if setting is None else setting


def progress_delay_wanted(setting: int | None) -> int:
    """Microseconds NIXL's progress thread may wait between rounds: ``setting`` itself; ``None``
    (auto): 0 (spin) where this process may use ``PROGRESS_THREAD_MIN_CORES`` cores or more,
    ``PROGRESS_DELAY_US`` below."""
    if setting is not None:
        return setting
    return 0 if _cores() >= PROGRESS_THREAD_MIN_CORES else PROGRESS_DELAY_US


@dataclass(frozen=True)
class AgentConfig:
    """How an Agent talks to its peers.

    Args:
        side_channel_host: address the listener binds and advertises. ``None``: env
            ``KVXFER_SIDE_CHANNEL_HOST``, then ``VLLM_NIXL_SIDE_CHANNEL_HOST``, then a routable
            address of this host.
        side_channel_port: base port. ``None``: env ``KVXFER_SIDE_CHANNEL_PORT``, then
            ``VLLM_NIXL_SIDE_CHANNEL_PORT``, then 5600. The agent of TP rank r in DP rank d
            listens at ``base + d * tp_size + r``.
        dp_rank: data-parallel rank of this agent's instance.
        backends: NIXL backends (plugins) to instantiate, in order of preference.
        lease_timeout: seconds a producer holds blocks nobody has claimed or heartbeated.
        auth_key: shared secret for HMAC on the side channel (env ``KVXFER_AUTH_KEY``).
        allow_conversion: allow staged transfers that permute layouts (HND <-> NHD).
        handshake_timeout: deadline for one side-channel round trip.
        transfer_timeout: default deadline for one transfer (``None``: wait for ever).
        staging_bytes: host staging buffer registered for staged (converting) transfers.
        progress_interval: seconds the progress thread sleeps between polls while transfers are
            in flight (env ``KVXFER_PROGRESS_INTERVAL``, in [0, 1]); 0 (default) spins, since UCX
            moves shared-memory data inside the polls.
        max_message_bytes: largest side-channel frame accepted.
        transfer_path: how reads move data (env ``KVXFER_TRANSFER_PATH``): ``auto`` (default:
            same-host CUDA IPC when the peer's cache maps here, else the staged pipeline with
            producer-side pack for GPU caches whose plan is many short descriptors, else direct
            descriptors), or force ``ipc``, ``staged`` (also on host memory) or ``direct``.
        pipeline_slot_bytes, pipeline_slots: the staged pipeline's registered staging area
            (``slots`` x ``slot_bytes``; one piece moves as one descriptor of at most a slot).
        nixl_progress_thread: run NIXL's own progress thread (env ``KVXFER_NIXL_PROGRESS_THREAD``,
            ``0``/``1``/``auto``; ``None``, the default, is on). It progresses UCX without the
            Python interpreter, so a producer whose engine thread is busy in Python still serves
            reads over transports that need the target's progress (TCP). Off, the agent's
            progress loop drives UCX: it polls without pause while its own transfers are in
            flight, and a producer polls every 1 ms while it holds blocks.
        nixl_progress_delay_us: how long that thread may wait in ``poll()`` for UCX events between
            rounds (env ``KVXFER_NIXL_PROGRESS_DELAY_US``; NIXL rounds it up to whole ms). ``0``
            spins, as NIXL does by itself: one core busy per agent even when idle. ``None``
            (auto, the default): 0 where this process may use at least
            ``PROGRESS_THREAD_MIN_CORES`` (8) cores, ``PROGRESS_DELAY_US`` (1 ms) below (on a 2-core
            host spinning threads took the CPU the transfers needed: docs/benchmarks.md, "NIXL's
            progress thread").
        metrics_port: serve Prometheus metrics over HTTP from this base port (env ``KVXFER_METRICS_PORT``;
            ``None``, the default: no metrics; ``0``: a free port, read it from ``Agent.metrics_address``).
            Like the side channel, TP rank r of DP rank d serves on ``base + d * tp_size + r``.
            Binds ``side_channel_host`` when set, else every interface. Needs ``prometheus-client``
            (``pip install kvxfer[metrics]``); docs/metrics.md lists the metrics.
        num_threads: worker threads of each NIXL backend that takes them (UCX, LIBFABRIC, OBJ,
            GDS_MT, UCCL); 0 (default): the plugin's own default.
        express_port: where this agent's *express lane* listens (env ``KVXFER_EXPRESS_PORT``): after
            the handshake on the ZMQ side channel, each session's claims, Done, aborts and
            heartbeats travel on one plain TCP connection to this port, which wakes fewer threads
            per round trip (docs/protocol.md). ``0`` (default): a free port, announced in the
            handshake; a number: ``base + d * tp_size + r`` like the side channel (for firewalls);
            ``None`` (env ``off``): no lane here, and none used towards peers.
        hold_words: slots of this producer's table of hold words (16 bytes each, in ``/dev/shm``):
            a hold gets a token (``Agent.hold_token``) whose reads need no claim
            (docs/reliability.md, "hold tokens"). ``0``: no table; every read claims.
        switch_interval: set the Python interpreter's thread switch interval
            (``sys.setswitchinterval``, seconds, in (0, 0.1]) when the agent is created (env
            ``KVXFER_SWITCH_INTERVAL``); ``None`` (default): leave it (CPython's is 5 ms). While an
            engine thread runs Python, kvxfer's threads (a producer answering claims, a consumer's
            progress) get the interpreter only at such a switch: with the producer's engine thread
            100% busy a claimed read took 3x its idle time at 5 ms and 1x at 0.5 ms
            (docs/benchmarks.md, "Busy engines"). It is process-wide: the engine owner's choice.
        peer_idle_ttl: seconds a producer's link may go unused before this agent forgets it (env
            ``KVXFER_PEER_IDLE_TTL``): its side-channel session closes and the backend drops the
            peer's metadata; a later read handshakes afresh. A link with a read of this agent in
            flight or quarantined on its host is kept. ``None`` (default) or ``0``: never forget a
            live peer (vLLM's ``engine_ttl``).
    """

    side_channel_host: str | None = None
    side_channel_port: int | None = None
    dp_rank: int = 0
    backends: tuple[str, ...] = ("UCX",)
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    auth_key: bytes | None = None
    allow_conversion: bool = True
    handshake_timeout: float = 10.0
    transfer_timeout: float | None = 120.0
    staging_bytes: int = 64 << 20
    progress_interval: float = 0.0
    max_message_bytes: int = 4 << 20
    transfer_path: str | TransferPath = "auto"
    pipeline_slot_bytes: int = 16 << 20
    pipeline_slots: int = 8
    nixl_progress_thread: bool | None = None
    nixl_progress_delay_us: int | None = None
    metrics_port: int | None = None
    express_port: int | None = 0
    num_threads: int = 0
    hold_words: int = 65_536
    switch_interval: float | None = None
    peer_idle_ttl: float | None = None

    def __post_init__(self) -> None:
        set_ = partial(object.__setattr__, self)
        if self.side_channel_host is not None and (not isinstance(self.side_channel_host, str)
                                                   or not self.side_channel_host.strip()):
            raise ConfigError(f"side_channel_host must be a host name or address, or None; "
                              f"got {self.side_channel_host!r}")
        if self.side_channel_port is not None:
            set_("side_channel_port", check_port(self.side_channel_port, "side_channel_port"))
        set_("dp_rank", check_count(self.dp_rank, "dp_rank"))
        backends = self.backends
        if isinstance(backends, (str, bytes)) or not isinstance(backends, (list, tuple)) or not backends \
                or not all(isinstance(b, str) and b for b in backends):
            raise ConfigError(f"backends must be a non-empty list of backend names; got {backends!r}")
        set_("backends", tuple(backends))
        for name in ("lease_timeout", "handshake_timeout"):
            set_(name, check_seconds(getattr(self, name), name))
        set_("transfer_timeout", check_seconds(self.transfer_timeout, "transfer_timeout", none=True))
        if isinstance(self.auth_key, str):
            set_("auth_key", self.auth_key.encode())
        if self.auth_key is not None and not isinstance(self.auth_key, bytes):
            raise ConfigError(f"auth_key must be bytes, a str or None; got {type(self.auth_key).__name__}")
        set_("allow_conversion", check_flag(self.allow_conversion, "allow_conversion"))
        set_("staging_bytes", check_count(self.staging_bytes, "staging_bytes"))
        set_("num_threads", check_count(self.num_threads, "num_threads", 0, 1024))
        set_("hold_words", check_count(self.hold_words, "hold_words", 0, 1 << 24))
        if self.switch_interval is not None:
            seconds = check_seconds(self.switch_interval, "switch_interval")
            if seconds > 0.1:
                raise ConfigError(f"switch_interval must be a number of seconds in (0, 0.1] or None; "
                                  f"got {self.switch_interval!r}")
            set_("switch_interval", float(seconds))
        if self.peer_idle_ttl is not None:
            ttl = self.peer_idle_ttl
            if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real) or not ttl >= 0 or ttl == float("inf"):
                raise ConfigError(f"peer_idle_ttl must be a number of seconds >= 0 or None; got {ttl!r}")
            set_("peer_idle_ttl", float(ttl) if ttl > 0 else None)
        set_("max_message_bytes", check_count(self.max_message_bytes, "max_message_bytes", MIN_MESSAGE_BYTES))
        if not isinstance(self.transfer_path, str) or self.transfer_path not in TRANSFER_PATHS:
            raise ConfigError(f"transfer_path must be one of {', '.join(TRANSFER_PATHS)}; "
                              f"got {self.transfer_path!r}")
        set_("transfer_path", TransferPath(self.transfer_path))  # equal to its string
        set_("pipeline_slot_bytes", check_count(self.pipeline_slot_bytes, "pipeline_slot_bytes", 256))
        if self.pipeline_slot_bytes % 256:
            raise ConfigError(f"pipeline_slot_bytes must be a positive multiple of 256; "
                              f"got {self.pipeline_slot_bytes!r}")
        set_("pipeline_slots", check_count(self.pipeline_slots, "pipeline_slots", 1, 4096))
        pi = self.progress_interval
        if isinstance(pi, bool) or not isinstance(pi, numbers.Real) or not 0 <= pi <= 1:
            raise ConfigError(f"progress_interval must be a number of seconds in [0, 1]; got {pi!r}")
        if self.nixl_progress_thread is not None and not isinstance(self.nixl_progress_thread, bool):
            raise ConfigError(f"nixl_progress_thread must be True, False or None (auto); "
                              f"got {self.nixl_progress_thread!r}")
        if self.nixl_progress_delay_us is not None:
            set_("nixl_progress_delay_us", check_count(self.nixl_progress_delay_us, "nixl_progress_delay_us",
                                                       0, 10_000_000))
        for name in ("metrics_port", "express_port"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, str) or not isinstance(value, numbers.Integral)
                                      or isinstance(value, bool) or not 0 <= value <= 65535):
                raise ConfigError(f"{name} must be an integer in [0, 65535] or None; got {value!r}")

    @classmethod
    def from_env(cls, **overrides) -> "AgentConfig":
        """A config whose unset fields come from kvxfer's environment variables."""
        values: dict = {}
        key = os.environ.get("KVXFER_AUTH_KEY")
        if key:
            values["auth_key"] = key.encode()
        lease = _env_float("KVXFER_LEASE_TIMEOUT")
        if lease is not None:
            values["lease_timeout"] = lease
        backends = os.environ.get("KVXFER_BACKENDS")
        if backends:
            values["backends"] = tuple(b.strip() for b in backends.split(",") if b.strip())
            if not values["backends"]:
                raise ConfigError(f"KVXFER_BACKENDS must name at least one backend; got {backends!r}")
        path = os.environ.get("KVXFER_TRANSFER_PATH")
        if path:
            if path.strip().lower() not in TRANSFER_PATHS:
                raise ConfigError(f"KVXFER_TRANSFER_PATH must be one of {', '.join(TRANSFER_PATHS)}; "
                                  f"got {path!r}")
            values["transfer_path"] = path.strip().lower()
        thread = os.environ.get("KVXFER_NIXL_PROGRESS_THREAD")
        if thread:
            flag = thread.strip().lower()
            if flag not in ("0", "1", "true", "false", "on", "off", "auto"):
                raise ConfigError(f"KVXFER_NIXL_PROGRESS_THREAD must be 0, 1 or auto; got {thread!r}")
            values["nixl_progress_thread"] = None if flag == "auto" else flag in ("1", "true", "on")
        delay = os.environ.get("KVXFER_NIXL_PROGRESS_DELAY_US")
        if delay and delay.strip() and delay.strip().lower() != "auto":
            if not delay.strip().isdigit():
                raise ConfigError(f"KVXFER_NIXL_PROGRESS_DELAY_US must be a whole number of microseconds "
                                  f"or auto; got {delay!r}")
            values["nixl_progress_delay_us"] = int(delay)
        interval = os.environ.get("KVXFER_PROGRESS_INTERVAL")
        if interval and interval.strip():
            try:
                seconds = float(interval)
            except ValueError:
                seconds = -1.0
            if not 0 <= seconds <= 1:
                raise ConfigError(f"KVXFER_PROGRESS_INTERVAL must be a number of seconds in [0, 1]; got {interval!r}")
            values["progress_interval"] = seconds
        metrics = os.environ.get("KVXFER_METRICS_PORT")
        if metrics and metrics.strip():
            try:
                port = int(metrics.strip())
            except ValueError:
                port = -1
            if not 0 <= port <= 65535:
                raise ConfigError(f"KVXFER_METRICS_PORT must be a port number in [0, 65535]; got {metrics!r}")
            values["metrics_port"] = port
        express = os.environ.get("KVXFER_EXPRESS_PORT")
        if express and express.strip():
            text = express.strip().lower()
            if text in ("off", "none", "no"):
                values["express_port"] = None
            else:
                try:
                    port = int(text)
                except ValueError:
                    port = -1
                if not 0 <= port <= 65535:
                    raise ConfigError(f"KVXFER_EXPRESS_PORT must be a port number in [0, 65535] or 'off'; "
                                      f"got {express!r}")
                values["express_port"] = port
        switch = os.environ.get("KVXFER_SWITCH_INTERVAL")
        if switch and switch.strip():
            values["switch_interval"] = parse_seconds(switch.strip(), "KVXFER_SWITCH_INTERVAL")
        ttl = os.environ.get("KVXFER_PEER_IDLE_TTL")
        if ttl and ttl.strip():
            try:
                values["peer_idle_ttl"] = float(ttl)
            except ValueError:
                raise ConfigError(f"KVXFER_PEER_IDLE_TTL must be a number of seconds; got {ttl!r}") from None
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> "AgentConfig":
        return replace(self, **changes)
