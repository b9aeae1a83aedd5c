"""The memory registry: user tensors -> checked, deduplicated, registered regions (layer: memory; imports backend.base, layout.spec, types, errors, numpy; never torch, cupy or nixl).

``MemoryRegistry.register(spec, tensors)`` accepts what an engine holds:

* split storage: one ``[2, blocks, <block>]`` tensor per layer (K half then V half), or a
  ``(K, V)`` pair of ``[blocks, <block>]`` tensors per layer (MLA: one ``[blocks, <block>]``);
* packed storage: one ``[blocks, 2, <block>]`` tensor per layer;
* cross-layer storage: one ``[blocks, layers, kv, <block>]`` tensor;

as a list, a tuple or a mapping (values in order, e.g. vLLM's ``{layer_name: tensor}``), of
torch / numpy / cupy arrays or anything ``kvxfer.memory.tensors.describe`` understands. Only the
element size and the total bytes must match ``spec.tensor_shapes()`` (engines view the same
memory with different shapes); memory must be dense and on one device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from kvxfer.backend.base import Backend
from kvxfer.errors import ClosedError, RegistrationError
from kvxfer.layout.spec import CacheGeometry, KVSpec, Storage
from kvxfer.memory.prefault import prefault
from kvxfer.memory.tensors import TensorInfo, describe
from kvxfer.types import MemKind, Region

__all__ = ["MemoryRegistry", "merge_spans"]


def merge_spans(regions: Sequence[Region]) -> list[Region]:
    """Merge regions that overlap (same device and kind) into one region each.

    Regions that only touch stay separate: one VRAM registration must not straddle two
    allocations, and touching tensors may come from different allocations.
    """
    out: list[Region] = []
    for r in sorted(regions, key=lambda r: (r.kind.value, r.device, r.addr)):
        last = out[-1] if out else None
        if last is not None and (last.kind, last.device) == (r.kind, r.device) and r.addr < last.end:
            out[-1] = Region(last.addr, max(last.end, r.end) - last.addr, last.device, last.kind)
        else:
            out.append(r)
    return out


def _items(spec: KVSpec, tensors: Any) -> list[Any]:
    if isinstance(tensors, Mapping):
        items = list(tensors.values())
    elif isinstance(tensors, list) or (isinstance(tensors, tuple) and not _is_pair(spec, tensors)):
        items = list(tensors)
    else:
        items = [tensors]
    want = len(spec.tensor_shapes())
    if len(items) != want:
        what = "one cross-layer tensor" if spec.storage is Storage.CROSS_LAYER else "one entry per layer"
        raise RegistrationError(f"expected {want} tensor entries ({what}); got {len(items)}")
    return items


def _is_pair(spec: KVSpec, obj: Any) -> bool:
    """A bare (K, V) tuple for a one-layer split cache (rather than a tuple of layers)."""
    return (spec.num_layers == 1 and spec.storage is Storage.SPLIT and spec.kv_count == 2
            and len(obj) == 2 and len(spec.tensor_shapes()) == 1
            and not any(isinstance(x, (list, tuple)) for x in obj))


class MemoryRegistry:
    """Registers KV caches and staging buffers with one backend; deregisters all on ``close``.

    The registry keeps a reference to every object it registered, so the memory stays
    allocated while registered. Not thread-safe: the agent registers from one thread.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._handles: list[object] = []
        self._regions: list[Region] = []
        self._keep: list[Any] = []
        self._closed = False

    @property
    def regions(self) -> tuple[Region, ...]:
        """Every region registered through this registry, in registration order."""
        return tuple(self._regions)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("MemoryRegistry is closed")

    # ---- caches --------------------------------------------------------------------
    def register(self, spec: KVSpec, tensors: Any) -> CacheGeometry:
        """Check ``tensors`` against ``spec``, register their memory, return the geometry.

        Returns:
            ``CacheGeometry`` whose ``bases[layer, kv]`` is the address of block 0 of that region.

        Raises:
            RegistrationError: wrong entry count, element size, byte count or shape (naming expected
                and actual shape/dtype; a flat 1-D view of the right size is accepted), non-contiguous memory (naming the tensor), mixed devices,
                or an object that is not a tensor.
            ClosedError: after ``close``.
        """
        self._check_open()
        shapes = spec.tensor_shapes()
        bases = np.zeros((spec.num_layers, spec.kv_count), dtype=np.uint64)
        infos: list[TensorInfo] = []
        for i, item in enumerate(_items(spec, tensors)):
            label = "cross-layer tensor" if spec.storage is Storage.CROSS_LAYER else f"layer {i}"
            if isinstance(item, (list, tuple)):
                if spec.storage is not Storage.SPLIT or spec.kv_count != 2:
                    raise RegistrationError(
                        f"{label}: (K, V) pairs need split storage with separate K and V; spec has "
                        f"storage={spec.storage.value}, mla={spec.mla}, kv_fused={spec.kv_fused}")
                if len(item) != 2:
                    raise RegistrationError(f"{label}: expected a (K, V) pair; got {len(item)} tensors")
                k = self._check(spec, f"{label} K", item[0], shapes[i][1:])
                v = self._check(spec, f"{label} V", item[1], shapes[i][1:])
                bases[i] = (k.addr, v.addr)
                infos += [k, v]
                continue
            t = self._check(spec, label, item, shapes[i])
            infos.append(t)
            if spec.storage is Storage.CROSS_LAYER:
                bases[:] = CacheGeometry.contiguous(spec, t.addr).bases
            elif spec.storage is Storage.PACKED:
                bases[i] = (t.addr, t.addr + spec.block_bytes)
            elif spec.storage is Storage.HEAD_PACKED:
                bases[i] = (t.addr, t.addr + spec.block_size * spec.vector_bytes)
            elif spec.kv_count == 1:  # MLA or fused: one region per layer
                bases[i, 0] = t.addr
            else:
                bases[i] = (t.addr, t.addr + t.nbytes // 2)
        places = {(t.kind, t.device) for t in infos}
        if len(places) != 1:
            raise RegistrationError(
                f"expected every tensor on one device; got {sorted((k.value, d) for k, d in places)}")
        kind, device = places.pop()
        self._add([Region(t.addr, t.nbytes, t.device, t.kind) for t in infos])
        self._keep.append(tensors)
        return CacheGeometry(bases, device, kind)

    @staticmethod
    def _check(spec: KVSpec, label: str, obj: Any, shape: tuple[int, ...]) -> TensorInfo:
        try:
            t = describe(obj)
        except RegistrationError as exc:
            raise RegistrationError(f"{label}: {exc}") from exc
        want = math.prod(shape) * spec.itemsize
        if t.itemsize != spec.itemsize or t.nbytes != want:
            raise RegistrationError(
                f"{label}: expected {spec.dtype} (itemsize {spec.itemsize}) of shape {shape} "
                f"({want} bytes); got {t.dtype} (itemsize {t.itemsize}) of shape {t.shape} "
                f"({t.nbytes} bytes)")
        if not _same_arrangement(tuple(t.shape), tuple(shape)):
            # Same bytes, another arrangement (say an HND tensor under an NHD spec, or packed under
            # split): every transfer would move the wrong bytes.
            raise RegistrationError(
                f"{label}: expected shape {tuple(shape)} for this spec ({spec.layout.value}, "
                f"{spec.storage.value}); got shape {tuple(t.shape)} (register a tensor of the spec's "
                "shape, or a view of it with trailing dimensions flattened)")
        if not t.contiguous:
            raise RegistrationError(f"{label}: memory must be contiguous; got a strided view of "
                                    f"shape {t.shape} (call .contiguous() / np.ascontiguousarray)")
        if t.addr <= 0:
            raise RegistrationError(f"{label}: expected a valid address; got {t.addr:#x}")
        return t

    # ---- buffers -------------------------------------------------------------------
    def register_buffer(self, buffer: Any) -> Region:
        """Register a staging buffer: a tensor-like object or ``(addr, nbytes, device, kind)``.

        Returns the buffer's own Region (memory already registered is not registered again).

        Raises:
            RegistrationError: not contiguous, empty, or not a tensor / 4-tuple.
            ClosedError: after ``close``.
        """
        self._check_open()
        if isinstance(buffer, tuple):
            if len(buffer) != 4:
                raise RegistrationError(f"expected (addr, nbytes, device, kind); got {len(buffer)} items")
            addr, nbytes, device, kind = buffer
            try:
                region = Region(int(addr), int(nbytes), int(device), MemKind(kind))
            except ValueError as exc:
                raise RegistrationError(f"expected kind 'DRAM' or 'VRAM'; got {kind!r}") from exc
        else:
            t = describe(buffer)
            if not t.contiguous:
                raise RegistrationError(f"staging buffer must be contiguous; got shape {t.shape} strided")
            region = Region(t.addr, t.nbytes, t.device, t.kind)
        if region.addr <= 0 or region.length <= 0:
            raise RegistrationError(f"expected addr > 0 and nbytes > 0; got {region}")
        self._add([region])
        self._keep.append(buffer)
        return region

    def register_regions(self, regions: Sequence[Region], keep: Any) -> None:
        """Register ``regions`` (checked by the caller) and keep ``keep`` alive while registered;
        memory already registered is not registered again."""
        self._check_open()
        self._add(list(regions))
        self._keep.append(keep)

    def _add(self, regions: list[Region]) -> None:
        fresh = [r for r in merge_spans(regions)
                 if not self.contains(r.addr, r.length, r.kind, r.device)]
        if fresh:
            self._handles.append(self._backend.register(fresh))
            self._regions.extend(fresh)
            prefault(fresh)  # fault untouched host pages in now, not in the first read into them

    # ---- queries / lifecycle -------------------------------------------------------
    def contains(self, addr: int, length: int, kind: MemKind | None = None,
                 device: int | None = None) -> bool:
        """True when ``[addr, addr + length)`` lies inside one registered region
        (optionally of that kind and device)."""
        return any(r.addr <= addr and addr + length <= r.end
                   and (kind is None or r.kind is MemKind(kind))
                   and (device is None or r.device == device) for r in self._regions)

    def close(self) -> None:
        """Deregister everything. Idempotent. A backend closed first has already dropped its
        registrations, so its ClosedError is not an error here; other failures do not stop the
        rest from being deregistered, and the first is raised at the end."""
        if self._closed:
            return
        self._closed = True
        handles, self._handles = self._handles, []
        self._regions.clear()
        self._keep.clear()
        first: Exception | None = None
        for h in handles:
            try:
                self._backend.deregister(h)
            except ClosedError:
                pass
            except Exception as exc:  # keep going: every other handle must still be released
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "MemoryRegistry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_arrangement(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """``got`` is ``want`` with its trailing dimensions flattened (from none to all): a view an
    engine may register for the spec's layout. A 1-D view is taken as the layout, flattened."""
    if len(got) <= 1:
        return True
    k = len(got) - 1
    return got[:k] == want[:k] and got[k] == math.prod(want[k:])
