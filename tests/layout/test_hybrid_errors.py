"""Several KV-cache groups: whatever kvxfer cannot move is refused typed, naming the group and both values."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvxfer.errors import BlockIdError, ConfigError, LayoutError
from kvxfer.layout import KVSpec
from kvxfer.layout.groups import AttentionGroup, HybridSpec, HybridView, StateGroup, group_kind
from kvxfer.layout.hybrid import build_hybrid_plan, hybrid_peer_ranks
from kvxfer.layout.oracle import place_hybrid
from kvxfer.layout.state import StateSpec, StateTensor

KV = KVSpec(2, 4, 8, 4, 16, model="m")
CONV = StateTensor("conv", "float16", ((4, 2), (2, 3), (2, 3)), inner=3)
SSM = StateTensor("ssm", "float32", ((4, 1),), inner=6)


def _hybrid(tp: int = 1, window: int = 8, tensors=(CONV, SSM), **kv) -> HybridSpec:
    spec = dataclasses.replace(KV, tp_size=tp, **kv)
    return HybridSpec((AttentionGroup(spec, name="full"), AttentionGroup(spec, window, name="swa"),
                       StateGroup(StateSpec(2, tensors, 4, tp_size=tp, model="m"), name="mamba")))


def _plan(local: HybridSpec, remote: HybridSpec, **kw):
    return build_hybrid_plan(place_hybrid(local)[0], place_hybrid(remote, arena_base=0x4000_0000)[0], **kw)


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ConfigError, match="pp_size must be 1; got 2"):
        HybridSpec((AttentionGroup(KV),), pp_size=2)


def test_a_group_kind_kvxfer_cannot_describe_is_refused():
    with pytest.raises(LayoutError, match=r"group 1: kind 'chunked_local' cannot be described.*'full', 'sliding', 'state'"):
        group_kind("chunked_local", 1)
    assert group_kind("sliding") == "sliding"
    with pytest.raises(LayoutError, match="group 1: dict is not a group"):
        HybridSpec((AttentionGroup(KV), {"kind": "cross_attention"}))


def test_groups_of_one_instance_share_tp_and_model():
    other = dataclasses.replace(KV, tp_size=2)
    with pytest.raises(LayoutError, match=r"group 1 \(full ''\): tp_size is 2; group 0 has 1"):
        HybridSpec((AttentionGroup(KV), AttentionGroup(other)))


@pytest.mark.parametrize("remote, words", [
    (HybridSpec((AttentionGroup(KV),)), r"local has 3 groups \['full', 'sliding', 'state'\]; remote has 1 \['full'\]"),
    (_hybrid(window=16), r"group 1 \(sliding 'swa'\): sliding_window differs: local has 8; remote has 16"),
    (_hybrid(window=0), r"group 1 \(sliding 'swa'\): kind differs: local has 'sliding'; remote has 'full'"),
    (_hybrid(head_dim=16), r"group 0 \(full 'full'\): head_dim differs: local has 8; remote has 16"),
    (_hybrid(tensors=(CONV,)), r"group 2 \(state 'mamba'\): state tensors differ: local has \['conv', 'ssm'\]; "
                               r"remote has \['conv'\]"),
    (_hybrid(tensors=(CONV, dataclasses.replace(SSM, inner=8))), r"group 2 .*state tensor 'ssm' differs"),
])
def test_mismatched_group_lists_are_refused_naming_the_group_and_both(remote, words):
    with pytest.raises(LayoutError, match=words):
        _plan(_hybrid(), remote)


def test_state_whose_tp_cut_is_unknown_moves_only_between_equal_tp():
    opaque = (CONV, StateTensor.opaque("extra", "uint8", 5))
    local, remote = _hybrid(tp=1, tensors=opaque), _hybrid(tp=2, tensors=opaque)
    words = r"group 2 \(state 'mamba'\).*'extra' has no described TP split.*tp_size 1, remote tp_size 2"
    with pytest.raises(LayoutError, match=words):
        hybrid_peer_ranks(local, 2)
    with pytest.raises(LayoutError, match=words):
        _plan(local, remote)
    assert _plan(_hybrid(tp=2, tensors=opaque).with_rank(1), _hybrid(tp=2, tensors=opaque).with_rank(1)).parts[2]


@pytest.mark.parametrize("bad", [0, -2, True, "2"])
def test_a_bad_remote_tp_size_is_refused(bad):
    with pytest.raises(LayoutError, match="remote tp_size must be a positive integer"):
        hybrid_peer_ranks(_hybrid(tensors=(CONV, StateTensor.opaque("extra", "uint8", 5))), bad)


def test_state_units_that_tp_cannot_cut_are_refused_naming_both():
    six = StateTensor("ssm", "float32", ((6, 1),), inner=2)
    with pytest.raises(LayoutError, match=r"'ssm' segment 0: units \(6\) and tp_size \(4\) must divide one another"):
        StateSpec(1, (six,), 2, tp_size=4)


def test_bad_request_ids_are_refused_and_name_the_group():
    plan = _plan(_hybrid(), _hybrid())
    good = [[0, 1], [0, 1], [2]]
    with pytest.raises(BlockIdError, match="local ids must be one list per group: 3 groups; got 2"):
        plan.for_request(good[:2], good)
    with pytest.raises(BlockIdError, match=r"group 2 \(state 'mamba'\): local \(state slots\) block id 4 is outside \[0, 4\)"):
        plan.for_request([[0, 1], [0, 1], [4]], good)
    with pytest.raises(BlockIdError, match=r"group 2 .*local has 2, remote has 1"):
        plan.for_request([[0, 1], [0, 1], [1, 2]], good)
    with pytest.raises(BlockIdError, match=r"group 1 \(sliding 'swa'\): the remote list must end with the window's 2 "
                                           r"blocks \(tokens \[4, 12\) of 12\)"):
        plan.for_request([[0, 1, 2], [0, 1, 2], [1]], [[0, 1, 2], [2], [1]], num_tokens=12)
    with pytest.raises(BlockIdError, match="num_tokens"):
        plan.for_request(good, good, num_tokens=-1)
    req = plan.for_request([[0, 1, 2], [9, 0, 1, 2], [1]], [[0, 1, 2], [3, 4, 5], [1]], num_tokens=12)
    # window 8 after 12 tokens: tokens [5, 12) matter, blocks 1 and 2 of 4 tokens move
    assert [p.num_bytes for p in req.parts] == [2 * 2 * 12 * 4 * 8 * 2, 2 * 2 * 8 * 4 * 8 * 2,
                                               2 * (4 * 2 + 2 * 3 + 2 * 3) * 3 * 2 + 2 * 4 * 6 * 4]


def test_a_sliding_group_moves_only_its_window():
    plan = _plan(_hybrid(window=5), _hybrid(window=5))
    # 40 tokens, blocks of 4: the next token attends to [36, 40]: tokens 36..39, one block
    req = plan.for_request([list(range(10))] * 2 + [[0]], [list(range(10))] * 2 + [[0]], num_tokens=40)
    assert req.parts[1].num_bytes * 10 == req.parts[0].num_bytes
    loc, rem = req.descriptors()
    assert loc.shape == rem.shape and int(loc[:, 1].sum()) == req.num_bytes


def test_a_view_needs_one_geometry_per_group():
    spec = _hybrid()
    view = HybridView.contiguous(spec, 0x1000)
    with pytest.raises(LayoutError, match="one geometry per group: 3 groups; got 2"):
        HybridView(spec, view.geometries[:2])
    with pytest.raises(LayoutError, match=r"group 2 \(state 'mamba'\): state geometry has \(1, 2\) bases; "
                                          r"spec expects \(2, 2\)"):
        HybridView(spec, view.geometries[:2] + (view.geometries[0].__class__(np.zeros((1, 2))),))


def test_a_pair_that_moves_nothing_is_refused_naming_both_ranks():
    consumer = _hybrid(tp=2).with_rank(0)
    assert hybrid_peer_ranks(consumer, 4) == [0, 1]
    with pytest.raises(LayoutError, match=r"remote rank 3/4 and local rank 0/2 move nothing in any group"):
        _plan(consumer, _hybrid(tp=4).with_rank(3))
