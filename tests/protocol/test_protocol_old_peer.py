"""Wire compatibility with a peer of the previous release (same PROTOCOL_VERSION, fewer fields).

The previous release's wire types are derived from the current ones, not written by hand:
``PeerInfo`` without its three appended GPU-path fields (``host_id``, ``ipc``, ``staging``),
``Hello``/``Welcome`` carrying that ``PeerInfo``, and a ``Message`` union without the newer
``Done``, ``PackRequest`` and ``PackReady``. The old side's codec is the current ``Codec`` with
its body decoder built for that union (the envelope did not change).
"""

from __future__ import annotations

from typing import Union, get_args

import msgspec
import pytest

from kvxfer.errors import ProtocolError
from kvxfer.protocol import (
    Claim, ClaimBatch, ClientSession, Codec, Done, Grant, Grants, Hello, Message, PackReady, PackRequest, PeerInfo,
    Reject, ServerSession, SessionState, StagingWire, Welcome, check_peer_info,
)
from kvxfer.protocol.messages import IpcWire, SpecWire, spec_from_wire, spec_to_wire

from proto_helpers import codec, info, spec
from kvxfer.layout.spec import Layout, Storage

#: The appended PeerInfo fields an old peer neither sends nor reads: the GPU paths, then the
#: multiplexed listener (request ids on the side channel).
GPU_FIELDS = ("host_id", "ipc", "staging")
NEWER_FIELDS = GPU_FIELDS + ("multiplexed", "express_port", "net_id", "packed_ids", "batch_claims", "batch_done",
                                 "hold_words", "hold_slots", "hold_words_addr", "hybrid")
#: The messages the old peer's union does not have.
NEWER = (Done, PackRequest, PackReady, ClaimBatch, Grants)


def _field_spec(f: msgspec.structs.FieldInfo) -> tuple:
    if f.required:
        return (f.name, f.type)
    if f.default is not msgspec.NODEFAULT:
        return (f.name, f.type, f.default)
    return (f.name, f.type, msgspec.field(default_factory=f.default_factory))


def old_struct(cls: type, drop: tuple[str, ...] = (), retype: dict | None = None) -> type:
    """``cls`` as the previous release defined it: same name, tag and options, minus ``drop``."""
    retype = retype or {}
    fields = [f for f in msgspec.structs.fields(cls) if f.name not in drop]
    specs = [(f.name, retype[f.name]) if f.name in retype else _field_spec(f) for f in fields]
    cfg = cls.__struct_config__
    return msgspec.defstruct(cls.__name__, specs, frozen=cfg.frozen, array_like=cfg.array_like,
                             forbid_unknown_fields=cfg.forbid_unknown_fields, omit_defaults=cfg.omit_defaults,
                             tag=cfg.tag, tag_field=cfg.tag_field)


#: The appended SpecWire fields an old peer neither sends nor reads (a dim-major K, a fused cache).
NEWER_SPEC_FIELDS = ("k_dim_chunk", "kv_fused")
OldSpecWire = old_struct(SpecWire, drop=NEWER_SPEC_FIELDS)
OldPeerInfo = old_struct(PeerInfo, drop=NEWER_FIELDS, retype={"spec": OldSpecWire})
OldHello = old_struct(Hello, retype={"info": OldPeerInfo})
OldWelcome = old_struct(Welcome, retype={"info": OldPeerInfo})
OLD_MESSAGE = Union[tuple({Hello: OldHello, Welcome: OldWelcome}.get(t, t)  # noqa: UP007
                          for t in get_args(Message) if t not in NEWER)]
OLD_FIELDS = OldPeerInfo.__struct_fields__


def old_info(current: PeerInfo) -> OldPeerInfo:
    """What the previous release announces for the same agent."""
    fields = {name: getattr(current, name) for name in OLD_FIELDS}
    fields["spec"] = OldSpecWire(**{name: getattr(current.spec, name) for name in OldSpecWire.__struct_fields__})
    return OldPeerInfo(**fields)


def old_codec() -> Codec:
    """The previous release's codec: the same envelope, a body decoder for its message union."""
    c = codec()
    c._decoder = msgspec.msgpack.Decoder(OLD_MESSAGE)
    return c


def old_server_codec() -> Codec:
    """The old codec for a ``ServerSession`` model: its union lacks the newer messages but keeps
    this release's Hello/Welcome classes, because the session's table is keyed by class (the old
    Hello's shape has tests of its own)."""
    c = codec()
    c._decoder = msgspec.msgpack.Decoder(Union[tuple(t for t in get_args(Message) if t not in NEWER)])  # noqa: UP007
    return c


def gpu_info(engine_id: str = "eng-a") -> PeerInfo:
    """A current PeerInfo with every appended field set (not the defaults)."""
    s = spec()
    ipc = IpcWire(0, [bytes(range(64))], [[0, 0]] * s.num_layers, [[0, 1 << 20]] * s.num_layers)
    return msgspec.structs.replace(info(engine_id, s), host_id="boot/host", ipc=ipc,
                                   staging=StagingWire(1 << 30, 1 << 20, 8, 0, "DRAM"))


def test_appended_fields_are_last_and_defaulted():
    """The evolution rule an old peer relies on: the GPU-path fields come after every older field
    and have defaults meaning 'not offered' (a required or reordered field would break old peers)."""
    fields = msgspec.structs.fields(PeerInfo)
    assert tuple(f.name for f in fields[-len(NEWER_FIELDS):]) == NEWER_FIELDS
    assert {f.name: f.default for f in fields[-len(NEWER_FIELDS):]} == dict(host_id="", ipc=None, staging=None,
                                                                           multiplexed=False, express_port=0, net_id="",
                                                                           packed_ids=False, batch_claims=False,
                                                                           batch_done=False, hold_words="",
                                                                           hold_slots=0, hold_words_addr=0, hybrid=b"")
    assert OLD_FIELDS == tuple(f.name for f in fields[:-len(NEWER_FIELDS)])


def test_old_hello_decodes_with_gpu_path_defaults_and_every_other_field_intact():
    """An old Hello, framed as the old peer frames it, decodes to a PeerInfo with host_id '',
    ipc None and staging None; every field the old peer sent round-trips; it validates."""
    current = info()
    frame = old_codec().encode(OldHello(old_info(current)))
    msg = codec().decode(frame)
    assert isinstance(msg, Hello)
    assert (msg.info.host_id, msg.info.ipc, msg.info.staging, msg.info.multiplexed) == ("", None, None, False)
    # every other field compares (the test PeerInfo has the GPU defaults; an old peer is not multiplexed)
    assert msg.info == msgspec.structs.replace(current, multiplexed=False, packed_ids=False, batch_claims=False,
                                               batch_done=False)
    spec_, geometry = check_peer_info(msg.info, codec().compat)
    assert spec_ == spec() and geometry.bases.tolist() == current.bases


def test_old_client_handshakes_with_a_current_server_and_reads_its_welcome():
    """Both handshake directions: the current server accepts the old Hello (peer fields at their
    defaults), and the old client reads the current Welcome, ignoring the appended fields."""
    server = ServerSession(codec(), gpu_info("eng-new"), on_request=lambda m: None)
    old = old_codec()
    reply = server.receive(old.encode(OldHello(old_info(info("eng-old")))))
    assert server.state is SessionState.READY and server.rejected == 0
    assert (server.peer.host_id, server.peer.ipc, server.peer.staging) == ("", None, None)
    welcome = old.decode(reply)
    assert isinstance(welcome, OldWelcome)
    assert welcome.info == old_info(gpu_info("eng-new"))


def test_current_client_handshakes_with_an_old_server():
    """The current client accepts an old server's Welcome; its peer offers no GPU path."""
    client = ClientSession(codec(), gpu_info("eng-new"))
    hello = client.start()
    assert isinstance(old_codec().decode(hello), OldHello)  # the old server can read our Hello
    peer = client.receive_welcome(old_codec().encode(OldWelcome(old_info(info("eng-old")))))
    assert client.state is SessionState.READY
    assert (peer.engine_id, peer.host_id, peer.ipc, peer.staging) == ("eng-old", "", None, None)


def test_old_decoder_ignores_the_appended_fields():
    """What the docs promise ('old peers ignore them'): msgspec skips fields a Struct does not
    know unless it forbids unknown fields, so the old decoder reads a current PeerInfo with every
    GPU field set and keeps the rest as sent."""
    assert not PeerInfo.__struct_config__.forbid_unknown_fields
    current = gpu_info()
    got = old_codec().decode(codec().encode(Hello(current))).info
    assert got == old_info(current)


def test_a_grant_with_the_dropped_staging_fields_still_decodes():
    """Grant's staging_offset/staging_bytes (never used) were dropped; a peer that sends them is understood."""
    c = codec()
    body = {"type": "Grant", "request_id": "r", "lease_remaining": 3.5, "staging_offset": 4096,
            "staging_bytes": 512}
    assert c._decode_body(c._decoder, msgspec.msgpack.encode(body)) == Grant("r", 3.5)


@pytest.mark.parametrize("msg", [
    Claim("r", [1, 2], "eng", 3.0),
    PackRequest("r", [1, 2], 0, 4, consumer_ids=[3, 4], tag=9, piece_bytes=1024, timeout=5.0),
], ids=lambda m: type(m).__name__)
def test_every_defaulted_field_may_be_left_out(msg):
    """A body without any of the message's defaulted fields (what a peer that predates them
    sends) decodes to those defaults; the full body round-trips."""
    c = codec()
    assert c.decode(c.encode(msg)) == msg
    fields = msgspec.structs.fields(type(msg))
    required = {f.name for f in fields if f.required}
    body = {k: v for k, v in msgspec.to_builtins(msg).items() if k in required or k == "type"}
    assert len(body) < len(msgspec.to_builtins(msg))
    defaults = {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                for f in fields if not f.required}
    got = c._decode_body(c._decoder, msgspec.msgpack.encode(body))
    assert got == msgspec.structs.replace(msg, **defaults)


@pytest.mark.parametrize("msg", [
    Done("r", "eng-new"),
    PackRequest("r", [1], 0, 1),
], ids=lambda m: type(m).__name__)
def test_old_server_rejects_a_message_it_does_not_know_and_the_client_gets_a_typed_error(msg):
    """A newer request reaching the old server: its decoder does not know the tag, so it answers
    Reject('malformed') naming the tag and keeps its state; the current client raises ProtocolError."""
    old_server = ServerSession(old_server_codec(), old_info(info("eng-old")),
                               on_request=lambda m: Grant(m.request_id, 30.0))
    client = ClientSession(codec(), gpu_info("eng-new"))
    client.receive_welcome(old_server.receive(client.start()))
    assert old_server.state is SessionState.READY
    reply = old_server.receive(client.request(msg))
    rejected = codec().decode(reply)
    assert isinstance(rejected, Reject) and rejected.code == "malformed"
    assert f"Invalid value '{type(msg).__name__}'" in rejected.detail
    assert old_server.state is SessionState.READY and old_server.rejected == 1
    with pytest.raises(ProtocolError, match=rf"rejected it \(malformed\).*'{type(msg).__name__}'"):
        client.response(reply, msg)
    assert client.state is SessionState.READY
    claim = Claim("r", [1], "eng-new")  # and the old server still serves what it knows
    assert client.response(old_server.receive(client.request(claim)), claim) == Grant("r", 30.0)


def test_current_decoder_names_an_unknown_message_tag():
    """A message from a newer peer (a tag this release lacks) is a ProtocolError naming the tag,
    and a server answers it with Reject('malformed') without changing state."""
    c = codec()
    frame = c.encode(msgspec.defstruct("Frobnicate", [("request_id", str)], tag=True)("r"))
    with pytest.raises(ProtocolError, match="malformed body: Invalid value 'Frobnicate'"):
        c.decode(frame)
    server = ServerSession(c, info("eng-b"), on_request=lambda m: None)
    server.receive(ClientSession(codec(), info("eng-a")).start())
    rejected = c.decode(server.receive(frame))
    assert isinstance(rejected, Reject) and rejected.code == "malformed" and "Frobnicate" in rejected.detail
    assert server.state is SessionState.READY and server.rejected == 1


def test_the_spec_field_for_a_dim_major_k_is_appended_and_defaulted():
    """``SpecWire.k_dim_chunk`` comes after every older field, default 0 (token-major K)."""
    fields = msgspec.structs.fields(SpecWire)
    assert tuple(f.name for f in fields[-len(NEWER_SPEC_FIELDS):]) == NEWER_SPEC_FIELDS
    assert fields[-1].default == 0
    assert OldSpecWire.__struct_fields__ == tuple(f.name for f in fields[:-len(NEWER_SPEC_FIELDS)])


def test_old_spec_decodes_as_token_major_k():
    """An old peer's spec (no ``k_dim_chunk``) decodes to a token-major K, the spec it meant."""
    s = spec(layout=Layout.HND, storage=Storage.HEAD_PACKED)
    old = OldSpecWire(**{n: getattr(spec_to_wire(s), n) for n in OldSpecWire.__struct_fields__})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=SpecWire)
    assert wire.k_dim_chunk == 0 and spec_from_wire(wire) == s


def test_old_peer_decodes_a_dim_major_spec_and_ignores_the_chunk():
    """The old decoder reads a current Hello whose cache keeps K dim-major: the handshake works
    and the old peer sees head_packed HND. Old releases only moved head_packed caches whole-block
    with one of the same format (vLLM adapter ``same_format_only``, kvxfer-hf ``exchangeable_with``),
    where K's order moves untouched, so ignoring the chunk leaves their transfers exact."""
    s = spec(layout=Layout.HND, storage=Storage.HEAD_PACKED, k_dim_chunk=1)
    got = old_codec().decode(codec().encode(Hello(info("eng-new", s)))).info
    assert isinstance(got, OldPeerInfo)
    assert (got.spec.layout, got.spec.storage) == ("HND", "head_packed")
    assert not hasattr(got.spec, "k_dim_chunk")
