"""StateSpec: per-request slots of fixed-size state, such as SSM conv and temporal state (layer: layout, pure; numpy only, no nixl/zmq/torch).

A state group is what state-space and linear-attention layers keep instead of pages: each
request owns one or more *slots*, and a slot of one layer holds one value of every state
tensor (for Mamba2: the conv state and the SSM state). Tensors are described by how tensor
parallelism cuts them, so two instances of different TP sizes can be mapped byte for byte.

One rank's slot of one tensor is the array ``[outer, split, inner]`` (row-major), where the
*split axis* holds, for every *segment* ``s`` in order, this rank's units of that segment,
``width_s`` elements each. A segment of ``units`` units is cut over TP ranks exactly as KV heads
are (``tp.head_range``): ``units // tp`` consecutive units per rank when ``tp`` divides
``units``, one unit held by ``tp // units`` consecutive ranks when ``units`` divides ``tp``;
any other pair is refused. Examples (vLLM 0.32's Mamba2, DS conv layout):

* conv state ``(conv_dim, kernel - 1)``: segments ``x`` = ``(num_heads, head_dim)``,
  ``B`` = ``C`` = ``(n_groups, d_state)``; ``outer`` 1, ``inner`` ``kernel - 1``
  (the SD layout ``(kernel - 1, conv_dim)`` is ``outer`` ``kernel - 1``, ``inner`` 1);
* SSM state ``(num_heads, head_dim, d_state)``: one segment ``(num_heads, 1)``, ``inner``
  ``head_dim * d_state``;
* state every rank holds whole: one segment of 1 unit (replicated on every rank);
* state whose TP cut kvxfer cannot know: ``StateTensor.opaque``; it moves only between ranks
  of equal TP size, rank to rank.

Slots sit ``slot_stride`` bytes apart. ``StateSpec.slot_stride`` 0: every tensor is its own
array (stride = that tensor's slot bytes); > 0: the tensors of a layer share one page per slot
(vLLM keeps conv then SSM state in one page, padded to the attention page size), each tensor at
its own base inside the page.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.layout.spec import DTYPE_SIZES, CacheGeometry
from kvxfer.layout.tp import head_range
from kvxfer.types import MemKind

__all__ = ["StateSpec", "StateTensor", "StateView"]


def _count(name: str, value, low: int = 1) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise LayoutError(f"{name} must be an integer >= {low}; got {value!r}")
    return value


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a layer, as the *model* (all ranks) has it.

    Args:
        name: what it is ("conv", "ssm", ...): errors and group matching name it.
        dtype: element type, one of ``DTYPE_SIZES``.
        segments: ``((units, width), ...)`` along the split axis, global counts; None for an
            opaque tensor (use ``StateTensor.opaque``).
        outer, inner: elements before and after the split axis (see the module docstring).
        opaque_elements: elements of one rank's slot of an opaque tensor (else 0).

    Raises:
        LayoutError: an empty name, an unknown dtype, no segments, a non-positive count.
    """

    name: str
    dtype: str
    segments: tuple[tuple[int, int], ...] | None
    outer: int = 1
    inner: int = 1
    opaque_elements: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"a state tensor needs a non-empty name; got {self.name!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"state tensor {self.name!r}: dtype must be one of {sorted(DTYPE_SIZES)}; "
                              f"got {self.dtype!r}")
        object.__setattr__(self, "outer", _count(f"state tensor {self.name!r} outer", self.outer))
        object.__setattr__(self, "inner", _count(f"state tensor {self.name!r} inner", self.inner))
        if self.segments is None:
            object.__setattr__(self, "opaque_elements",
                               _count(f"opaque state tensor {self.name!r} elements", self.opaque_elements))
            return
        if self.opaque_elements:
            raise LayoutError(f"state tensor {self.name!r} has segments: opaque_elements must be 0; "
                              f"got {self.opaque_elements!r}")
        try:
            segs = tuple((units, width) for units, width in self.segments)
        except (TypeError, ValueError):
            raise LayoutError(f"state tensor {self.name!r}: segments must be (units, width) pairs; "
                              f"got {self.segments!r}") from None
        if not segs:
            raise LayoutError(f"state tensor {self.name!r} needs at least one segment")
        object.__setattr__(self, "segments", tuple(
            (_count(f"state tensor {self.name!r} segment {i} units", u),
             _count(f"state tensor {self.name!r} segment {i} width", w)) for i, (u, w) in enumerate(segs)))

    @classmethod
    def opaque(cls, name: str, dtype: str, elements: int) -> "StateTensor":
        """A tensor of ``elements`` per rank and slot whose TP cut is unknown: it moves only
        between ranks of equal TP size, rank ``r`` to rank ``r``."""
        return cls(name, dtype, None, opaque_elements=elements)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def check_tp(self, tp_size: int) -> None:
        """LayoutError unless every segment's units and ``tp_size`` divide one another."""
        for i, (units, _) in enumerate(self.segments or ()):
            if units % tp_size and tp_size % units:
                raise LayoutError(f"state tensor {self.name!r} segment {i}: units ({units}) and tp_size "
                                  f"({tp_size}) must divide one another")

    def local_units(self, tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
        """Global unit range ``[start, stop)`` of every segment that rank ``tp_rank`` holds."""
        return [head_range(units, tp_size, tp_rank) for units, _ in self.segments or ()]

    def split_elements(self, tp_size: int) -> int:
        """Elements of one rank's split axis (equal on every rank)."""
        return sum(max(1, units // tp_size) * width for units, width in self.segments or ())

    def slot_bytes(self, tp_size: int) -> int:
        """Bytes of one rank's slot of this tensor."""
        if self.segments is None:
            return self.opaque_elements * self.itemsize
        return self.outer * self.split_elements(tp_size) * self.inner * self.itemsize


@dataclass(frozen=True)
class StateSpec:
    """The shape of one tensor-parallel rank's state group.

    Args:
        num_layers: layers in the group (each keeps one slot of every tensor per request slot).
        tensors: the state tensors of one layer, in page order.
        num_slots: slots in this rank's cache (vLLM: the group's blocks).
        slot_stride: 0, every tensor its own array; else bytes between slot ``s`` and ``s + 1``
            of every tensor (one page per slot holding every tensor), at least their sum.
        tp_rank, tp_size, model: as ``KVSpec``'s.

    Raises:
        LayoutError: any inconsistent value (names it); a segment whose units and ``tp_size``
            do not divide one another (names both).
    """

    num_layers: int
    tensors: tuple[StateTensor, ...]
    num_slots: int
    slot_stride: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "tp_size"):
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        object.__setattr__(self, "slot_stride", _count("slot_stride", self.slot_stride, 0))
        object.__setattr__(self, "tp_rank", _count("tp_rank", self.tp_rank, 0))
        if self.tp_rank >= self.tp_size:
            raise LayoutError(f"tp_rank must be in [0, {self.tp_size}); got {self.tp_rank}")
        if not isinstance(self.model, str):
            raise LayoutError(f"model must be a str (the model's name, or empty); got {self.model!r}")
        tensors = tuple(self.tensors) if isinstance(self.tensors, (list, tuple)) else None
        if not tensors or not all(isinstance(t, StateTensor) for t in tensors):
            raise LayoutError(f"tensors must be a non-empty sequence of StateTensor; got {self.tensors!r}")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise LayoutError(f"state tensor names must be distinct; got {names}")
        object.__setattr__(self, "tensors", tensors)
        for t in tensors:
            t.check_tp(self.tp_size)
        page = sum(self.tensor_bytes)
        if self.slot_stride and self.slot_stride < page:
            raise LayoutError(f"slot_stride ({self.slot_stride}) must hold every tensor of a slot "
                              f"({page} bytes) or be 0")

    @property
    def tensor_bytes(self) -> list[int]:
        """Bytes of one slot of every tensor, on this rank."""
        return [t.slot_bytes(self.tp_size) for t in self.tensors]

    @property
    def strides(self) -> list[int]:
        """Bytes between slot ``s`` and ``s + 1`` of every tensor."""
        return [self.slot_stride or b for b in self.tensor_bytes]

    @property
    def cache_bytes(self) -> int:
        """Bytes of every slot of every tensor of every layer (padding of shared pages included)."""
        per_slot = self.slot_stride or sum(self.tensor_bytes)
        return self.num_layers * self.num_slots * per_slot

    def with_rank(self, tp_rank: int) -> "StateSpec":
        """The same spec for another rank of the same instance."""
        return replace(self, tp_rank=tp_rank)

    def tensor_shapes(self) -> list[tuple[int, ...]]:
        """Shape ``[num_slots, outer, split, inner]`` (opaque: ``[num_slots, elements]``) of one
        layer's array of every tensor, in elements of its own dtype."""
        return [(self.num_slots, t.opaque_elements) if t.segments is None else
                (self.num_slots, t.outer, t.split_elements(self.tp_size), t.inner) for t in self.tensors]


def contiguous_state(spec: StateSpec, base: int, device: int = 0, kind: MemKind = MemKind.DRAM) -> CacheGeometry:
    """Bases ``[layers, tensors]`` of a state cache in one allocation at ``base``: layer by layer,
    each layer one page per slot (``slot_stride`` > 0) or one array per tensor."""
    sizes = spec.tensor_bytes
    bases = np.zeros((spec.num_layers, len(sizes)), dtype=np.uint64)
    layer_bytes = spec.cache_bytes // spec.num_layers
    for layer in range(spec.num_layers):
        pos = base + layer * layer_bytes
        for t, size in enumerate(sizes):
            bases[layer, t] = pos
            pos += size if spec.slot_stride else size * spec.num_slots
    return CacheGeometry(bases, device, kind)


@dataclass(frozen=True)
class StateView:
    """One rank's state group: its ``spec`` and where it lives (``geometry.bases[layer, tensor]``,
    the address of slot 0 of that tensor in the owner's process)."""

    spec: StateSpec
    geometry: CacheGeometry = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, StateSpec):
            raise LayoutError(f"StateView.spec must be a StateSpec; got {type(self.spec).__name__}")
        if not isinstance(self.geometry, CacheGeometry):
            raise LayoutError(f"StateView.geometry must be a CacheGeometry; got {type(self.geometry).__name__}")
        want = (self.spec.num_layers, len(self.spec.tensors))
        if self.geometry.bases.shape != want:
            raise LayoutError(f"state geometry has {self.geometry.bases.shape} bases; spec expects {want} "
                              f"(layers, tensors)")

