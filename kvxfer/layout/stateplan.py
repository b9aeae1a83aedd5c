"""StatePlan: byte ranges moving request slots of a state group between two ranks (layer: layout, pure; numpy only, no nixl/zmq/torch).

``build_state_plan`` runs once per (local rank, remote rank) pair. For every tensor it takes,
segment by segment, the units both ranks hold that the *consumer* reads from this producer
(``tp.unit_read_ranks``: one replica per unit range, so a replicated segment moves once), and
turns each into one contiguous run per ``outer`` row on both sides: a slot's piece template.
``StatePlan.for_request`` broadcasts that template over layers and slot pairs, vectorised, and
coalesces rows that continue each other on both sides (a slot moved whole is one row per
layer, or one per page when every tensor of the page moves whole).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.layout.request import RequestPlan, check_block_ids, merge_rows
from kvxfer.layout.state import StateSpec, StateTensor, StateView
from kvxfer.layout.tp import unit_read_ranks
from kvxfer.types import TransferPath

__all__ = ["StatePlan", "build_state_plan", "check_state_compatible"]

_U64 = np.uint64


def _form(t: StateTensor) -> tuple:
    return (t.dtype, t.segments, t.outer, t.inner, t.opaque_elements)


def check_state_compatible(a: StateSpec, b: StateSpec) -> None:
    """LayoutError unless the two specs describe the same model state (names what differs, both values)."""
    for name in ("model", "num_layers"):
        if getattr(a, name) != getattr(b, name):
            raise LayoutError(f"{name} differs: local has {getattr(a, name)!r}; remote has {getattr(b, name)!r}")
    la, lb = [t.name for t in a.tensors], [t.name for t in b.tensors]
    if la != lb:
        raise LayoutError(f"state tensors differ: local has {la}; remote has {lb}")
    for x, y in zip(a.tensors, b.tensors):
        if _form(x) != _form(y):
            raise LayoutError(f"state tensor {x.name!r} differs: local has (dtype, segments, outer, inner, "
                              f"opaque_elements) {_form(x)}; remote has {_form(y)}")


def _pieces(t: StateTensor, consumer: StateSpec, producer: StateSpec, local_is_consumer: bool) -> list[tuple[int, int, int]]:
    """``(local offset, remote offset, length)`` in bytes of one slot of ``t`` moved between the pair."""
    if t.segments is None:
        if consumer.tp_size != producer.tp_size:
            raise LayoutError(f"state tensor {t.name!r} has no described TP split: it moves only between equal "
                              f"TP sizes; consumer tp_size {consumer.tp_size}, producer tp_size {producer.tp_size}")
        n = t.slot_bytes(consumer.tp_size)
        return [(0, 0, n)] if consumer.tp_rank == producer.tp_rank else []
    isz, pieces = t.itemsize, []
    c_units, p_units = t.local_units(consumer.tp_size, consumer.tp_rank), t.local_units(producer.tp_size, producer.tp_rank)
    c_split, p_split = t.split_elements(consumer.tp_size), t.split_elements(producer.tp_size)
    c_seg = p_seg = 0   # offset of the segment on each side's split axis (elements)
    for (units, width), (c0, c1), (p0, p1) in zip(t.segments, c_units, p_units):
        lo, hi = max(c0, p0), min(c1, p1)
        if lo < hi and producer.tp_rank in unit_read_ranks(units, consumer.tp_size, consumer.tp_rank, producer.tp_size):
            for o in range(t.outer):
                c_off = ((o * c_split + c_seg + (lo - c0) * width) * t.inner) * isz
                p_off = ((o * p_split + p_seg + (lo - p0) * width) * t.inner) * isz
                length = (hi - lo) * width * t.inner * isz
                pieces.append((c_off, p_off, length) if local_is_consumer else (p_off, c_off, length))
        c_seg += (c1 - c0) * width
        p_seg += (p1 - p0) * width
    return sorted(pieces)   # the local side's memory order: rows that continue each other merge


class StatePlan:
    """Byte-range correspondence of request slots between a local and a remote rank's state group.

    Attributes: ``local``, ``remote`` (StateViews), ``mode`` (``TransferPath.DIRECT``: state pieces are runs
    on both sides, never staged), ``reversible`` (True), ``pieces_per_slot`` (descriptors per
    layer and slot before coalescing; 0 when this pair moves nothing of the group).
    """

    mode = TransferPath.DIRECT
    reversible = True
    over_read = False

    def __init__(self, local: StateView, remote: StateView, template: np.ndarray) -> None:
        self.local, self.remote = local, remote
        self._t = template   # int64 [P, 4]: tensor, local offset, remote offset, length
        self.pieces_per_slot = int(template.shape[0])
        self.num_bytes_per_slot = int(template[:, 3].sum()) * local.spec.num_layers

    def __repr__(self) -> str:
        ls, rs = self.local.spec, self.remote.spec
        return (f"StatePlan(local=tp{ls.tp_rank}of{ls.tp_size}, remote=tp{rs.tp_rank}of{rs.tp_size}, "
                f"pieces_per_slot={self.pieces_per_slot})")

    @property
    def empty(self) -> bool:
        """This pair moves nothing of the group (the consumer reads it all from other ranks)."""
        return self.pieces_per_slot == 0

    def for_request(self, local_slots: Sequence[int] | np.ndarray, remote_slots: Sequence[int] | np.ndarray) -> RequestPlan:
        """Descriptors moving slot ``local_slots[i]`` <-> ``remote_slots[i]`` for every layer.

        Raises:
            BlockIdError: unequal slot counts (names both), a slot outside ``[0, num_slots)`` or repeated.
        """
        ls, rs = self.local.spec, self.remote.spec
        lsl = check_block_ids("local (state slots)", local_slots, ls.num_slots)
        rsl = check_block_ids("remote (state slots)", remote_slots, rs.num_slots)
        if lsl.size != rsl.size:
            raise BlockIdError(f"local and remote state slot lists must be as long as each other; "
                               f"local has {lsl.size}, remote has {rsl.size}")
        t = self._t
        if lsl.size == 0 or t.shape[0] == 0:
            empty = np.zeros((0, 3), dtype=_U64)
            return RequestPlan(local=empty, remote=empty.copy(), staging_bytes=0, num_bytes=0)
        tensor = t[:, 0]
        l_stride = np.asarray(ls.strides, dtype=_U64)[tensor]
        r_stride = np.asarray(rs.strides, dtype=_U64)[tensor]
        shape = (ls.num_layers, lsl.size, t.shape[0])
        both = np.empty((2, *shape, 3), dtype=_U64)
        loc, rem = both[0], both[1]
        lb, rb = self.local.geometry.bases[:, tensor], self.remote.geometry.bases[:, tensor]   # [layers, P]
        loc[..., 0] = (lb[:, None, :] + lsl.astype(_U64)[None, :, None] * l_stride + t[:, 1].astype(_U64))
        rem[..., 0] = (rb[:, None, :] + rsl.astype(_U64)[None, :, None] * r_stride + t[:, 2].astype(_U64))
        loc[..., 1] = t[:, 3].astype(_U64)
        rem[..., 1] = t[:, 3].astype(_U64)
        loc[..., 2] = self.local.geometry.device
        rem[..., 2] = self.remote.geometry.device
        total = int(t[:, 3].sum()) * shape[0] * shape[1]
        loc, rem = merge_rows(loc.reshape(-1, 3), rem.reshape(-1, 3))
        return RequestPlan(local=loc, remote=rem, staging_bytes=0, num_bytes=total)


def build_state_plan(local: StateView, remote: StateView, *, local_is_consumer: bool = True) -> StatePlan:
    """Plan moving the state ``local`` and ``remote`` exchange, for any request's slots.

    ``local_is_consumer`` (a READ; False for a WRITE from ``local``) says which side reads:
    a segment held by several producer replicas moves from the one the consumer picks
    (``tp.unit_read_ranks``). Direction-agnostic otherwise, like ``build_plan``.

    Raises:
        LayoutError: the specs differ (names the field or tensor and both values); an opaque
            tensor between different TP sizes (names both).
    """
    for name, view in (("local", local), ("remote", remote)):
        if not isinstance(view, StateView):
            raise LayoutError(f"{name} must be a StateView; got {type(view).__name__}")
    ls, rs = local.spec, remote.spec
    check_state_compatible(ls, rs)
    consumer, producer = (ls, rs) if local_is_consumer else (rs, ls)
    rows = [(i, *p) for i, t in enumerate(ls.tensors) for p in _pieces(t, consumer, producer, local_is_consumer)]
    template = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return StatePlan(local, remote, template)
