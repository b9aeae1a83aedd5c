"""Side-channel address resolution from arguments and environment (layer: transport; stdlib and kvxfer.errors only, never zmq).

Precedence for each of host and port: the explicit argument, then ``KVXFER_SIDE_CHANNEL_*``,
then vLLM's ``VLLM_NIXL_SIDE_CHANNEL_*``, then the default (a routable address of this
host; port 5600). Each rank listens on ``base + dp_rank * tp_size + tp_rank`` so that
ranks of one host never collide.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from kvxfer.errors import ConfigError

__all__ = ["DEFAULT_PORT", "HOST_VARS", "PORT_VARS", "routable_host", "side_channel_address"]

DEFAULT_PORT = 5600
HOST_VARS = ("KVXFER_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST")
PORT_VARS = ("KVXFER_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")


def routable_host() -> str:
    """The local address this host would use to reach another host, else ``127.0.0.1``.

    Connecting a UDP socket only selects a route; it sends no packet.
    """
    for probe in ("10.255.255.255", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if addr and not addr.startswith("0."):
            return addr
    return "127.0.0.1"


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def side_channel_address(
    host: str | None,
    port: int | None,
    dp_rank: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, int]:
    """Resolve where this rank's side channel listens.

    Args:
        host, port: explicit values; None means "read the environment".
        dp_rank, tp_rank, tp_size: this rank's place; the port is offset by
            ``dp_rank * tp_size + tp_rank``. A base port of 0 means "ephemeral" and stays 0.
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``(host, port)``.

    Raises:
        ConfigError: a non-integer or out-of-range port (naming the variable and value),
            or ranks that do not fit (``0 <= tp_rank < tp_size``, ``dp_rank >= 0``).
    """
    env = os.environ if environ is None else environ
    for name, value in (("dp_rank", dp_rank), ("tp_rank", tp_rank), ("tp_size", tp_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer; got {value!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size or dp_rank < 0:
        raise ConfigError(
            f"ranks: expected dp_rank >= 0 and 0 <= tp_rank < tp_size; got dp_rank={dp_rank}, "
            f"tp_rank={tp_rank}, tp_size={tp_size}"
        )

    if host is None:
        found = _first(env, HOST_VARS)
        host = found[1] if found else routable_host()
    elif not isinstance(host, str) or not host.strip():
        raise ConfigError(f"side channel host must be a non-empty string; got {host!r}")

    source = "port argument"
    raw: object = port
    if port is None:
        found = _first(env, PORT_VARS)
        source, raw = found if found else ("default", DEFAULT_PORT)
    try:
        if isinstance(raw, bool):
            raise ValueError
        base = int(raw) if isinstance(raw, int) else int(str(raw), 10)
    except ValueError:
        raise ConfigError(f"{source} must be an integer port; got {raw!r}") from None
    if not 0 <= base <= 65535:
        raise ConfigError(f"{source} must be in [0, 65535]; got {raw!r}")
    if base == 0:
        return host.strip(), 0
    final = base + dp_rank * tp_size + tp_rank
    if final > 65535:
        raise ConfigError(
            f"{source}={raw!r} + dp_rank*tp_size + tp_rank ({dp_rank}*{tp_size}+{tp_rank}) = {final}; "
            "expected <= 65535"
        )
    return host.strip(), final
