"""Per-request state slots of a hybrid model's SSM / linear-attention layers (layer: adapter; torch and kvxfer's public API only, no transformers).

transformers keeps such a layer's cache as a few fixed-size tensors per sequence (Mamba2: the
conv state ``[conv_dim, kernel]`` and the SSM state ``[heads, head_dim, d_state]``); a slot
keeps them in vLLM's form (Mamba2: ``[kernel - 1, conv_dim]`` and ``[heads, head_dim, d_state]``;
``kvxfer_transformers.caches`` converts). Here each state layer owns one tensor
``[num_slots, *shape]`` per state tensor; a request owns one slot (the same index in every
layer), registered with kvxfer as a ``StateGroup``. kvxfer-hf runs TP 1, so every tensor is
described ``StateTensor.opaque``: it moves whole, slot to slot, between instances of one TP size
(another kvxfer-hf, or vLLM's KvxferConnector at TP 1: a tensor's name carries its slot shape,
so the handshake pairs only equal shapes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from kvxfer import LayoutError, StateSpec, StateTensor

from kvxfer_transformers.pool import PoolExhausted, dtype_name


@dataclass(frozen=True)
class StateShape:
    """One state tensor of a layer for one sequence: its name, shape (no batch axis) and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class StateSlots:
    """``num_slots`` slots of every state tensor of ``num_layers`` layers, plus a free list.

    ``tensors[layer][i]`` is ``[num_slots, *shapes[i].shape]``; ``spec(model)`` the ``StateSpec``
    that describes them.
    """

    def __init__(self, num_layers: int, shapes: Sequence[StateShape], *, num_slots: int,
                 device: torch.device | str) -> None:
        if not shapes:
            raise LayoutError("a state group needs at least one state tensor")
        self.shapes = tuple(shapes)
        self.num_slots = num_slots
        self.tensors = [[torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=device) for s in self.shapes]
                        for _ in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))
        self._freed = threading.Condition()

    def spec(self, model: str) -> StateSpec:
        tensors = tuple(StateTensor.opaque(s.name, dtype_name(s.dtype), s.elements) for s in self.shapes)
        return StateSpec(num_layers=len(self.tensors), tensors=tensors, num_slots=self.num_slots, model=model)

    def allocate(self, count: int, timeout: float = 0.0) -> list[int]:
        """``count`` free slots, waiting up to ``timeout`` seconds. Raises PoolExhausted."""
        deadline = time.monotonic() + timeout
        with self._freed:
            while len(self._free) < count:
                left = deadline - time.monotonic()
                if count > self.num_slots or left <= 0:
                    raise PoolExhausted(f"wanted {count} state slots; {len(self._free)} of {self.num_slots} free")
                self._freed.wait(left)
            return [self._free.pop() for _ in range(count)]

    def free(self, slots: Sequence[int]) -> None:
        with self._freed:
            self._free.extend(int(s) for s in slots)
            self._freed.notify_all()

    @property
    def free_slots(self) -> int:
        with self._freed:
            return len(self._free)

    def store(self, layers: Sequence[Sequence[torch.Tensor]], slot: int) -> None:
        """Copy each layer's state tensors (slot shapes with a batch axis of 1; views are fine) into ``slot``."""
        if len(layers) != len(self.tensors):
            raise LayoutError(f"expected the state of {len(self.tensors)} layers; got {len(layers)}")
        for mine, theirs in zip(self.tensors, layers):
            if len(theirs) != len(mine):
                raise LayoutError(f"expected {len(mine)} state tensors a layer; got {len(theirs)}")
            for t, x in zip(mine, theirs):
                t[slot].copy_(x[0])

    def load(self, slot: int) -> list[list[torch.Tensor]]:
        """Each layer's state tensors in ``slot`` with a batch axis of 1 (copies: the slot may be freed)."""
        return [[t[slot].unsqueeze(0).clone() for t in layer] for layer in self.tensors]
