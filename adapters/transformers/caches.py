"""transformers cache plumbing for hybrid models: sliding layers that keep the whole prompt, state layers read and filled (layer: adapter; torch, transformers' cache objects, this package).

What ``HFEngine`` does to a transformers ``DynamicCache`` beyond K/V of full-attention layers:
a prefill makes its sliding-window layers keep every prompt token until they are stored (they
keep ``window - 1`` otherwise), and a linear-attention (SSM) layer's conv and recurrent state is
read for a state slot, or filled from one before a decode continues.

A state slot holds the state in vLLM's form, so kvxfer moves it slot to slot between kvxfer-hf
and vLLM as well as between two kvxfer-hf instances (docs/engines.md, "Hybrid models in
``kvxfer-hf``"). transformers keeps a Mamba2 layer's conv state as ``[conv_dim, kernel]``: the
last ``kernel`` conv inputs, oldest first, of which the next token's convolution reads only the
newest ``kernel - 1`` (a decode step concatenates the new input and keeps the last ``kernel``
outputs' worth: the oldest column only ever falls out). vLLM keeps those ``kernel - 1`` inputs as
``[kernel - 1, conv_dim]`` (its default ``SD`` layout), oldest first. So a slot's conv state is
transformers' columns ``1..kernel-1`` transposed, and filling a cache from a slot puts a zero
column back in front (never read). The recurrent (SSM) state ``[heads, head_dim, d_state]`` is
the same in both, moved as it is. ``check_state_round_trip`` proves the conversion on the model
itself when the engine starts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache

from kvxfer import LayoutError

from kvxfer_transformers.state import StateShape


def state_name(kind: str, shape: Sequence[int]) -> str:
    """A state tensor's name on the wire: its kind and its shape in a slot, e.g. ``conv[3,160]``.

    vLLM's KvxferConnector names a Mamba layer's tensors the same way (kvxfer_vllm.state), so the
    handshake pairs the two engines' tensors only when their slot shapes are equal: a transposed
    conv state (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT=DS``) or another model's is refused, naming both.
    """
    return f"{kind}[{','.join(str(int(d)) for d in shape)}]"


def layer_states(layer: Any) -> list[torch.Tensor]:
    """A transformers linear-attention cache layer's state tensors in slot form (batch axis
    kept): its conv states as ``[1, kernel - 1, conv_dim]`` (views: the oldest column dropped,
    transposed), then its recurrent states as they are, by state index (``probe_state`` names
    them in this order)."""
    k = layer.number_of_states
    return [layer.conv_states[i][:, :, 1:].transpose(1, 2) for i in range(k)] + \
        [layer.recurrent_states[i] for i in range(k)]


def set_layer_states(layer: Any, tensors: list[torch.Tensor]) -> None:
    """Fill a fresh linear-attention cache layer with slot-form ``tensors`` (as ``layer_states``
    lists them), as if it had run the prompt they were taken after: each conv state goes back to
    transformers' ``[1, conv_dim, kernel]`` with a zero column in front (the one never read)."""
    k = layer.number_of_states
    for i in range(k):
        slot_conv, rec = tensors[i], tensors[k + i]
        conv = torch.nn.functional.pad(slot_conv.transpose(1, 2), (1, 0))
        layer.lazy_initialization(conv_states=conv, recurrent_states=rec, state_idx=i)
        layer.conv_states[i].copy_(conv)
        layer.recurrent_states[i].copy_(rec)
        layer.has_previous_state[i] = True


def probe_state(model: Any) -> list[StateShape]:
    """The state tensors of ``model``'s linear-attention layers in slot form (``layer_states``),
    read from a two-token forward; named by ``state_name``.

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
            kinds = ["conv", "ssm"] if k == 1 else [f"conv{i}" for i in range(k)] + [f"ssm{i}" for i in range(k)]
            return [StateShape(state_name(n, t.shape[1:]), tuple(t.shape[1:]), t.dtype)
                    for n, t in zip(kinds, layer_states(layer))]
    raise LayoutError("the model's linear-attention layers keep no conv and recurrent state that kvxfer-hf can "
                      "hold (transformers left them empty after a forward)")


def check_state_round_trip(model: Any, tokens: int = 9) -> None:
    """Prove the slot form on ``model``: the next token's logits after a ``tokens - 1``-token
    prompt, computed from transformers' own cache, equal those computed from a cache whose state
    layers went through a slot and back (``layer_states``, ``set_layer_states``).

    Raises:
        LayoutError: they differ (this model's conv state keeps columns the slot form drops, or
            orders them otherwise): kvxfer-hf cannot move its state.
    """
    device = next(model.parameters()).device
    ids = torch.arange(1, tokens + 1, device=device).unsqueeze(0)
    with torch.inference_mode():
        want_cache, got_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], past_key_values=want_cache, use_cache=True)
        model(input_ids=ids[:, :-1], past_key_values=got_cache, use_cache=True)
        for layer in got_cache.layers:
            if hasattr(layer, "recurrent_states"):
                set_layer_states(layer, [t.clone() for t in layer_states(layer)])
        want = model(input_ids=ids[:, -1:], past_key_values=want_cache, use_cache=True).logits
        got = model(input_ids=ids[:, -1:], past_key_values=got_cache, use_cache=True).logits
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise LayoutError(f"this model's linear-attention state does not survive kvxfer-hf's slot form "
                          f"(conv state: the newest kernel - 1 inputs, vLLM's [kernel - 1, conv_dim]): the next "
                          f"token's logits differ by up to {float((got - want).abs().max()):.3g} after a round trip")


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
