"""Registering a hybrid cache: every group's tensors (layer: memory; imports layout, types, errors, numpy; never torch, cupy or nixl).

``register_hybrid(registry, spec, tensors)`` takes one entry per group, in group order:

* an attention group: what ``MemoryRegistry.register`` takes for that group's ``KVSpec``;
* a state group: one entry per layer: a list of one array per state tensor (shapes
  ``StateSpec.tensor_shapes()``, or any view of the same bytes) when ``slot_stride`` is 0, else
  one array of ``num_slots * slot_stride`` bytes (one page per slot, tensors in page order).

Groups may share memory (vLLM's attention groups and the pages of its state layers do): memory
already registered is not registered again. Every entry is checked before anything is
registered but the attention groups, which ``MemoryRegistry.register`` checks and registers one
by one (a later group's bad entry raises; what was registered stays until the agent closes, and
the agent has no cache: ``register`` may be called again).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.errors import LayoutError, RegistrationError
from kvxfer.layout.carrier import HybridGeometry, carrier_geometry
from kvxfer.layout.groups import AttentionGroup, HybridSpec, HybridView
from kvxfer.layout.spec import CacheGeometry
from kvxfer.memory.tensors import TensorInfo, describe
from kvxfer.types import Region

__all__ = ["register_hybrid"]


def _state_layer(label: str, spec, layer: int, item: Any) -> tuple[list[int], list[TensorInfo]]:
    """One state layer's tensor bases and the tensors holding them."""
    sizes = spec.tensor_bytes
    if spec.slot_stride:
        t = _describe(f"{label} layer {layer}", item)
        want = spec.num_slots * spec.slot_stride
        if t.nbytes != want:
            raise RegistrationError(f"{label} layer {layer}: expected one page array of {spec.num_slots} slots x "
                                    f"{spec.slot_stride} bytes ({want} bytes); got {t.nbytes} bytes, shape {t.shape}")
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        return [t.addr + int(o) for o in offsets], [t]
    if not isinstance(item, (list, tuple)) or len(item) != len(sizes):
        got = len(item) if isinstance(item, (list, tuple)) else type(item).__name__
        raise RegistrationError(f"{label} layer {layer}: expected one array per state tensor "
                                f"({[x.name for x in spec.tensors]}); got {got}")
    infos = []
    for tensor, size, obj in zip(spec.tensors, sizes, item):
        t = _describe(f"{label} layer {layer} {tensor.name!r}", obj)
        want = spec.num_slots * size
        if t.nbytes != want or t.itemsize != tensor.itemsize:
            raise RegistrationError(f"{label} layer {layer} {tensor.name!r}: expected {tensor.dtype} of "
                                    f"{spec.num_slots} slots x {size} bytes ({want} bytes); got {t.dtype} "
                                    f"(itemsize {t.itemsize}), {t.nbytes} bytes, shape {t.shape}")
        infos.append(t)
    return [t.addr for t in infos], infos


def _describe(label: str, obj: Any) -> TensorInfo:
    try:
        t = describe(obj)
    except RegistrationError as exc:
        raise RegistrationError(f"{label}: {exc}") from exc
    if not t.contiguous:
        raise RegistrationError(f"{label}: memory must be contiguous; got a strided view of shape {t.shape}")
    if t.addr <= 0:
        raise RegistrationError(f"{label}: expected a valid address; got {t.addr:#x}")
    return t


def register_hybrid(registry, spec: HybridSpec, tensors: Any) -> HybridGeometry:
    """Check every group's tensors, register their memory once, return the carrier's geometry
    (its ``view``: every group's bases).

    Raises:
        RegistrationError: not one entry per group (names both counts); a group's entry that
            does not match its spec (names the group, the tensor and both sizes); groups on
            different devices (names both).
    """
    if isinstance(tensors, dict):
        tensors = list(tensors.values())
    if not isinstance(tensors, (list, tuple)) or len(tensors) != len(spec.groups):
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise RegistrationError(f"a hybrid cache registers one entry per group: {len(spec.groups)} groups; got {got}")
    geos: list[CacheGeometry] = []
    pending: list[tuple[int, Any]] = []  # attention groups, registered once every entry is checked
    state_infos: list[TensorInfo] = []
    for i, (g, entry) in enumerate(zip(spec.groups, tensors)):
        label = spec.label(i)
        if isinstance(g, AttentionGroup):
            geos.append(None)
            pending.append((i, entry))
            continue
        s = g.spec
        if not isinstance(entry, (list, tuple)) or len(entry) != s.num_layers:
            got = len(entry) if isinstance(entry, (list, tuple)) else type(entry).__name__
            raise RegistrationError(f"{label}: expected one entry per layer ({s.num_layers}); got {got}")
        bases = np.zeros((s.num_layers, len(s.tensors)), dtype=np.uint64)
        for layer, item in enumerate(entry):
            addrs, infos = _state_layer(label, s, layer, item)
            bases[layer] = addrs
            state_infos += infos
        places = {(t.kind, t.device) for t in infos}
        kind, device = places.pop()
        geos.append(CacheGeometry(bases, device, kind))
    for i, entry in pending:  # MemoryRegistry.register checks, then registers (what is registered stays)
        try:
            geos[i] = registry.register(spec.groups[i].spec, entry)
        except RegistrationError as exc:
            raise RegistrationError(f"{spec.label(i)}: {exc}") from exc
    places = {(geo.kind, geo.device) for geo in geos}
    if len(places) != 1:
        raise RegistrationError(f"a hybrid cache's groups must be on one device; got {sorted((k.value, d) for k, d in places)}")
    if state_infos:
        registry.register_regions([Region(t.addr, t.nbytes, t.device, t.kind) for t in state_infos], tensors)
    try:
        view = HybridView(spec, tuple(geos))
    except LayoutError as exc:
        raise RegistrationError(str(exc)) from exc
    return carrier_geometry(view)
