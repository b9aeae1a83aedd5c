"""CUDA IPC for same-host peers: export a cache's memory as handles, map a peer's, read it in one pass (layer: gpu; cupy and libcuda lazily, never nixl/zmq).

The producer sends ``export_cache(...)`` (plain bytes and ints; the engine carries them in the
handshake); the consumer's ``IpcPeerCache`` maps each allocation once and yields a
``CacheGeometry`` whose addresses are valid in the consumer, so ``direct_pairs`` plus one
``PairKernel`` launch reads the peer's fragmented blocks (slicing heads and permuting layouts
on the way) straight into the local cache: no staging, no NIXL descriptors.

Contract: the producer keeps the exported memory allocated until every consumer has closed its
mapping (the lease protocol's job); reads must start only after the producer says the blocks
are written. Handles are 64-byte CUDA IPC handles; offsets locate each region inside its
allocation, because frameworks sub-allocate from larger ``cudaMalloc`` blocks.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import ConfigError, RegistrationError
from kvxfer.layout.spec import CacheGeometry
from kvxfer.types import MemKind

__all__ = ["IpcExport", "export_cache", "IpcPeerCache", "allocation_range", "host_identity"]

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


@dataclass(frozen=True)
class IpcExport:
    """What a producer sends a same-host consumer: one handle per allocation, and for every
    region ``(layer, kv)`` the allocation it lies in and its offset there."""

    device: int
    handles: tuple[bytes, ...]
    alloc_index: np.ndarray  # int64 [layers, kv]
    offsets: np.ndarray      # uint64 [layers, kv]
    host_id: str = ""

    def to_wire(self) -> dict:
        return {"device": self.device, "handles": list(self.handles), "host_id": self.host_id,
                "alloc_index": self.alloc_index.tolist(), "offsets": self.offsets.tolist()}

    @classmethod
    def from_wire(cls, raw: dict) -> "IpcExport":
        try:
            handles = tuple(bytes(h) for h in raw["handles"])
            idx = np.asarray(raw["alloc_index"], dtype=np.int64)
            off = np.asarray(raw["offsets"], dtype=np.uint64)
            device = int(raw["device"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed IPC export: {exc}") from None
        if idx.shape != off.shape or idx.ndim != 2 or any(len(h) != 64 for h in handles):
            raise ConfigError(f"IPC export: expected matching 2-D index/offset tables and 64-byte "
                              f"handles; got {idx.shape}, {off.shape}, {[len(h) for h in handles]}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(handles)):
            raise ConfigError(f"IPC export: allocation index out of [0, {len(handles)})")
        return cls(device, handles, idx, off, str(raw.get("host_id", "")))


def host_identity() -> str:
    """This machine's identity for "is the peer on my host?": kernel boot id + hostname.

    Two processes agree exactly when they run under one kernel boot on one host (containers
    sharing a host see the same boot id; the hostname separates look-alike VMs). CUDA IPC is
    still only attempted, never assumed: a mapping that fails falls back to another path.
    """
    import socket  # noqa: PLC0415

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{socket.gethostname()}"[:512]


def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise ConfigError(f"CUDA IPC needs the CUDA driver (libcuda.so.1): {exc}") from None


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation holding ``ptr`` (cuMemGetAddressRange).

    The pointer's device context must be current (any torch or cupy call on it makes it so).
    """
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RegistrationError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}; "
                                "expected a device pointer of the current context")
    return int(base.value), int(size.value)


def export_cache(geom: CacheGeometry, host_id: str = "") -> IpcExport:
    """IPC handles for a device cache described by ``geom`` (one per distinct allocation).

    Raises ConfigError for host memory, RegistrationError when CUDA refuses a handle
    (e.g. memory from an allocator that does not support IPC, such as expandable segments).
    """
    if geom.kind is not MemKind.VRAM:
        raise ConfigError(f"CUDA IPC exports device memory; got a {geom.kind.value} cache")
    cp = _cupy()
    bases: dict[int, int] = {}
    handles: list[bytes] = []
    idx = np.zeros(geom.bases.shape, dtype=np.int64)
    off = np.zeros(geom.bases.shape, dtype=np.uint64)
    with cp.cuda.Device(geom.device):
        for pos, addr in np.ndenumerate(geom.bases):
            base, _ = allocation_range(int(addr))
            if base not in bases:
                try:
                    handles.append(bytes(cp.cuda.runtime.ipcGetMemHandle(base)))
                except Exception as exc:  # cupy raises CUDARuntimeError
                    raise RegistrationError(f"cudaIpcGetMemHandle({base:#x}) failed: {exc}") from exc
                bases[base] = len(handles) - 1
            idx[pos] = bases[base]
            off[pos] = int(addr) - base
    return IpcExport(geom.device, tuple(handles), idx, off, host_id)


class IpcPeerCache:
    """A peer's cache mapped into this process on ``device``; ``geometry`` has local addresses.

    Close it (or use ``with``) to unmap; closing twice is harmless.
    """

    def __init__(self, export: IpcExport, device: int) -> None:
        self.cp = _cupy()
        self.device = int(device)
        self._mapped: list[int] = []
        with self.cp.cuda.Device(self.device):
            try:
                for handle in export.handles:
                    self._mapped.append(int(self.cp.cuda.runtime.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS)))
            except Exception as exc:
                self.close()
                raise RegistrationError(f"cudaIpcOpenMemHandle failed (is the peer on this host?): "
                                        f"{exc}") from exc
        starts = np.asarray(self._mapped, dtype=np.uint64)[export.alloc_index]
        self.geometry = CacheGeometry(starts + export.offsets, export.device, MemKind.VRAM)

    def close(self) -> None:
        mapped, self._mapped = self._mapped, []
        with self.cp.cuda.Device(self.device):
            for ptr in mapped:
                self.cp.cuda.runtime.ipcCloseMemHandle(ptr)

    def __enter__(self) -> "IpcPeerCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cupy() -> Any:
    from kvxfer.gpu.ops import _cupy as load  # noqa: PLC0415 - one place reports a missing cupy

    return load()
