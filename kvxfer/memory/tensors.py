"""Duck-typed facts about tensors and raw host memory (layer: memory; imports types, errors, numpy; never torch, cupy or nixl).

``describe`` reads what kvxfer needs (address, size, element size, shape, device, contiguity)
from anything a user may hold, trying in order:

1. torch-like: ``data_ptr()``, ``element_size()``, ``is_contiguous()``, ``device``;
2. ``__cuda_array_interface__`` (cupy, numba): device memory;
3. ``__array_interface__`` (numpy and friends): host memory;
4. DLPack: ``__dlpack_device__()`` and the ``DLTensor`` inside ``__dlpack__()`` (JAX and others).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, NamedTuple

import numpy as np

from kvxfer.errors import RegistrationError
from kvxfer.types import MemKind

__all__ = ["TensorInfo", "describe", "host_view"]

# DLPack device types (dlpack.h): CPU, CUDA, CUDA pinned host, ROCm, ROCm pinned host, CUDA managed.
_DL_KINDS = {1: MemKind.DRAM, 2: MemKind.VRAM, 3: MemKind.DRAM, 10: MemKind.VRAM,
             11: MemKind.DRAM, 13: MemKind.VRAM}
_DL_FLOAT_NAMES = {(2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16"}


class TensorInfo(NamedTuple):
    """What ``describe`` found. ``nbytes`` counts the elements (not the allocation);
    ``device`` is the GPU ordinal, 0 for host memory; ``dtype`` a readable name for errors."""

    addr: int
    nbytes: int
    itemsize: int
    shape: tuple[int, ...]
    device: int
    kind: MemKind
    contiguous: bool
    dtype: str = "?"


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    """True when ``strides`` (bytes; None means C order) describe dense row-major memory."""
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _from_torch(obj: Any) -> TensorInfo:
    device = obj.device
    dev_type = getattr(device, "type", str(device))
    if dev_type == "cpu":
        kind, ordinal = MemKind.DRAM, 0
    elif dev_type in ("cuda", "hip"):
        kind, ordinal = MemKind.VRAM, int(device.index or 0)
    else:
        raise RegistrationError(f"tensor device must be 'cpu' or 'cuda'; got {dev_type!r}")
    itemsize = int(obj.element_size())
    shape = tuple(int(d) for d in obj.shape)
    return TensorInfo(int(obj.data_ptr()), math.prod(shape) * itemsize, itemsize, shape, ordinal,
                      kind, bool(obj.is_contiguous()), str(obj.dtype).replace("torch.", ""))


def _from_interface(obj: Any, iface: dict, kind: MemKind) -> TensorInfo:
    shape = tuple(int(d) for d in iface["shape"])
    typestr = iface["typestr"]
    itemsize = int(np.dtype(typestr).itemsize)
    strides = iface.get("strides")
    strides = None if strides is None else tuple(int(s) for s in strides)
    addr = int(iface["data"][0] or 0)
    ordinal = 0
    if kind is MemKind.VRAM:
        dev = getattr(obj, "device", None)
        ordinal = int(getattr(dev, "id", getattr(dev, "index", 0)) or 0)
    dtype = str(getattr(obj, "dtype", np.dtype(typestr)))
    return TensorInfo(addr, math.prod(shape) * itemsize, itemsize, shape, ordinal, kind,
                      _c_contiguous(shape, strides, itemsize), dtype)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj: Any) -> TensorInfo:
    """Read the DLTensor of an unversioned ``dltensor`` capsule. The capsule is not consumed,
    so its destructor frees the producer's manager struct; ``obj`` keeps the memory alive."""
    dev_type, dev_id = obj.__dlpack_device__()
    kind = _DL_KINDS.get(int(dev_type))
    if kind is None:
        raise RegistrationError(f"DLPack device type must be one of {sorted(_DL_KINDS)}; got {dev_type}")
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        ptr = get(capsule, b"dltensor")
    except ValueError as exc:
        raise RegistrationError(f"expected an unversioned 'dltensor' DLPack capsule from "
                                f"{type(obj).__name__}; got another kind") from exc
    t = _DLTensor.from_address(ptr)  # DLManagedTensor starts with its DLTensor
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    dtype = _DL_FLOAT_NAMES.get((t.dtype.code, t.dtype.bits), f"dl{t.dtype.code}:{t.dtype.bits}")
    return TensorInfo(int(t.data or 0) + int(t.byte_offset), math.prod(shape) * itemsize, itemsize,
                      shape, 0 if kind is MemKind.DRAM else int(dev_id), kind,
                      _c_contiguous(shape, strides, itemsize), dtype)


def describe(obj: Any) -> TensorInfo:
    """Describe a tensor-like object without importing its library.

    Raises:
        RegistrationError: ``obj`` exposes none of the supported interfaces, or a device
            kvxfer cannot move (names the type / device).
    """
    if all(hasattr(obj, a) for a in ("data_ptr", "element_size", "is_contiguous", "device")):
        return _from_torch(obj)
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        return _from_interface(obj, iface, MemKind.VRAM)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return _from_interface(obj, iface, MemKind.DRAM)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj)
    raise RegistrationError(
        f"expected a tensor (torch, numpy, cupy, DLPack or array interface); got {type(obj).__name__}")


def host_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable ``uint8`` numpy view of ``nbytes`` of host memory at ``addr`` (no copy).

    The caller keeps the memory alive for as long as the view is used.

    Raises:
        RegistrationError: ``addr`` is 0 or negative, or ``nbytes`` is negative.
    """
    if not isinstance(addr, (int, np.integer)) or int(addr) <= 0:
        raise RegistrationError(f"addr must be a positive host address; got {addr!r}")
    if not isinstance(nbytes, (int, np.integer)) or int(nbytes) < 0:
        raise RegistrationError(f"nbytes must be >= 0; got {nbytes!r}")
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    buf = (ctypes.c_uint8 * int(nbytes)).from_address(int(addr))
    return np.frombuffer(buf, dtype=np.uint8)
