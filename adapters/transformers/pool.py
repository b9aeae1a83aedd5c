"""The paged KV pool: fixed-size blocks registered with kvxfer, filled from and turned back into a transformers cache.

Layer: adapter; imports torch and kvxfer's public API only (no transformers: the engine hands
in plain per-layer K/V tensors). Each attention layer owns one tensor
``[2, num_blocks, block_size, kv_heads, head_dim]``: K half then V half, each block
token-major (kvxfer's ``split`` storage, ``NHD`` layout). Token ``t`` of a request whose
blocks are ``b_0, b_1, ...`` sits in block ``b_{t // block_size}`` at row ``t % block_size``.
K is stored as transformers caches it: after rotary (and after Qwen3's k-norm).

A hybrid model (sliding-window and full-attention layers, ``kvxfer_transformers.groups``)
keeps the same tensors, one per layer, and one block table for all of them: a request's
blocks hold every layer's tokens, a sliding layer's as many blocks as a full one's (only its
window is read back and moved). The Agent sees one group per kind of layer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from kvxfer import AttentionGroup, HybridSpec, KVSpec, KvxferError, LayoutError, StateGroup

from kvxfer_transformers.groups import LayerGroup, layer_groups


class PoolExhausted(KvxferError):
    """No free blocks came back before the deadline (names how many were wanted and free)."""


@dataclass(frozen=True)
class ModelShape:
    """What a model's KV cache looks like: layers, KV heads (GQA), head dim, and its layer groups
    (None: every layer full attention; see ``kvxfer_transformers.groups``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    groups: tuple[LayerGroup, ...] | None = None

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Read a transformers config (text part). Raises LayoutError for caches this pool cannot hold
        (a layer kind other than full and sliding-window attention, MLA)."""
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        groups = layer_groups(getattr(cfg, "layer_types", None), getattr(cfg, "sliding_window", None))
        if getattr(cfg, "kv_lora_rank", None):
            raise LayoutError("MLA models (kv_lora_rank) are not supported by the transformers adapter")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim, groups)


def dtype_name(dtype: torch.dtype) -> str:
    """kvxfer's name of a torch dtype (``torch.float32`` -> ``float32``), as the vLLM adapter names it."""
    return str(dtype).removeprefix("torch.")


#: Pool formats: ``nhd`` (natural, token-major K and V: kvxfer ``split``/``NHD``) and ``vllm-cpu``
#: (vLLM's CPU attention cache byte for byte, see ``KVPool``).
FORMATS = ("nhd", "vllm-cpu")


class KVPool:
    """``num_blocks`` blocks of ``block_size`` tokens per layer, plus a thread-safe free list.

    ``spec`` is the pool's ``KVSpec``; ``tensors`` are what ``Agent.register`` takes. ``model``
    must be the string the peer's spec carries (vLLM: the ``--model`` argument as given), since
    it enters the compatibility hash two agents compare before anything else.

    Formats: ``nhd`` (default) holds per layer ``[2, blocks, block_size, heads, head_dim]``;
    kvxfer's translator converts it to and from any peer whose K and V are token-major inside a
    block (another kvxfer-hf pool, vLLM's GPU backends), across block sizes and HND/NHD.
    ``vllm-cpu`` holds exactly what vLLM's CPU attention kernel (``vec`` ISA: float32, or a CPU
    without AMX) keeps: per layer ``[blocks, heads, 2, block_size, head_dim]`` memory in which
    each head's K block is stored dim-major (``[head_dim, block_size]``, K transposed) and its V
    block token-major: kvxfer's ``head_packed`` HND with ``k_dim_chunk=1``, which the translator
    converts to and from every other layout (so ``nhd`` talks to vLLM CPU peers as well).
    """

    def __init__(self, shape: ModelShape, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, model: str, fmt: str = "nhd", state: Any = None) -> None:
        if fmt not in FORMATS:
            raise LayoutError(f"pool format must be one of {FORMATS}; got {fmt!r}")
        self.format = fmt
        self.groups = shape.groups
        #: model layer indices of the attention layers ``tensors`` holds, in order (all, unless
        #: the model has state layers: those keep ``state``, a ``kvxfer_transformers.state.StateSlots``)
        self.attn_layers = [i for i in range(shape.num_layers)
                            if not any(g.kind == "state" and i in g.layers for g in self.groups or ())]
        self.state_groups = [g for g in self.groups or () if g.kind == "state"]
        if bool(self.state_groups) != (state is not None):
            raise LayoutError(f"a pool with state layers needs state slots and one without none; the model has "
                              f"{len(self.state_groups)} state groups, state slots {'given' if state else 'missing'}")
        self.state = state
        layout, storage, k_chunk = ("NHD", "split", 0) if fmt == "nhd" else ("HND", "head_packed", 1)
        self.spec = KVSpec(num_layers=len(self.attn_layers), num_kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, block_size=block_size, num_blocks=num_blocks,
                           dtype=dtype_name(dtype), layout=layout, storage=storage, model=model, k_dim_chunk=k_chunk)
        self.tensors = [torch.zeros(shp, dtype=dtype, device=device) for shp in self.spec.tensor_shapes()]
        #: what the Agent is built with: ``spec``, or for a hybrid model a ``HybridSpec`` of one
        #: ``AttentionGroup`` per attention group (each its layers' tensors; all share the block
        #: ids) and one ``StateGroup`` per state group (the state slots)
        self.cache_spec: KVSpec | HybridSpec = self.spec
        if self.groups is not None:
            self.cache_spec = HybridSpec(tuple(
                StateGroup(state.spec(model), name=g.name) if g.kind == "state" else
                AttentionGroup(replace(self.spec, num_layers=len(g.layers)), sliding_window=g.sliding_window,
                               name=g.name) for g in self.groups))
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._freed = threading.Condition()

    def _views(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[blocks, block_size, heads, head_dim]`` views of its tensor."""
        if self.format == "nhd":
            return t[0], t[1]
        n, heads, _, bs, dim = t.shape
        k = t[:, :, 0].view(n, heads, dim, bs).permute(0, 3, 1, 2)  # dim-major K, as vLLM's kernel keeps it
        return k, t[:, :, 1].permute(0, 2, 1, 3)

    def same_format_as(self, peer: KVSpec) -> bool:
        """Whether blocks can move between this pool and ``peer`` with each head's bytes unchanged
        (another TP size is fine: in ``head_packed`` a head's K and V regions move whole)."""
        return (peer.layout == self.spec.layout and peer.storage == self.spec.storage
                and peer.block_size == self.spec.block_size and peer.k_dim_chunk == self.spec.k_dim_chunk)

    def exchangeable_with(self, peer: KVSpec) -> bool:
        """Whether kvxfer's translator moves this pool's K correctly to or from ``peer``: always, but
        for a ``head_packed`` peer that states no K order (vLLM CPU on a kernel kvxfer cannot describe)."""
        return peer.storage.value != "head_packed" or peer.k_dim_major or self.same_format_as(peer)

    def agent_tensors(self) -> list:
        """What ``Agent.register`` takes for ``cache_spec``: the layers' tensors, or one list per group."""
        if self.groups is None:
            return self.tensors
        at = {layer: i for i, layer in enumerate(self.attn_layers)}
        return [self.state.tensors if g.kind == "state" else [self.tensors[at[i]] for i in g.layers]
                for g in self.groups]

    @property
    def num_groups(self) -> int:
        return 1 if self.groups is None else len(self.groups)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def free_blocks(self) -> int:
        with self._freed:
            return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ------------------------------------------------------------------
    def allocate(self, count: int, timeout: float = 0.0) -> list[int]:
        """``count`` free block ids, waiting up to ``timeout`` seconds for frees.

        Raises:
            PoolExhausted: fewer than ``count`` free when the deadline passes (or more than the pool has).
        """
        deadline = time.monotonic() + timeout
        with self._freed:
            while len(self._free) < count:
                left = deadline - time.monotonic()
                if count > self.spec.num_blocks or left <= 0:
                    raise PoolExhausted(f"wanted {count} KV blocks; {len(self._free)} of "
                                        f"{self.spec.num_blocks} free")
                self._freed.wait(left)
            return [self._free.pop() for _ in range(count)]

    def free(self, blocks: Sequence[int], slots: Sequence[int] = ()) -> None:
        """Return blocks (and state ``slots``) to the free lists (the caller owns them; each id at most once)."""
        with self._freed:
            self._free.extend(int(b) for b in blocks)
            self._freed.notify_all()
        if slots:
            self.state.free(slots)

    def allocate_slots(self, count: int, timeout: float = 0.0) -> list[int]:
        """``count`` free state slots (a pool with state layers). Raises PoolExhausted."""
        return self.state.allocate(count, timeout)

    # ---- copies ----------------------------------------------------------------------
    def _ids(self, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        if num_tokens > len(blocks) * self.block_size:
            raise LayoutError(f"{num_tokens} tokens do not fit {len(blocks)} blocks of {self.block_size}")
        return torch.as_tensor(list(blocks), dtype=torch.int64, device=self.tensors[0].device)

    def store(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: Sequence[int],
              num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of each layer's ``(K, V)``, shaped like transformers'
        cache ``[1, kv_heads, tokens, head_dim]``, into ``blocks`` (in token order; the rest of the
        last block is zeroed)."""
        if len(layers) != len(self.tensors):
            raise LayoutError(f"expected K/V of {len(self.tensors)} layers; got {len(layers)}")
        ids = self._ids(blocks, num_tokens)
        pad = len(blocks) * self.block_size - num_tokens
        for t, kv in zip(self.tensors, layers):
            for view, x in zip(self._views(t), kv):
                rows = x[0, :, :num_tokens].transpose(0, 1).to(t.dtype)           # [tokens, heads, dim]
                rows = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, pad))
                view[ids] = rows.reshape(len(blocks), self.block_size, *rows.shape[1:])

    def load(self, blocks: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(K, V)`` of the first ``num_tokens`` tokens held in ``blocks``, shaped
        ``[1, kv_heads, tokens, head_dim]`` (fresh tensors: the blocks may be freed afterwards)."""
        ids = self._ids(blocks, num_tokens)
        out = []
        for t in self.tensors:
            k, v = (view[ids].reshape(-1, *view.shape[2:])[:num_tokens].transpose(0, 1).unsqueeze(0).contiguous()
                    for view in self._views(t))
            out.append((k, v))
        return out
