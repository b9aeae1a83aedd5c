"""A hybrid cache on the wire: ``PeerInfo.hybrid`` (layer: protocol; never nixl, torch or the agent).

An agent whose cache is a ``HybridSpec`` announces, besides its carrier spec
(``kvxfer.layout.carrier``), every group: kind, name, window, spec, and bases (addresses in
its own process). ``hybrid_to_wire`` encodes that; ``hybrid_from_wire`` rebuilds and re-checks
it from peer input: a malformed value is a ``ProtocolError``, never another exception.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from kvxfer.errors import LayoutError, ProtocolError
from kvxfer.layout.carrier import HybridCarrier, carrier_for, carrier_geometry
from kvxfer.layout.groups import AttentionGroup, HybridSpec, HybridView, StateGroup
from kvxfer.layout.spec import CacheGeometry
from kvxfer.layout.state import StateSpec, StateTensor
from kvxfer.types import MemKind

__all__ = ["MAX_HYBRID_BYTES", "hybrid_from_wire", "hybrid_to_wire"]

#: The largest ``PeerInfo.hybrid`` a peer may send.
MAX_HYBRID_BYTES = 4 << 20

_Name = Annotated[str, Meta(max_length=256)]
_Count = Annotated[int, Meta(ge=0, le=(1 << 62))]
_Row = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=4096)]


class _TensorWire(msgspec.Struct, frozen=True):
    name: _Name
    dtype: _Name
    segments: Annotated[list[tuple[_Count, _Count]], Meta(max_length=64)] | None
    outer: _Count = 1
    inner: _Count = 1
    opaque_elements: _Count = 0


class _GroupWire(msgspec.Struct, frozen=True):
    kind: _Name                      # "attention" or "state"
    name: _Name
    bases: Annotated[list[_Row], Meta(max_length=4096)]
    window: _Count = 0               # attention: sliding window tokens (0: full)
    spec: dict | None = None         # attention: the KVSpec's SpecWire fields
    num_layers: _Count = 0           # state: StateSpec's fields
    tensors: Annotated[list[_TensorWire], Meta(max_length=64)] = []
    num_slots: _Count = 0
    slot_stride: _Count = 0


class _HybridWire(msgspec.Struct, frozen=True):
    groups: Annotated[list[_GroupWire], Meta(max_length=64)]


_DECODER = msgspec.msgpack.Decoder(_HybridWire)


def hybrid_to_wire(view: HybridView) -> bytes:
    """``PeerInfo.hybrid`` for this agent's cache ``view``."""
    from kvxfer.protocol.messages import spec_to_wire

    groups = []
    for g, geo in zip(view.spec.groups, view.geometries):
        bases = geo.bases.tolist()
        if isinstance(g, AttentionGroup):
            groups.append(_GroupWire("attention", g.name, bases, window=g.sliding_window,
                                     spec=msgspec.structs.asdict(spec_to_wire(g.spec))))
        else:
            s = g.spec
            groups.append(_GroupWire(
                "state", g.name, bases, num_layers=s.num_layers, num_slots=s.num_slots, slot_stride=s.slot_stride,
                tensors=[_TensorWire(t.name, t.dtype, None if t.segments is None else [tuple(x) for x in t.segments],
                                     t.outer, t.inner, t.opaque_elements) for t in s.tensors]))
    return msgspec.msgpack.encode(_HybridWire(groups))


def hybrid_from_wire(data: bytes, carrier, device: int, kind: MemKind) -> tuple[HybridCarrier, CacheGeometry]:
    """A peer's carrier spec and geometry, rebuilt from ``PeerInfo.hybrid`` and checked against
    the carrier spec it sent (``carrier``: TP rank and size, model).

    Raises:
        ProtocolError: malformed, or a carrier that does not match the groups (names both values).
    """
    from kvxfer.protocol.messages import SpecWire, spec_from_wire

    try:
        wire = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"peer's hybrid cache description is malformed: {exc}") from None
    try:
        groups, geos = [], []
        for i, g in enumerate(wire.groups):
            rows = g.bases
            if len({len(r) for r in rows}) > 1 or not rows:
                raise ProtocolError(f"peer's hybrid group {i}: bases must be a non-empty rectangle")
            geo = CacheGeometry(np.asarray(rows, dtype=np.uint64), device, kind)
            if g.kind == "attention":
                if g.spec is None:
                    raise ProtocolError(f"peer's hybrid group {i}: an attention group without a spec")
                spec = spec_from_wire(msgspec.convert(g.spec, SpecWire))
                groups.append(AttentionGroup(spec, g.window, g.name))
            elif g.kind == "state":
                tensors = tuple(StateTensor(t.name, t.dtype, None if t.segments is None else tuple(t.segments),
                                            t.outer, t.inner, t.opaque_elements) for t in g.tensors)
                groups.append(StateGroup(StateSpec(g.num_layers, tensors, g.num_slots, g.slot_stride,
                                                   carrier.tp_rank, carrier.tp_size, _model(carrier)), g.name))
            else:
                raise ProtocolError(f"peer's hybrid group {i}: kind {g.kind!r} is not one this side knows "
                                    f"('attention', 'state')")
            geos.append(geo)
        view = HybridView(HybridSpec(tuple(groups)), tuple(geos))
        spec = carrier_for(view.spec)
    except (LayoutError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"peer's hybrid cache description is invalid: {exc}") from None
    for name in ("tp_rank", "tp_size", "num_blocks", "model"):
        if getattr(spec, name) != getattr(carrier, name):
            raise ProtocolError(f"peer's hybrid cache and its spec disagree on {name}: the groups give "
                                f"{getattr(spec, name)!r}; the spec has {getattr(carrier, name)!r}")
    return spec, carrier_geometry(view)


def _model(carrier) -> str:
    """The model name of the groups (the carrier's name before its hybrid suffix)."""
    return carrier.model.rsplit("#hybrid-", 1)[0]
