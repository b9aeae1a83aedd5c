"""Frame envelope: round trips, version/compat before body, size bounds, HMAC, garbage, notifications."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import AuthenticationError, ConfigError, IncompatiblePeerError, ProtocolError
from kvxfer.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Claim,
    Codec,
    Grant,
    Heartbeat,
    HeartbeatAck,
    Hello,
    PackReady,
    PackRequest,
    Refuse,
    Reject,
    Welcome,
    compat_hash,
    decode_notification,
    encode_notification,
)
from proto_helpers import KEY, codec, info, spec

MESSAGES = [
    Hello(info()), Welcome(info("eng-b")), Reject("model", "nope"),
    Claim("req-1", [0, 5, 2**40], "eng-a"), Grant("req-1", 479.5),
    Grant("req-1", 1.0), Refuse("req-1", "lease expired"),
    Heartbeat(["req-1", "req-2"], "eng-a"), HeartbeatAck(["req-1"], ["req-2"]), Abort("req-1", "eng-a"),
    Ack(), PackRequest("req-1", [3, 1], 0, 4), PackReady("req-1", 0, 8192),
]


def with_version(frame: bytes, version: int) -> bytes:
    return frame[:4] + struct.pack(">H", version) + frame[6:]


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg, key):
    c = codec(key=key)
    frame = c.encode(msg)
    assert frame[:4] == b"KVXF"
    assert c.decode(frame) == msg
    assert type(c.decode(frame)) is type(msg)


def test_other_protocol_version_is_refused_before_the_body():
    frame = with_version(codec().encode(Hello(info())), PROTOCOL_VERSION + 1)
    with pytest.raises(IncompatiblePeerError, match=f"expected {PROTOCOL_VERSION}; got {PROTOCOL_VERSION + 1}"):
        codec().decode(frame)
    # the body is never reached: a v2 frame with a garbage body gets the same verdict
    with pytest.raises(IncompatiblePeerError, match="protocol version"):
        codec().decode(with_version(frame[:44], 2) + b"\xc1" * 8)


def test_other_model_is_refused_by_compat_hash():
    theirs = codec(spec(model="other-model"))
    with pytest.raises(IncompatiblePeerError, match="compat hash"):
        codec().decode(theirs.encode(Hello(info(s=spec(model="other-model")))))


def test_reject_is_readable_across_compat_hashes_but_nothing_else_is():
    theirs = codec(spec(head_dim=128))
    assert codec().decode(theirs.encode(Reject("model", "head_dim differs"))) == Reject("model", "head_dim differs")
    # a forged REJECT flag on another message does not smuggle it past the compat check
    frame = bytearray(theirs.encode(Claim("r", [1], "e")))
    frame[6:8] = struct.pack(">H", 0x2)
    with pytest.raises(ProtocolError, match="malformed"):
        codec().decode(bytes(frame))


@pytest.mark.parametrize(
    "frame, match",
    [(b"", "too short"), (b"KVXF", "too short"), (b"GET / HTTP/1.1\r\n" * 4, "bad magic"),
     (b"\x00" * 100, "bad magic")],
)
def test_garbage_frames(frame, match):
    with pytest.raises(ProtocolError, match=match):
        codec().decode(frame)


def test_truncated_extended_and_flagged_frames():
    c = codec()
    frame = c.encode(Claim("req-1", [1, 2, 3], "eng-a"))
    with pytest.raises(ProtocolError, match="body length"):
        c.decode(frame[:-1])
    with pytest.raises(ProtocolError, match="body length"):
        c.decode(frame + b"\x00")
    with pytest.raises(ProtocolError, match="unknown flags"):
        c.decode(frame[:6] + struct.pack(">H", 0x80) + frame[8:])


def test_body_that_breaks_field_constraints_is_malformed():
    c = codec()
    good = c.encode(Claim("req-1", [1], "eng-a"))
    body = msgspec.msgpack.encode({"type": "Claim", "request_id": "req-1", "block_ids": [-1], "engine_id": "e"})
    frame = good[:40] + struct.pack(">I", len(body)) + body
    with pytest.raises(ProtocolError, match="malformed body"):
        c.decode(frame)
    body = msgspec.msgpack.encode({"type": "Pickle", "payload": b"cos\nsystem\n"})
    with pytest.raises(ProtocolError, match="malformed body"):
        c.decode(good[:40] + struct.pack(">I", len(body)) + body)


def test_oversized_frames_are_refused_before_decoding():
    c = codec(max_bytes=16 << 10)
    with pytest.raises(ProtocolError, match=rf"expected <= {16 << 10} bytes; got {(16 << 10) + 1}"):
        c.decode(b"KVXF" + b"\x00" * ((16 << 10) - 3))
    big = Hello(info(metadata=b"m" * (64 << 10)))  # NIXL metadata blobs are tens of KiB
    with pytest.raises(ProtocolError, match="frame too large"):
        c.encode(big)
    assert codec().decode(codec().encode(big)) == big  # the default 4 MiB takes it


@pytest.mark.parametrize(
    "sender, receiver, match",
    [(KEY, b"another-key-of-32-bytes-length!!", "does not verify"),
     (None, KEY, "got none"),
     (KEY, None, "no shared key configured here")],
)
def test_authentication_mismatch(sender, receiver, match):
    frame = codec(key=sender).encode(Hello(info()))
    with pytest.raises(AuthenticationError, match=match):
        codec(key=receiver).decode(frame)


def test_tampered_authenticated_frame_is_refused():
    frame = bytearray(codec(key=KEY).encode(Claim("req-1", [1, 2], "eng-a")))
    frame[-3] ^= 0x01
    with pytest.raises(AuthenticationError):
        codec(key=KEY).decode(bytes(frame))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_errors(data):
    for c in (codec(), codec(key=KEY)):
        with pytest.raises(ProtocolError):
            c.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 255))
def test_any_single_byte_corruption_is_detected_with_a_key(pos, delta):
    frame = bytearray(codec(key=KEY).encode(Claim("req-1", [1, 2, 3], "eng-a")))
    frame[pos % len(frame)] = (frame[pos % len(frame)] + delta) % 256
    with pytest.raises(ProtocolError):
        codec(key=KEY).decode(bytes(frame))


def test_codec_configuration_errors():
    with pytest.raises(ConfigError, match="compat"):
        Codec("not-hex")
    with pytest.raises(ConfigError, match="16 bytes"):
        Codec(compat_hash(spec()), key=b"short")
    with pytest.raises(ConfigError, match="max_bytes"):
        Codec(compat_hash(spec()), max_bytes=10)


@pytest.mark.parametrize("key", [None, KEY])
def test_notification_round_trip(key):
    data = encode_notification("req-9", "eng-a", key)
    assert decode_notification(data, key) == ("req-9", "eng-a")


def test_notification_errors():
    data = encode_notification("req-9", "eng-a", KEY)
    with pytest.raises(AuthenticationError):
        decode_notification(data, b"another-key-of-32-bytes-length!!")
    with pytest.raises(AuthenticationError):
        decode_notification(encode_notification("req-9", "eng-a", None), KEY)
    with pytest.raises(ProtocolError, match="magic"):
        decode_notification(b"done:req-9", None)
    with pytest.raises(IncompatiblePeerError, match="expected 1; got 7"):
        decode_notification(b"KVXN\x07\x00" + data[6:], None)
    with pytest.raises(ProtocolError, match="malformed"):
        decode_notification(b"KVXN\x01\x00\xc1", None)
    with pytest.raises(ProtocolError, match="too large"):
        encode_notification("r" * 5000, "eng-a", None)
    # a frame's tag never verifies as a notification's (domain-separated HMAC)
    frame = codec(key=KEY).encode(Ack())
    with pytest.raises(ProtocolError):
        decode_notification(frame, KEY)
