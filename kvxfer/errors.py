"""kvxfer's one error tree (layer: errors; imports nothing but the standard library).

    KvxferError
    ├── ConfigError                 bad configuration or arguments (unknown backend, bad env value)
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
    ├── BackendError                the transport library itself failed (NIXL, UCX)
    └── ClosedError                 the object was used after *you* closed it

Every error that compares two values names both (``expected ...; got ...``).
"""

from __future__ import annotations

__all__ = [
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
]


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class ConfigError(KvxferError, ValueError):
    """Configuration or arguments are invalid."""


class RequestInFlightError(ConfigError):
    """A read or write names a request id that already has a transfer in flight (or quarantined)
    on this agent. Refused before anything is sent: the first transfer and the producer's hold
    are untouched."""


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


class BackendError(KvxferError):
    """The transport library (NIXL, UCX, ...) failed; the original error is chained."""


class ClosedError(KvxferError):
    """The object was used after it was closed by its owner."""
