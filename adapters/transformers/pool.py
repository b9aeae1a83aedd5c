"""The paged KV pool: fixed-size blocks registered with kvxfer, filled from and turned back into a transformers cache.

Layer: adapter; imports torch and kvxfer's public API only (no transformers: the engine hands
in plain per-layer K/V tensors). Each attention layer owns one tensor
``[2, num_blocks, block_size, kv_heads, head_dim]``: K half then V half, each block
token-major (kvxfer's ``split`` storage, ``NHD`` layout). Token ``t`` of a request whose
blocks are ``b_0, b_1, ...`` sits in block ``b_{t // block_size}`` at row ``t % block_size``.
K is stored as transformers caches it: after rotary (and after Qwen3's k-norm).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvxfer import KVSpec, KvxferError, LayoutError


class PoolExhausted(KvxferError):
    """No free blocks came back before the deadline (names how many were wanted and free)."""


@dataclass(frozen=True)
class ModelShape:
    """What a model's KV cache looks like: layers, KV heads (GQA), head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Read a transformers config (text part). Raises LayoutError for caches this pool cannot hold
        (sliding-window or linear-attention layers, MLA)."""
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise LayoutError(f"only full-attention layers fit a paged KV pool; this model has {sorted(kinds)}")
        if getattr(cfg, "kv_lora_rank", None):
            raise LayoutError("MLA models (kv_lora_rank) are not supported by the transformers adapter")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim)


def dtype_name(dtype: torch.dtype) -> str:
    """kvxfer's name of a torch dtype (``torch.float32`` -> ``float32``), as the vLLM adapter names it."""
    return str(dtype).removeprefix("torch.")


class KVPool:
    """``num_blocks`` blocks of ``block_size`` tokens per layer, plus a thread-safe free list.

    ``spec`` is the pool's ``KVSpec``; ``tensors`` are what ``Agent.register`` takes. ``model``
    must be the string the peer's spec carries (vLLM: the ``--model`` argument as given), since
    it enters the compatibility hash two agents compare before anything else.
    """

    def __init__(self, shape: ModelShape, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, model: str) -> None:
        self.spec = KVSpec(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                           head_dim=shape.head_dim, block_size=block_size, num_blocks=num_blocks,
                           dtype=dtype_name(dtype), layout="NHD", storage="split", model=model)
        self.tensors = [torch.zeros(2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
                                    dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._freed = threading.Condition()

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

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks to the free list (the caller owns them; each id at most once)."""
        with self._freed:
            self._free.extend(int(b) for b in blocks)
            self._freed.notify_all()

    # ---- copies ----------------------------------------------------------------------
    def _slots(self, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        if num_tokens > len(blocks) * self.block_size:
            raise LayoutError(f"{num_tokens} tokens do not fit {len(blocks)} blocks of {self.block_size}")
        ids = torch.as_tensor(list(blocks), dtype=torch.int64)
        rows = (ids[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)
        return rows[:num_tokens].to(self.tensors[0].device)

    def store(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: Sequence[int],
              num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of each layer's ``(K, V)``, shaped like transformers'
        cache ``[1, kv_heads, tokens, head_dim]``, into ``blocks`` (in token order)."""
        if len(layers) != len(self.tensors):
            raise LayoutError(f"expected K/V of {len(self.tensors)} layers; got {len(layers)}")
        slots = self._slots(blocks, num_tokens)
        for pool, (k, v) in zip(self.tensors, layers):
            flat = pool.view(2, -1, *pool.shape[3:])  # [2, blocks*block_size, heads, dim]
            for half, x in ((0, k), (1, v)):
                flat[half].index_copy_(0, slots, x[0, :, :num_tokens].transpose(0, 1).to(pool.dtype))

    def load(self, blocks: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(K, V)`` of the first ``num_tokens`` tokens held in ``blocks``, shaped
        ``[1, kv_heads, tokens, head_dim]`` (fresh tensors: the blocks may be freed afterwards)."""
        slots = self._slots(blocks, num_tokens)
        out = []
        for pool in self.tensors:
            flat = pool.view(2, -1, *pool.shape[3:])
            k, v = (flat[half].index_select(0, slots).transpose(0, 1).unsqueeze(0).contiguous()
                    for half in (0, 1))
            out.append((k, v))
        return out
