"""Frame envelope and notification codec (layer: protocol, pure; imports msgspec and stdlib hmac/hashlib only, never zmq, sockets or threads).

A frame is a fixed header, an optional HMAC-SHA256 tag and a msgpack body::

    offset size  field
    0      4     magic b"KVXF"                      (fixed forever)
    4      2     protocol version, u16 big-endian   (fixed forever)
    6      2     flags, u16: bit 0 AUTH (a tag follows the header),
                             bit 1 REJECT (the body is a Reject; readable across compat hashes)
    8      32    compat hash (SHA-256 digest, see ``compat_hash``)
    40     4     body length, u32
    44     32    HMAC-SHA256(key, b"kvxfer-frame\\0" + header + body), only with AUTH
    44|76  n     msgpack body: one ``Message``

``Codec.decode`` checks, in order, before it decodes the body: total size against
``max_bytes``, header length, magic, version, flags, body length, authentication,
compat hash. So a peer of another version or model is refused on 44 header bytes and
a forged or unauthenticated frame never reaches the msgpack decoder.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from typing import Annotated

import msgspec
from msgspec import Meta

from kvxfer.errors import AuthenticationError, ConfigError, IncompatiblePeerError, ProtocolError
from kvxfer.protocol.messages import PROTOCOL_VERSION, Message, Reject

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FLAG_AUTH",
    "FLAG_REJECT",
    "HEADER",
    "MAGIC",
    "Codec",
    "PipeNote",
    "decode_notification",
    "decode_pipe_note",
    "encode_notification",
    "encode_pipe_note",
    "is_pipe_note",
]

MAGIC = b"KVXF"
HEADER = struct.Struct(">4sHH32sI")  # magic, version, flags, compat digest, body length
TAG_BYTES = 32
FLAG_AUTH = 0x1
FLAG_REJECT = 0x2
FLAG_PIPE = 0x2  # in a notification's flags (not a frame's): the body is a PipeNote
_KNOWN_FLAGS = FLAG_AUTH | FLAG_REJECT
DEFAULT_MAX_BYTES = 4 << 20

NOTIF_MAGIC = b"KVXN"
NOTIF_HEADER = struct.Struct(">4sBB")  # magic, version, flags (bit 0 AUTH)
NOTIF_MAX_BYTES = 4096


def _check_key(key: bytes | None) -> bytes | None:
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ConfigError(
            f"shared key must be at least 16 bytes; got {type(key).__name__} of "
            f"{len(key) if isinstance(key, (bytes, bytearray, str)) else '?'}"
        )
    return bytes(key)


def _verify_auth(key: bytes | None, authed: bool, tag: bytes, signed: bytes, what: str) -> None:
    """Raise AuthenticationError unless the frame's authentication matches this side's key."""
    if key is None:
        if authed:
            raise AuthenticationError(
                f"{what}: expected no authentication tag (no shared key configured here); "
                "got an authenticated frame (is the peer configured with a key?)"
            )
        return
    if not authed:
        raise AuthenticationError(
            f"{what}: expected an HMAC-SHA256 tag (a shared key is configured); got none"
        )
    want = hmac.new(key, signed, hashlib.sha256).digest()
    if not hmac.compare_digest(want, tag):
        raise AuthenticationError(f"{what}: HMAC-SHA256 tag does not verify under the shared key")


class Codec:
    """Turns messages into frames and frames into messages; pure, stateless, thread-safe.

    Args:
        compat: this side's ``compat_hash`` (64 hex characters).
        key: shared secret (>= 16 bytes) to authenticate every frame, or None.
        max_bytes: largest frame accepted or produced (default 4 MiB).

    Raises:
        ConfigError: on a bad ``compat``, ``key`` or ``max_bytes``.
    """

    def __init__(self, compat: str, key: bytes | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        try:
            digest = bytes.fromhex(compat)
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"compat must be a 64-character hex SHA-256; got {compat!r}")
        if not isinstance(max_bytes, int) or max_bytes < HEADER.size + TAG_BYTES + 64:
            raise ConfigError(f"max_bytes must be an integer >= 140; got {max_bytes!r}")
        self.compat = compat.lower()
        self.max_bytes = max_bytes
        self._digest = digest
        self._key = _check_key(key)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self._reject_decoder = msgspec.msgpack.Decoder(Reject)

    @property
    def authenticated(self) -> bool:
        """Whether frames carry and require an HMAC tag."""
        return self._key is not None

    def encode(self, msg: Message) -> bytes:
        """Frame ``msg``.

        Raises:
            ProtocolError: the frame would exceed ``max_bytes`` (the peer would refuse it).
        """
        body = self._encoder.encode(msg)
        flags = (FLAG_AUTH if self._key is not None else 0) | (
            FLAG_REJECT if isinstance(msg, Reject) else 0
        )
        header = HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, self._digest, len(body))
        tag = b""
        if self._key is not None:
            tag = hmac.new(self._key, b"kvxfer-frame\0" + header + body, hashlib.sha256).digest()
        size = len(header) + len(tag) + len(body)
        if size > self.max_bytes:
            raise ProtocolError(
                f"{type(msg).__name__} frame too large: expected <= {self.max_bytes} bytes; got {size}"
            )
        return header + tag + body

    def decode(self, frame: bytes) -> Message:
        """Check the envelope, then decode the body.

        Raises:
            ProtocolError: oversized, truncated, wrong magic, unknown flags or a malformed body.
            IncompatiblePeerError: another protocol version or compat hash (checked before the body).
            AuthenticationError: missing, unexpected or wrong HMAC tag.
        """
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"frame must be bytes; got {type(frame).__name__}")
        frame = bytes(frame)
        if len(frame) > self.max_bytes:
            raise ProtocolError(f"frame too large: expected <= {self.max_bytes} bytes; got {len(frame)}")
        if len(frame) < HEADER.size:
            raise ProtocolError(f"frame too short: expected >= {HEADER.size} bytes; got {len(frame)}")
        magic, version, flags, digest, body_len = HEADER.unpack_from(frame)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic: expected {MAGIC!r}; got {magic!r}")
        if version != PROTOCOL_VERSION:
            raise IncompatiblePeerError(
                f"protocol version: expected {PROTOCOL_VERSION}; got {version}"
            )
        if flags & ~_KNOWN_FLAGS:
            raise ProtocolError(f"unknown flags: expected a subset of {_KNOWN_FLAGS:#x}; got {flags:#x}")
        authed = bool(flags & FLAG_AUTH)
        start = HEADER.size + (TAG_BYTES if authed else 0)
        if len(frame) - start != body_len:
            raise ProtocolError(
                f"body length: header says {body_len} bytes; frame carries {max(0, len(frame) - start)}"
            )
        _verify_auth(self._key, authed, frame[HEADER.size:start],
                     b"kvxfer-frame\0" + frame[:HEADER.size] + frame[start:], "frame")
        body = frame[start:]
        if digest != self._digest:
            if flags & FLAG_REJECT:
                # An incompatible peer's Reject is the one body worth reading: it says why.
                return self._decode_body(self._reject_decoder, body)
            raise IncompatiblePeerError(
                f"compat hash (model, dtype, head_dim, layers, kv heads, mla, kv_fused): expected "
                f"{self.compat[:16]}...; got {digest.hex()[:16]}..."
            )
        return self._decode_body(self._decoder, body)

    @staticmethod
    def _decode_body(decoder: msgspec.msgpack.Decoder, body: bytes) -> Message:
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ProtocolError(f"malformed body: {exc}") from None


class _Notification(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    engine_id: str


class PipeNote(msgspec.Struct, frozen=True, array_like=True):
    """A staged pipeline's message (``kvxfer.engine.paths.pipeline``), typed: piece ``piece`` of the
    transfer tagged ``tag`` is READY (1) in, FREE (2) to reuse, or its DATA (3) landed in ``slot``;
    STOP (4, piece and slot 0): the consumer ended the transfer, none of its READs still runs
    (a peer of the release before drops it as malformed)."""

    kind: Annotated[int, Meta(ge=1, le=4)]
    tag: Annotated[int, Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
    piece: Annotated[int, Meta(ge=0, lt=1 << 20)]
    slot: Annotated[int, Meta(ge=0, lt=1 << 12)]


_NOTIF_ENCODER = msgspec.msgpack.Encoder()
_NOTIF_DECODER = msgspec.msgpack.Decoder(_Notification)
_PIPE_DECODER = msgspec.msgpack.Decoder(PipeNote)


def _seal(body: bytes, flags: int, key: bytes | None) -> bytes:
    key = _check_key(key)
    header = NOTIF_HEADER.pack(NOTIF_MAGIC, PROTOCOL_VERSION, flags | (FLAG_AUTH if key else 0))
    tag = hmac.new(key, b"kvxfer-notif\0" + header + body, hashlib.sha256).digest() if key else b""
    out = header + tag + body
    if len(out) > NOTIF_MAX_BYTES:
        raise ProtocolError(f"notification too large: expected <= {NOTIF_MAX_BYTES} bytes; got {len(out)}")
    return out


def _open(data: bytes, key: bytes | None, pipe: bool) -> bytes:
    """Check a notification's envelope (``pipe``: it must be a pipeline note; else it must not be)
    and return its body."""
    key = _check_key(key)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"notification must be bytes; got {type(data).__name__}")
    data = bytes(data)
    if len(data) > NOTIF_MAX_BYTES:
        raise ProtocolError(f"notification too large: expected <= {NOTIF_MAX_BYTES} bytes; got {len(data)}")
    if len(data) < NOTIF_HEADER.size:
        raise ProtocolError(f"notification too short: expected >= {NOTIF_HEADER.size} bytes; got {len(data)}")
    magic, version, flags = NOTIF_HEADER.unpack_from(data)
    if magic != NOTIF_MAGIC:
        raise ProtocolError(f"bad notification magic: expected {NOTIF_MAGIC!r}; got {magic!r}")
    if version != PROTOCOL_VERSION:
        raise IncompatiblePeerError(f"notification version: expected {PROTOCOL_VERSION}; got {version}")
    if flags & ~(FLAG_AUTH | FLAG_PIPE):
        raise ProtocolError(f"unknown notification flags: expected a subset of 0x3; got {flags:#x}")
    if bool(flags & FLAG_PIPE) != pipe:
        raise ProtocolError("notification: expected a pipeline note; got a request-done notification" if pipe
                            else "notification: expected a request-done notification; got a pipeline note")
    authed = bool(flags & FLAG_AUTH)
    start = NOTIF_HEADER.size + (TAG_BYTES if authed else 0)
    if len(data) < start:
        raise ProtocolError(f"notification too short: expected >= {start} bytes; got {len(data)}")
    _verify_auth(key, authed, data[NOTIF_HEADER.size:start],
                 b"kvxfer-notif\0" + data[:NOTIF_HEADER.size] + data[start:], "notification")
    return data[start:]


def encode_notification(request_id: str, engine_id: str, key: bytes | None) -> bytes:
    """A small 'request done' notification to ride on a NIXL transfer or ``send_notif``.

    Layout: ``b"KVXN"``, version u8, flags u8 (bit 0 AUTH, bit 1 PIPE: the body is a ``PipeNote``),
    optional 32-byte HMAC tag over ``b"kvxfer-notif\\0" + header + body`` (so a frame tag never
    verifies as a notification tag), msgpack ``[request_id, engine_id]``.

    Raises:
        ProtocolError: the notification would exceed 4096 bytes.
        ConfigError: a bad key.
    """
    return _seal(_NOTIF_ENCODER.encode(_Notification(request_id, engine_id)), 0, key)


def decode_notification(data: bytes, key: bytes | None) -> tuple[str, str]:
    """Return ``(request_id, engine_id)`` from a notification.

    Raises:
        ProtocolError: garbage, oversized or truncated data, or a pipeline note.
        IncompatiblePeerError: another protocol version.
        AuthenticationError: missing, unexpected or wrong tag.
    """
    body = _open(data, key, pipe=False)
    try:
        note = _NOTIF_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed notification body: {exc}") from None
    return note.request_id, note.engine_id


def encode_pipe_note(note: PipeNote, key: bytes | None) -> bytes:
    """A pipeline note in the notification envelope (flag PIPE; authenticated like the others)."""
    return _seal(_NOTIF_ENCODER.encode(note), FLAG_PIPE, key)


def is_pipe_note(data: bytes) -> bool:
    """Whether ``data`` claims to be a pipeline note (magic and flag; not validated further)."""
    return len(data) >= NOTIF_HEADER.size and data[:4] == NOTIF_MAGIC and bool(data[5] & FLAG_PIPE)


def decode_pipe_note(data: bytes, key: bytes | None) -> PipeNote:
    """The ``PipeNote`` in ``data`` (raises as ``decode_notification``; also for a request-done one)."""
    body = _open(data, key, pipe=True)
    try:
        return _PIPE_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed pipeline note: {exc}") from None
