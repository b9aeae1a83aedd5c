"""kvxfer-hf's SSM state slots against vLLM's description of the same model, without servers.

The state shapes vLLM 0.32 keeps come from its own calculator (``MambaStateShapeCalculator``,
which reads ``VLLM_SSM_CONV_STATE_LAYOUT``); vLLM's side is described by the connector's
``describe_state`` over pages laid out as vLLM lays them; kvxfer-hf's by its slots of the tiny
GraniteMoeHybrid. The two must pair (equal names, shapes, dtypes, order); a transposed conv state
or another TP size must be refused, typed and naming both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvxfer import HybridSpec, LayoutError, StateGroup
from kvxfer.layout.hybrid import hybrid_peer_ranks
from kvxfer.layout.stateplan import check_state_compatible
from kvxfer_transformers.testing import make_tiny_granite_hybrid


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvxfer_transformers.engine import load_model

    return load_model(str(make_tiny_granite_hybrid(Path(tmp_path_factory.mktemp("granite-units")))), "float32", "cpu")


@pytest.fixture(scope="module")
def hf_spec(model):
    from kvxfer_transformers.caches import probe_state
    from kvxfer_transformers.state import StateSlots

    return StateSlots(2, probe_state(model), num_slots=4, device="cpu").spec("m")


def vllm_shapes(model, tp_size: int = 1) -> tuple:
    """The Mamba2 state shapes vLLM 0.32 gives this model's layers at ``tp_size`` (its own code)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    c = model.config
    return MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp_size, intermediate_size=int(c.mamba_expand * c.hidden_size), n_groups=c.mamba_n_groups,
        num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head, state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv)


def vllm_spec(shapes, tp_size: int = 1):
    """The connector's ``StateSpec`` of two Mamba layers whose pages (one per block, conv then SSM,
    padded) hold ``shapes`` in float32, as vLLM's CPU worker lays them out."""
    from kvxfer_vllm.groups import GroupInfo, StateInfo
    from kvxfer_vllm.state import describe_state

    sizes = [torch.Size(s).numel() for s in shapes]
    page, blocks = 4096, 6                      # float32 elements a page (padded), blocks
    group = GroupInfo(0, "state", 0, 32, ("m0", "m2"), StateInfo(tuple(shapes), (torch.float32,) * 2, page * 4))
    entries = []
    for _ in group.layer_names:
        mem = torch.zeros(blocks * page)
        views, offset = [], 0
        for shape, size in zip(shapes, sizes):
            dense = [1] * len(shape)
            for k in range(len(shape) - 2, -1, -1):
                dense[k] = dense[k + 1] * shape[k + 1]
            views.append(mem.as_strided((blocks, *shape), (page, *dense), offset))
            offset += size
        entries.append(views)
    spec, _ = describe_state(group, entries, num_blocks=blocks, tp_rank=0, tp_size=tp_size, model="m")
    return spec


def test_kvxfer_hf_slots_are_described_as_vllm_describes_its_pages(model, hf_spec, monkeypatch):
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    get_conv_state_layout.cache_clear()
    shapes = vllm_shapes(model)
    assert shapes == ((3, 160), (8, 16, 16))          # (kernel - 1, conv_dim), (heads, head_dim, d_state)
    theirs = vllm_spec(shapes)
    assert [t.name for t in hf_spec.tensors] == [t.name for t in theirs.tensors] == ["conv[3,160]", "ssm[8,16,16]"]
    check_state_compatible(hf_spec, theirs)          # the handshake pairs them: same names, dtypes, sizes
    check_state_compatible(theirs, hf_spec)


def test_a_conv_state_kept_transposed_is_refused_naming_both_shapes(model, hf_spec, monkeypatch):
    """vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` keeps the conv state ``(conv_dim, kernel - 1)``: as
    many bytes, another order. An opaque description alone would pair it; the names refuse it."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    try:
        shapes = vllm_shapes(model)
    finally:
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
        get_conv_state_layout.cache_clear()
    assert shapes[0] == (160, 3)
    with pytest.raises(LayoutError, match=r"state tensors differ: local has \['conv\[3,160\]', 'ssm\[8,16,16\]'\]; "
                                          r"remote has \['conv\[160,3\]', 'ssm\[8,16,16\]'\]"):
        check_state_compatible(hf_spec, vllm_spec(shapes))


def test_another_tp_size_is_refused_naming_both(model, hf_spec):
    """kvxfer-hf runs TP 1; a vLLM TP 2 rank's state is half the heads: the read is refused, typed."""
    ours = HybridSpec((StateGroup(hf_spec, name="state0"),))
    with pytest.raises(LayoutError, match=r"group 0 \(state 'state0'\).*local tp_size 1, remote tp_size 2"):
        hybrid_peer_ranks(ours, 2)
    # vLLM's rank keeps half of x and the one B/C group whole (replicated): conv_dim 64 + 2 x 16
    theirs = vllm_spec(vllm_shapes(model, tp_size=2), tp_size=2)
    with pytest.raises(LayoutError, match=r"conv\[3,160\].*conv\[3,96\]', 'ssm\[4,16,16\]"):
        check_state_compatible(hf_spec, theirs)


def test_the_slot_form_is_checked_on_the_model_at_start(model, monkeypatch):
    """``check_state_round_trip`` (run by ``HFEngine.start``) passes the slot form and refuses one
    that keeps the oldest conv columns instead of the newest (same shape, wrong bytes)."""
    from kvxfer_transformers import caches

    caches.check_state_round_trip(model)
    monkeypatch.setattr(caches, "layer_states", lambda layer: [layer.conv_states[0][:, :, :-1].transpose(1, 2),
                                                               layer.recurrent_states[0]])
    with pytest.raises(LayoutError, match="does not survive kvxfer-hf's slot form"):
        caches.check_state_round_trip(model)
