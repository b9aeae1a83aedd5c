"""State tensors of the SSM and linear-attention layers engines run (layer: layout, pure; numpy only, no nixl/zmq/torch).

Each function returns a layer's ``(conv, temporal)`` ``StateTensor`` pair described by how
tensor parallelism cuts it, in the shapes vLLM 0.32 keeps (``MambaStateShapeCalculator``):

* the conv state is ``(conv_dim / tp, kernel - 1 + num_spec)`` in the ``"DS"`` order or its
  transpose in ``"SD"``; ``conv_dim`` is made of sub-projections each cut over TP on its own
  (Mamba2: x, B, C; GDN: Q, K, V; Mamba1: x alone);
* the temporal (SSM) state is cut by heads (Mamba1: by channels).

Mamba2 with ``n_groups`` that TP does not divide replicates groups so every rank holds the
group of its heads; a segment of ``n_groups`` units cut as heads are says the same.
"""

from __future__ import annotations

from kvxfer.errors import LayoutError
from kvxfer.layout.state import StateTensor

__all__ = ["gdn_state", "mamba1_state", "mamba2_state"]


def _conv(segments: tuple[tuple[int, int], ...], rows: int, dtype: str, order: str) -> StateTensor:
    if order not in ("DS", "SD"):
        raise LayoutError(f"conv state order must be 'DS' (dim, state_len) or 'SD' (state_len, dim); got {order!r}")
    if order == "DS":
        return StateTensor("conv", dtype, segments, inner=rows)
    return StateTensor("conv", dtype, segments, outer=rows)


def mamba1_state(intermediate_size: int, state_size: int, conv_kernel: int, *, conv_dtype: str = "bfloat16",
                 ssm_dtype: str = "bfloat16", order: str = "SD", num_spec: int = 0) -> tuple[StateTensor, StateTensor]:
    """Mamba1: conv ``(intermediate / tp, kernel - 1)``, SSM ``(intermediate / tp, state_size)``."""
    return (_conv(((intermediate_size, 1),), conv_kernel - 1 + num_spec, conv_dtype, order),
            StateTensor("ssm", ssm_dtype, ((intermediate_size, 1),), inner=state_size))


def mamba2_state(num_heads: int, head_dim: int, n_groups: int, state_size: int, conv_kernel: int, *,
                 conv_dtype: str = "bfloat16", ssm_dtype: str = "bfloat16", order: str = "SD",
                 num_spec: int = 0) -> tuple[StateTensor, StateTensor]:
    """Mamba2: conv over ``[x | B | C]`` (``num_heads * head_dim`` + 2 x ``n_groups * state_size``
    channels), SSM ``(num_heads / tp, head_dim, state_size)``."""
    segments = ((num_heads, head_dim), (n_groups, state_size), (n_groups, state_size))
    return (_conv(segments, conv_kernel - 1 + num_spec, conv_dtype, order),
            StateTensor("ssm", ssm_dtype, ((num_heads, 1),), inner=head_dim * state_size))


def gdn_state(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, *,
              conv_dtype: str = "bfloat16", ssm_dtype: str = "bfloat16", order: str = "SD",
              num_spec: int = 0) -> tuple[StateTensor, StateTensor]:
    """Gated DeltaNet (Qwen3-Next): conv over ``[Q | K | V]``, state ``(num_v_heads / tp, head_v_dim, head_k_dim)``."""
    segments = ((num_k_heads, head_k_dim), (num_k_heads, head_k_dim), (num_v_heads, head_v_dim))
    return (_conv(segments, conv_kernel - 1 + num_spec, conv_dtype, order),
            StateTensor("ssm", ssm_dtype, ((num_v_heads, 1),), inner=head_v_dim * head_k_dim))
