"""The public calls' own arguments, checked at the Agent's edge (layer: agent; imports errors
and config only).

Every check raises ``ConfigError`` naming the argument and the value it got, before the call
changes anything. Block ids have their own checks (``kvxfer.layout.request``), and so does the
config (``AgentConfig``).
"""

from __future__ import annotations

from typing import Sequence

from kvxfer.config import check_port, check_seconds
from kvxfer.errors import ConfigError
from kvxfer.protocol import MAX_PAYLOAD

__all__ = ["MAX_BLOCK_ID", "address", "deadline_for", "payload", "request_id", "request_ids", "sequence"]

MAX_BLOCK_ID = (1 << 63) - 1  # remote ids are checked against the peer's cache by the plan


def request_id(value, name: str = "request_id") -> str:
    """A request id: a non-empty ``str`` (it travels in the protocol's messages as one)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty str; got {value!r} ({type(value).__name__})")
    return value


def request_ids(values, name: str = "request_ids") -> list[str]:
    """A list of request ids (any iterable but a lone ``str`` or bytes, which is a common slip)."""
    return [request_id(v, f"each of {name}") for v in sequence(values, name, "of request ids")]


def address(remote, name: str = "remote") -> tuple[str, int]:
    """``remote`` as a ``(host, port)`` key: a non-empty host and a port in [0, 65535]."""
    try:
        host, port = remote
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a (host, port) pair; got {remote!r}") from None
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{name} must be a (host, port) pair with a non-empty host name; got {remote!r}")
    return host, check_port(port, f"{name}'s port")


def deadline_for(timeout, now: float) -> float | None:
    """A transfer's deadline from its ``timeout`` (None: none); ConfigError for a bad timeout."""
    seconds = check_seconds(timeout, "timeout", none=True)
    return None if seconds is None else now + seconds


def sequence(values, name: str, of: str = "") -> Sequence:
    """``values`` as a list, for an argument that takes many items (``of``: what, for the error)."""
    kind = f"a list {of}".rstrip()
    if isinstance(values, (str, bytes)):
        raise ConfigError(f"{name} must be {kind}, not one {type(values).__name__}; got {values!r}")
    try:
        return list(values)
    except TypeError:
        raise ConfigError(f"{name} must be {kind}; got {values!r}") from None


def payload(value, name: str) -> bytes:
    """Bytes an engine sends along (bytes, bytearray or memoryview), at most ``MAX_PAYLOAD``."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ConfigError(f"{name} must be bytes; got {type(value).__name__}")
    data = bytes(value)
    if len(data) > MAX_PAYLOAD:
        raise ConfigError(f"{name}: expected at most {MAX_PAYLOAD} bytes; got {len(data)}")
    return data
