"""What the agent needs from a side-channel transport (layer: transport; typing and kvxfer.protocol only, never zmq or sockets).

A ``Transport`` makes listeners and channels. ``ZmqTransport`` (``kvxfer.transport.zmq``) is the
real one; ``kvxfer.testing.MemoryTransport`` joins agents of one process without sockets or
ports, as httpx's ``MockTransport`` does for HTTP. Frames are opaque bytes here: every decision
about their content is made by the sans-IO sessions of ``kvxfer.protocol``.
"""

from __future__ import annotations

from typing import Callable, Protocol

from kvxfer.protocol import PeerInfo, ServerSession

__all__ = ["Channel", "Listener", "Pending", "Transport"]


class Pending(Protocol):
    """A request in flight: ``reply()`` once (raises ``PeerLostError``, ``TransferTimeoutError``,
    ``ClosedError``), or ``cancel()`` (its reply, if any, then answers nothing)."""

    def reply(self) -> bytes: ...

    def cancel(self) -> None: ...


class Channel(Protocol):
    """The client end of one session with one remote listener.

    ``multiplexed``: set by the caller once the peer announced it; requests then run concurrently.
    ``generation``: changes whenever the channel's identity at the server changes (the server then
    no longer knows the session). ``stale()``: the session may be gone (connection dropped since).
    """

    multiplexed: bool
    generation: int

    def send(self, frame: bytes, timeout: float) -> Pending: ...

    def try_send(self, frame: bytes, timeout: float) -> Pending | None:
        """``send`` only where it cannot wait (on the peer or another thread); None, nothing sent,
        otherwise."""
        ...

    def request(self, frame: bytes, timeout: float) -> bytes: ...

    def stale(self) -> bool: ...

    def close(self) -> None: ...


class Listener(Protocol):
    """One agent's side-channel listener: one ``ServerSession`` per client, bounded."""

    host: str
    port: int

    def start(self) -> tuple[str, int]: ...

    def peers(self) -> list[PeerInfo]: ...

    def counters(self) -> dict: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Makes listeners and channels (see the module docstring)."""

    def listener(self, host: str, port: int, make_session: Callable[[], ServerSession], *,
                 max_bytes: int, pinned: Callable[[ServerSession], bool] | None = None,
                 authenticated: bool | None = None, express_port: int | None = None) -> Listener: ...

    def channel(self, host: str, port: int, *, max_bytes: int) -> Channel: ...
