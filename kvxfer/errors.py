"""kvxfer's one error tree (layer: errors; imports nothing but the standard library).

    KvxferError
    ├── ConfigError                 bad configuration or arguments (unknown backend, bad env value)
    │   ├── AlreadyHeldError        ``hold`` of a request this agent already holds
    │   └── RequestInFlightError    a second transfer of a request id this agent is still moving
    ├── LayoutError                 a KVSpec or a pair of specs that cannot be combined
    │   └── BlockIdError            a block id outside the cache, or mismatched id lists
    ├── RegistrationError           memory that does not match the spec, or is not registered
    ├── ProtocolError               a side-channel message that is malformed, oversized or hostile
    │   ├── IncompatiblePeerError   a well-formed peer with another version / model / geometry
    │   └── AuthenticationError     a message whose HMAC does not verify
    ├── TransferError               a transfer that did not complete
    │   ├── TransferTimeoutError    a deadline passed before completion
    │   ├── TransferFailedError     the transport reported a failure
    │   ├── PeerLostError           the peer went away (or restarted) mid-conversation
    │   └── LeaseExpiredError       the producer no longer holds the blocks (expired or released)
    │       └── AbortedError        this agent's own ``abort`` ended the transfer (the producer
    │                               did nothing wrong: do not count it against the peer)
    ├── BackendError                the transport library itself failed (NIXL, UCX)
    ├── ClosedError                 the object was used after *you* closed it
    └── WaitTimeout                 a *wait* ran out; the transfer goes on (also a TimeoutError)

``WaitTimeout`` is not a ``TransferError``: nothing failed, the caller only stopped waiting.
``TransferTimeoutError`` is a transfer that failed because its own deadline passed.

Every error that compares two values names both (``expected ...; got ...``).
"""

from __future__ import annotations

__all__ = [
    "AbortedError",
    "AlreadyHeldError",
    "AuthenticationError",
    "BackendError",
    "BlockIdError",
    "ClosedError",
    "ConfigError",
    "IncompatiblePeerError",
    "KvxferError",
    "LayoutError",
    "LeaseExpiredError",
    "PeerLostError",
    "ProtocolError",
    "RegistrationError",
    "RequestInFlightError",
    "TransferError",
    "TransferFailedError",
    "TransferTimeoutError",
    "WaitTimeout",
]


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class ConfigError(KvxferError, ValueError):
    """Configuration or arguments are invalid."""


class RequestInFlightError(ConfigError):
    """A read or write names a request id that already has a transfer in flight (or quarantined)
    on this agent. Refused before anything is sent: the first transfer and the producer's hold
    are untouched."""


class AlreadyHeldError(ConfigError):
    """``Agent.hold`` of a request id this agent already holds (its message names the request and
    both block lists' sizes). Hold under a new id, wait until ``finished()`` lists the request,
    or pass ``replace=True`` (refused while a claim window is open)."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class LayoutError(KvxferError, ValueError):
    """A KVSpec is invalid, or two specs cannot be combined."""


class BlockIdError(LayoutError):
    """A block id is outside the cache, or the local and remote id lists do not match."""


class RegistrationError(KvxferError, ValueError):
    """Memory does not match the declared spec, or is not registered."""


class ProtocolError(KvxferError):
    """A side-channel message is malformed, oversized, out of order or hostile."""


class IncompatiblePeerError(ProtocolError):
    """The peer speaks another protocol version, serves another model or has an incompatible cache."""


class AuthenticationError(ProtocolError):
    """A message's authentication tag does not verify under the shared key."""


class TransferError(KvxferError):
    """A transfer did not complete."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A deadline passed before the transfer completed."""


class TransferFailedError(TransferError):
    """The transport reported that the transfer failed."""


class PeerLostError(TransferError):
    """The peer went away or restarted; the conversation with it cannot continue."""


class LeaseExpiredError(TransferError):
    """The producer no longer holds the request's blocks (lease expired, aborted or released)."""


class AbortedError(LeaseExpiredError):
    """This agent's own ``Agent.abort`` (or a push's consumer abort) ended the transfer: the
    engine asked for it, the producer lost nothing. A subclass of ``LeaseExpiredError`` (the
    producer's hold ends with the abort, and code that caught that before still does); a
    failure policy that must tell the engine's own abort from a producer's loss checks this
    class first. docs/api.md ("When a read fails") says what the engine may do with each."""


class BackendError(KvxferError):
    """The transport library (NIXL, UCX, ...) failed; the original error is chained."""


class ClosedError(KvxferError):
    """The object was used after it was closed by its owner."""


class WaitTimeout(KvxferError, TimeoutError):
    """A wait (``TransferHandle.wait(timeout)``) ran out before the transfer completed.

    Not a transfer failure: the transfer goes on (``handle.done()`` is False, its blocks stay in
    flight) and completes, or fails typed, by its own deadline. Wait again, or ``Agent.abort``
    it. Carries ``request_id`` and the ``timeout`` that ran out.
    """

    def __init__(self, message: str, request_id: str = "", timeout: float | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.timeout = timeout
