"""kvxfer.layout.ssm's state tensors hold, on every rank, exactly the per-rank shapes vLLM 0.32 computes itself."""

from __future__ import annotations

import pytest
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from kvxfer.errors import LayoutError
from kvxfer.layout.ssm import gdn_state, mamba1_state, mamba2_state
from kvxfer.layout.state import StateSpec


def _local(tensors, tp: int, order: str):
    """Per-rank shapes as vLLM writes them: conv (dim, rows) in DS order, (rows, dim) in SD; SSM flattened."""
    spec = StateSpec(1, tensors, 1, tp_size=tp)
    (_, c_outer, c_split, c_inner), (_, _, s_split, s_inner) = spec.tensor_shapes()
    conv = (c_split, c_inner) if order == "DS" else (c_outer, c_split)
    assert (c_inner if order == "SD" else c_outer) == 1
    return conv, (s_split, s_inner)


def _orient(vllm_conv, order):
    """vLLM's conv shape (in the order its configuration chose) in ``order``."""
    ds = vllm_conv if is_conv_state_dim_first() else vllm_conv[::-1]
    return ds if order == "DS" else ds[::-1]


@pytest.mark.parametrize("order", ["DS", "SD"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_mamba2_matches_vllm(order, tp, n_groups):
    heads, head_dim, d_state, kernel = 8, 4, 16, 4
    conv, ssm = Calc.mamba2_state_shape(tp, heads * head_dim, n_groups, heads, head_dim, d_state, kernel, num_spec=1)
    ours = _local(mamba2_state(heads, head_dim, n_groups, d_state, kernel, order=order, num_spec=1), tp, order)
    assert ours == (_orient(conv, order), (ssm[0], ssm[1] * ssm[2]))


@pytest.mark.parametrize("order", ["DS", "SD"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba1_and_gdn_match_vllm(order, tp):
    conv, ssm = Calc.mamba1_state_shape(tp, 16, 8, 4)
    assert _local(mamba1_state(16, 8, 4, order=order), tp, order) == (
        _orient(conv, order), ssm)
    conv, ssm = Calc.gated_delta_net_state_shape(tp, 4, 8, 16, 8, 4)
    assert _local(gdn_state(4, 8, 16, 8, 4, order=order), tp, order) == (
        _orient(conv, order), (ssm[0], ssm[1] * ssm[2]))


def test_an_unknown_conv_order_is_refused():
    with pytest.raises(LayoutError, match="'DS'.*'SD'.*got 'NC'"):
        mamba2_state(8, 4, 1, 16, 4, order="NC")
