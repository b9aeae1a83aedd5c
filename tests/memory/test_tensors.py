"""describe() reads tensors of every kind without importing their library; host_view maps memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.errors import RegistrationError
from kvxfer.memory import describe, host_view
from kvxfer.types import MemKind


class DLPackOnly:
    """Exposes only the DLPack protocol (as JAX arrays do), wrapping a numpy array."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class CudaLike:
    """A fake device array exposing __cuda_array_interface__ (cupy's protocol)."""

    class device:  # noqa: N801 - mimics cupy's Device with .id
        id = 3

    __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f2", "data": (0x7000_0000, False),
                                "strides": None, "version": 3}


def test_numpy_torch_dlpack_agree():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    want = (arr.ctypes.data, 96, 4, (2, 3, 4), 0, MemKind.DRAM, True)
    assert tuple(describe(arr))[:7] == want
    assert tuple(describe(torch.from_numpy(arr)))[:7] == want
    assert tuple(describe(DLPackOnly(arr)))[:7] == want
    assert describe(torch.zeros(3, dtype=torch.bfloat16)).dtype == "bfloat16"


def test_views_offsets_and_strides():
    arr = np.zeros((4, 6), np.float16)
    t = describe(arr[1:])
    assert t.addr == arr.ctypes.data + 12 and t.nbytes == 36 and t.contiguous
    assert not describe(arr[:, ::2]).contiguous
    assert not describe(arr.T).contiguous
    assert not describe(DLPackOnly(arr.T)).contiguous
    assert describe(arr[:, :1].reshape(4, 1)).contiguous is False
    tt = torch.zeros(4, 6)
    assert not describe(tt.t()).contiguous and describe(tt[2:]).addr == tt.data_ptr() + 48


def test_cuda_array_interface_is_vram():
    t = describe(CudaLike())
    assert (t.addr, t.nbytes, t.itemsize, t.kind, t.device, t.contiguous) == (0x7000_0000, 64, 2, MemKind.VRAM, 3, True)


def test_unsupported_objects():
    with pytest.raises(RegistrationError, match="got list"):
        describe([1, 2, 3])
    with pytest.raises(RegistrationError, match="'meta'"):
        describe(torch.empty(4, device="meta"))


def test_host_view_reads_and_writes():
    arr = np.arange(16, dtype=np.uint8)
    view = host_view(arr.ctypes.data + 4, 8)
    assert view.tolist() == list(range(4, 12))
    view[:] = 0
    assert arr[4:12].sum() == 0 and arr[12] == 12
    assert host_view(arr.ctypes.data, 0).size == 0
    with pytest.raises(RegistrationError, match="positive host address; got 0"):
        host_view(0, 8)
    with pytest.raises(RegistrationError, match="nbytes must be >= 0; got -1"):
        host_view(arr.ctypes.data, -1)
