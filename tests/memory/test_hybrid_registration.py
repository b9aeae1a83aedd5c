"""Registering a hybrid cache (kvxfer.memory.hybrid) and announcing it (kvxfer.protocol.hybridwire): typed
errors naming the group and both values; shared tensors registered once; the wire form round-trips and a
malformed one is a ProtocolError."""

import msgspec
import numpy as np
import pytest

from kvxfer import BlockIdError, ProtocolError, RegistrationError
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.layout import AttentionGroup, HybridSpec, KVSpec, StateGroup, StateSpec, mamba2_state
from kvxfer.layout.carrier import carrier_for, flat_ids, split_flat
from kvxfer.memory import MemoryRegistry
from kvxfer.memory.hybrid import register_hybrid
from kvxfer.protocol.hybridwire import hybrid_from_wire, hybrid_to_wire
from kvxfer.types import MemKind

KV = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=6, dtype="float16", model="m")
STATE = StateSpec(1, mamba2_state(2, 2, 1, 2, 3, conv_dtype="float16", ssm_dtype="float32"), num_slots=3, model="m")
SPEC = HybridSpec((AttentionGroup(KV, name="full"), AttentionGroup(KV, 8, name="swa"), StateGroup(STATE, name="ssm")))


def tensors():
    attn = [np.zeros(s, np.float16) for s in KV.tensor_shapes()]
    state = [[np.zeros(s, d) for s, d in zip(STATE.tensor_shapes(), (np.float16, np.float32))]]
    return [attn, attn, state]


def test_shared_tensors_are_registered_once_and_the_view_has_every_group():
    backend = FakeBackend("a", FakeWorld())
    reg = MemoryRegistry(backend)
    t = tensors()
    geo = register_hybrid(reg, SPEC, t)
    assert [g.bases.shape for g in geo.view.geometries] == [(2, 2), (2, 2), (1, 2)]
    assert np.array_equal(geo.view.geometries[0].bases, geo.view.geometries[1].bases)
    assert sorted(r.addr for r in reg.regions) == sorted(
        [a.ctypes.data for a in t[0]] + [a.ctypes.data for a in t[2][0]])


def test_registration_errors_name_the_group_and_both_values():
    reg = MemoryRegistry(FakeBackend("a", FakeWorld()))
    with pytest.raises(RegistrationError, match="one entry per group: 3 groups; got 2"):
        register_hybrid(reg, SPEC, tensors()[:2])
    bad = tensors()
    bad[2][0][1] = np.zeros((3, 5), np.float32)
    with pytest.raises(RegistrationError, match=r"group 2 \(state 'ssm'\) layer 0 'ssm': expected float32 of 3 slots"):
        register_hybrid(reg, SPEC, bad)
    assert reg.regions == ()  # a state group's bad entry: nothing registered
    bad = tensors()
    bad[1] = [np.zeros((2, 5, 4, 2, 4), np.float16)] * 2
    with pytest.raises(RegistrationError, match=r"group 1 \(sliding 'swa'\): layer 0: expected"):
        register_hybrid(reg, SPEC, bad)


def test_flat_ids_round_trip_and_refuse_typed():
    ids = flat_ids(SPEC, [[5, 0], [1, 2, 3], [2]], "local", num_tokens=None)
    assert [x.tolist() for x in split_flat(3, ids)] == [[5, 0], [1, 2, 3], [2]]
    assert carrier_for(SPEC).num_blocks == 3 * 6
    # window 8 (blocks of 4): after 10 tokens it keeps tokens [3, 10) -> blocks 0..2; after 16, [9, 16) -> blocks 2..3
    assert split_flat(3, flat_ids(SPEC, [[0, 1, 2], [3, 4, 5], [1]], num_tokens=10))[1].tolist() == [3, 4, 5]
    assert split_flat(3, flat_ids(SPEC, [[0, 1, 2, 3], [1, 2, 3, 4], [1]], num_tokens=16))[1].tolist() == [3, 4]
    with pytest.raises(BlockIdError, match=r"group 2 \(state 'ssm'\): id 3 is outside \[0, 3\)"):
        flat_ids(SPEC, [[0], [1], [3]])
    with pytest.raises(BlockIdError, match="one list per group: 3 groups; got 1"):
        flat_ids(SPEC, [[0]])


def test_the_wire_form_round_trips_and_a_malformed_one_is_a_protocol_error():
    reg = MemoryRegistry(FakeBackend("a", FakeWorld()))
    geo = register_hybrid(reg, SPEC, tensors())
    carrier = carrier_for(SPEC)
    spec, back = hybrid_from_wire(hybrid_to_wire(geo.view), carrier, 0, MemKind.DRAM)
    assert spec.hybrid == SPEC and spec == carrier
    assert all(np.array_equal(a.bases, b.bases) for a, b in zip(back.view.geometries, geo.view.geometries))
    with pytest.raises(ProtocolError, match="malformed"):
        hybrid_from_wire(b"\x93junk", carrier, 0, MemKind.DRAM)
    wire = msgspec.msgpack.decode(hybrid_to_wire(geo.view))
    wire["groups"][1]["kind"] = "chunked_local"
    with pytest.raises(ProtocolError, match="group 1: kind 'chunked_local' is not one this side knows"):
        hybrid_from_wire(msgspec.msgpack.encode(wire), carrier, 0, MemKind.DRAM)
    other = carrier_for(HybridSpec(SPEC.groups[:2]))
    with pytest.raises(ProtocolError, match="disagree on num_blocks"):
        hybrid_from_wire(hybrid_to_wire(geo.view), other, 0, MemKind.DRAM)
