"""Units of kvxfer-hf's layer groups (a hybrid model's pool): groups read from ``layer_types``, ids held, ids read."""

from __future__ import annotations

import pytest
import torch

from kvxfer import HybridSpec, LayoutError
from kvxfer_transformers.groups import answer_ids, layer_groups, read_ids
from kvxfer_transformers.pool import KVPool, ModelShape


def test_groups_in_order_of_first_appearance_named_as_vllm_names_them():
    g = layer_groups(["sliding_attention", "full_attention"] * 2, 32)
    assert [(x.name, x.kind, x.layers, x.sliding_window) for x in g] == \
        [("sliding0", "sliding", (0, 2), 32), ("full1", "full", (1, 3), 0)]
    assert layer_groups(["full_attention"] * 3, None) is None
    assert layer_groups(None, None) is None


@pytest.mark.parametrize("types, window, words", [
    (["full_attention", "chunked_attention"], 0, "layer 1 is 'chunked_attention'"),
    (["linear_attention"] * 2, 0, "needs a full_attention layer"),
    (["sliding_attention"] * 2, 8, "needs a full_attention layer"),
    (["sliding_attention", "full_attention"], None, "positive sliding_window"),
])
def test_what_the_pool_cannot_hold_is_refused_naming_it(types, window, words):
    with pytest.raises(LayoutError, match=words):
        layer_groups(types, window)


def test_a_prefill_holds_every_block_for_full_and_the_window_plus_one_for_sliding():
    g = layer_groups(["sliding_attention", "full_attention"], 32)
    blocks = list(range(10, 20))
    assert answer_ids(g, blocks, 16) == [[17, 18, 19], blocks]     # ceil(32 / 16) + 1 blocks
    assert answer_ids(g, [3], 16) == [[3], [3]]


@pytest.mark.parametrize("remote_tokens, tokens, sliding", [
    (100, 99, [11, 12, 13]),       # token 98 in block 6, as the producer's last (token 99): kept whole
    (97, 96, [11, 12]),            # token 95 ends block 5; the producer's list ends at block 6: one dropped
])
def test_a_decode_reads_the_full_list_and_the_sliding_tail_up_to_its_last_token(remote_tokens, tokens, sliding):
    g = layer_groups(["sliding_attention", "full_attention"], 32)
    full = list(range(100, 107))
    landing = list(range(-(-tokens // 16)))
    local, remote = read_ids(g, [[11, 12, 13], full], remote_tokens, landing, tokens, 16)
    assert remote == [sliding, full[:len(landing)]]
    assert local == [landing, landing]


def test_a_hybrid_pool_registers_one_group_per_kind_on_its_layers_tensors():
    shape = ModelShape(4, 2, 8, layer_groups(["sliding_attention", "full_attention"] * 2, 32))
    pool = KVPool(shape, num_blocks=4, block_size=16, dtype=torch.float32, device="cpu", model="m")
    assert isinstance(pool.cache_spec, HybridSpec) and pool.num_groups == 2
    assert [g.spec.num_layers for g in pool.cache_spec.groups] == [2, 2]
    tensors = pool.agent_tensors()
    assert tensors[0][1] is pool.tensors[2] and tensors[1][0] is pool.tensors[1]


def test_a_state_group_holds_and_reads_the_requests_slot():
    g = layer_groups(["linear_attention", "full_attention"] * 2, None)
    assert [(x.name, x.kind, x.layers) for x in g] == [("state0", "state", (0, 2)), ("full1", "full", (1, 3))]
    assert answer_ids(g, [4, 5, 6], 16, slot=3) == [[3], [4, 5, 6]]
    local, remote = read_ids(g, [[3], [4, 5, 6]], 40, [0, 1, 2], 39, 16, slot=7)
    assert (local, remote) == ([[7], [0, 1, 2]], [[3], [4, 5, 6]])
    with pytest.raises(LayoutError, match="state0 is a state group"):
        answer_ids(g, [4], 16)


def test_a_state_pool_registers_its_slots_as_a_state_group():
    from kvxfer import StateGroup
    from kvxfer_transformers.state import StateShape, StateSlots

    shape = ModelShape(4, 2, 8, layer_groups(["linear_attention", "full_attention"] * 2, None))
    state = StateSlots(2, [StateShape("conv0", (6, 4), torch.float32), StateShape("ssm0", (2, 3, 4), torch.float32)],
                       num_slots=3, device="cpu")
    pool = KVPool(shape, num_blocks=4, block_size=16, dtype=torch.float32, device="cpu", model="m", state=state)
    assert pool.attn_layers == [1, 3] and pool.spec.num_layers == 2
    group = pool.cache_spec.groups[0]
    assert isinstance(group, StateGroup) and group.spec.num_slots == 3 and group.spec.num_layers == 2
    assert pool.agent_tensors()[0] is state.tensors
    x = [[torch.rand(1, 6, 4), torch.rand(1, 2, 3, 4)] for _ in range(2)]
    state.store(x, 1)
    assert all(torch.equal(a, b) for la, lb in zip(state.load(1), x) for a, b in zip(la, lb))
    with pytest.raises(LayoutError, match="needs state slots"):
        KVPool(shape, num_blocks=4, block_size=16, dtype=torch.float32, device="cpu", model="m")
