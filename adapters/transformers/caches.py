"""transformers cache plumbing for hybrid models: sliding layers that keep the whole prompt, state layers read and filled (layer: adapter; torch, transformers' cache objects, this package).

What ``HFEngine`` does to a transformers ``DynamicCache`` beyond K/V of full-attention layers:
a prefill makes its sliding-window layers keep every prompt token until they are stored (they
keep ``window - 1`` otherwise), and a linear-attention (SSM) layer's conv and recurrent state is
read for a state slot, or filled from one before a decode continues.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvxfer import LayoutError

from kvxfer_transformers.state import StateShape


def layer_states(layer: Any) -> list[torch.Tensor]:
    """A transformers linear-attention cache layer's state tensors: its conv states, then its
    recurrent states, by state index (``probe_state`` names them in this order)."""
    k = layer.number_of_states
    return [layer.conv_states[i] for i in range(k)] + [layer.recurrent_states[i] for i in range(k)]


def set_layer_states(layer: Any, tensors: list[torch.Tensor]) -> None:
    """Fill a fresh linear-attention cache layer with ``tensors`` (as ``layer_states`` lists them),
    as if it had run the prompt they were taken after."""
    k = layer.number_of_states
    for i in range(k):
        conv, rec = tensors[i], tensors[k + i]
        layer.lazy_initialization(conv_states=conv, recurrent_states=rec, state_idx=i)
        layer.conv_states[i].copy_(conv)
        layer.recurrent_states[i].copy_(rec)
        layer.has_previous_state[i] = True


def probe_state(model: Any) -> list[StateShape]:
    """The state tensors of ``model``'s linear-attention layers, read from a two-token forward.

    Raises:
        LayoutError: no layer kept a conv and a recurrent state for every state index.
    """
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.tensor([[0, 1]], device=device), past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            k = layer.number_of_states
            if not all(layer.is_conv_states_initialized[i] and layer.is_recurrent_states_initialized[i]
                       for i in range(k)):
                break
            names = [f"conv{i}" for i in range(k)] + [f"ssm{i}" for i in range(k)]
            return [StateShape(n, tuple(t.shape[1:]), t.dtype) for n, t in zip(names, layer_states(layer))]
    raise LayoutError("the model's linear-attention layers keep no conv and recurrent state that kvxfer-hf can "
                      "hold (transformers left them empty after a forward)")


def record_sliding(cache: DynamicCache) -> list[Any]:
    """Make ``cache``'s sliding-window layers keep every token of the next forward (transformers
    keeps only the last ``window - 1``: one short of what a decoder that recomputes the last
    prompt token needs); returns them for ``trim_sliding``."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    for layer in layers:
        layer.activate_past_recording()
    return layers


def trim_sliding(layers: list[Any]) -> None:
    """Back to transformers' own sliding cache: the last ``window - 1`` tokens, recording off."""
    for layer in layers:
        layer.record_past = False
        if layer.keys is not None and layer.keys.shape[-2] >= layer.sliding_window:
            layer.keys = layer.keys[:, :, -layer.sliding_window + 1:, :]
            layer.values = layer.values[:, :, -layer.sliding_window + 1:, :]
