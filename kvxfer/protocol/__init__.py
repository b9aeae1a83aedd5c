"""kvxfer's side-channel protocol (layer: protocol, pure and sans-IO; imports msgspec, numpy, stdlib and kvxfer's fixed modules, never zmq, sockets or threads).

Wire messages (``messages``), the frame envelope and notification codec (``codec``) and
the handshake/request state machines (``session``). See ``docs/protocol.md``.
"""

from kvxfer.protocol.codec import (
    DEFAULT_MAX_BYTES,
    Codec,
    decode_notification,
    encode_notification,
)
from kvxfer.protocol.messages import (
    PROTOCOL_VERSION,
    REJECT_CODES,
    REPLIES,
    Abort,
    Ack,
    Claim,
    Grant,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    PackReady,
    PackRequest,
    PeerInfo,
    Refuse,
    Reject,
    SpecWire,
    Welcome,
    check_peer_info,
    compat_hash,
    make_peer_info,
    new_engine_id,
    spec_from_wire,
    spec_to_wire,
)
from kvxfer.protocol.session import ClientSession, ServerSession, reject_error

__all__ = [
    "Abort",
    "Ack",
    "Claim",
    "ClientSession",
    "Codec",
    "DEFAULT_MAX_BYTES",
    "Grant",
    "Heartbeat",
    "HeartbeatAck",
    "Hello",
    "Message",
    "PROTOCOL_VERSION",
    "PackReady",
    "PackRequest",
    "PeerInfo",
    "REJECT_CODES",
    "REPLIES",
    "Refuse",
    "Reject",
    "ServerSession",
    "SpecWire",
    "Welcome",
    "check_peer_info",
    "compat_hash",
    "decode_notification",
    "encode_notification",
    "make_peer_info",
    "new_engine_id",
    "reject_error",
    "spec_from_wire",
    "spec_to_wire",
]
