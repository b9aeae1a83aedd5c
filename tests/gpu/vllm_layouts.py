"""vLLM 0.32's KV-cache tensors without vLLM (tests only; torch only): one allocation viewed per layer
as ``[blocks, heads, tokens, content]`` in a ``KVCacheLayout``'s memory order.

Recorded from vLLM 0.32 (``vllm/v1/kv_cache_layout.py``, ``vllm/v1/kv_cache_interface.py``:
``compute_layout_strides``, ``create_kv_cache_views``; ``vllm/v1/worker/utils.py``: ``allocate_kv_cache``)
for one KV-cache group without padded pages, so GPU hosts, where vLLM is not installed, build the
same tensors. ``tests/vllm/test_vllm_gpu_caches.py::test_layout_table_matches_vllm`` checks this
module against vLLM's own functions on every layout.
"""

from __future__ import annotations

#: Physical order of the logical axes [L, B, H, N, C] for each layout (vLLM's KVCacheLayout values).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_views(*, num_layers: int, num_blocks: int, heads: int, block_size: int, content: int,
                 dtype, layout: str, device="cpu"):
    """Per-layer views ``[num_blocks, heads, block_size, content]`` of ``dtype`` over one zeroed
    allocation, axes placed in memory in ``LAYOUTS[layout]`` order (outermost first)."""
    import torch

    item = torch.empty(0, dtype=dtype).element_size()
    shape = (num_layers, num_blocks, heads, block_size, content * item)  # bytes on the last axis
    strides = [0] * 5
    step = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = step
        step *= shape[axis]
    raw = torch.zeros(step, dtype=torch.int8, device=device)
    five = raw.as_strided(shape, strides)
    return [five[i].view(dtype) for i in range(num_layers)]
