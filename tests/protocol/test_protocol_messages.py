"""Wire messages: compat hash coverage, spec conversion and PeerInfo validation."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvxfer.errors import IncompatiblePeerError, LayoutError, ProtocolError
from kvxfer.layout.spec import CacheGeometry, Layout, Storage
from kvxfer.protocol import (
    check_peer_info,
    compat_hash,
    make_peer_info,
    new_engine_id,
    spec_from_wire,
    spec_to_wire,
)
from proto_helpers import info, spec


@pytest.mark.parametrize(
    "change",
    [dict(tp_size=2, tp_rank=1), dict(layout=Layout.HND), dict(storage=Storage.PACKED),
     dict(block_size=32), dict(num_blocks=7), dict(layout=Layout.HND, k_dim_chunk=8)],
)
def test_compat_hash_ignores_translatable_fields(change):
    assert compat_hash(spec(**change)) == compat_hash(spec())


@pytest.mark.parametrize(
    "change",
    [dict(model="other-model"), dict(dtype="float16"), dict(head_dim=128), dict(num_layers=5),
     dict(num_kv_heads=4), dict(mla=True, num_kv_heads=1), dict(kv_fused=True)],
)
def test_compat_hash_covers_identity_fields(change):
    h = compat_hash(spec(**change))
    assert h != compat_hash(spec())
    assert len(h) == 64 and int(h, 16) >= 0


@pytest.mark.parametrize(
    "s",
    [spec(), spec(layout=Layout.HND, storage=Storage.CROSS_LAYER, tp_size=4, tp_rank=3),
     spec(layout=Layout.HND, kv_fused=True), spec(storage=Storage.CROSS_LAYER, kv_fused=True),
     spec(mla=True, num_kv_heads=1, dtype="float8_e4m3fn"),
     spec(layout=Layout.HND, storage=Storage.HEAD_PACKED, dtype="float32", k_dim_chunk=1),
     spec(layout=Layout.HND, dtype="bfloat16", k_dim_chunk=8)],
)
def test_spec_wire_round_trip(s):
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(spec_to_wire(s)), type=type(spec_to_wire(s)))
    assert spec_from_wire(wire) == s


def test_spec_from_wire_revalidates():
    bad_rank = dataclasses.replace(spec(), tp_size=2, tp_rank=1)
    wire = msgspec.structs.replace(spec_to_wire(bad_rank), tp_rank=2)
    with pytest.raises(ProtocolError, match="tp_rank"):
        spec_from_wire(wire)
    with pytest.raises(IncompatiblePeerError, match="float4"):
        spec_from_wire(msgspec.structs.replace(spec_to_wire(spec()), dtype="float4"))


@pytest.mark.parametrize("change,match", [
    (dict(k_dim_chunk=3), r"k_dim_chunk \(3\) must divide head_dim \(64\)"),
    (dict(k_dim_chunk=1), "layout must be 'HND'; got 'NHD'"),
])
def test_spec_from_wire_checks_the_k_chunk(change, match):
    """A peer's dim-major K is re-validated like every other spec field: a ProtocolError naming it."""
    wire = msgspec.structs.replace(spec_to_wire(spec()), **change)
    with pytest.raises(ProtocolError, match=match):
        spec_from_wire(wire)
    with pytest.raises(msgspec.ValidationError, match="k_dim_chunk"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.structs.replace(wire, k_dim_chunk=-1)),
                               type=type(wire))


def test_check_peer_info_returns_spec_and_geometry():
    i = info()
    s, g = check_peer_info(i, compat_hash(spec()))
    assert s == spec()
    assert g.bases.tolist() == CacheGeometry.contiguous(spec(), 1 << 40).bases.tolist()


def test_check_peer_info_rejects_bad_geometry_and_kind():
    i = info()
    with pytest.raises(ProtocolError, match=r"bases shape: expected \(4, 2\)"):
        check_peer_info(msgspec.structs.replace(i, bases=i.bases[:3]))
    with pytest.raises(ProtocolError, match="bases shape"):
        check_peer_info(msgspec.structs.replace(i, bases=[row[:1] for row in i.bases]))
    with pytest.raises(ProtocolError, match="mem_kind.*'HBM'"):
        check_peer_info(msgspec.structs.replace(i, mem_kind="HBM"))
    with pytest.raises(ProtocolError, match="lease_timeout"):
        check_peer_info(msgspec.structs.replace(i, lease_timeout=0.0))


def test_check_peer_info_catches_body_that_disagrees_with_compat():
    with pytest.raises(IncompatiblePeerError, match="other-model"):
        check_peer_info(info(s=spec(model="other-model")), compat_hash(spec()))


def test_make_peer_info_checks_geometry():
    with pytest.raises(LayoutError):
        make_peer_info("e", "a", spec(), CacheGeometry.contiguous(spec(num_layers=2), 0), b"")


def test_new_engine_id_is_unique_per_start():
    a, b = new_engine_id("prefill-0"), new_engine_id("prefill-0")
    assert a != b and a.startswith("prefill-0-") and b.startswith("prefill-0-")


def test_engine_named_matches_an_agent_name_or_one_exact_engine_id():
    from kvxfer.protocol import engine_named, new_engine_id

    engine = new_engine_id("decode-0")
    assert engine_named("decode-0", engine) and engine_named(engine, engine)
    assert not engine_named("decode", engine)                 # a prefix of the name is not the name
    assert not engine_named("decode-0", "decode-0-notanonce")  # the nonce is 16 hex digits
    assert not engine_named("decode-0", new_engine_id("decode-00"))
    assert not engine_named(engine, new_engine_id("decode-0"))  # an exact id names one start only
