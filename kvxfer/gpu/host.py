"""Host twins of the GPU executors: the pair-copy "kernel" on host memory (layer: gpu; numpy only, never nixl/zmq).

``HostPairKernel`` has what ``kvxfer.engine.paths.pipeline`` needs of a ``PairKernel`` (``device``,
``launch(copy, stream)`` and a ``cp.cuda`` namespace with ``Device``, ``Stream`` and
``Event``), so the staged pipeline with producer-side pack runs unchanged on DRAM caches:
CI exercises the whole protocol between two processes over real NIXL without a GPU. Copies
run synchronously inside ``launch``, so every event is complete when recorded. The tables are
the GPU's (``PairCopy.src``/``.dst`` compute on the host what the kernel computes on the GPU).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from kvxfer.layout.pairs import PairCopy

__all__ = ["HostPairKernel"]


class _Event:
    """A recorded point on a host "stream": the work before it already ran."""

    def __init__(self, block: bool = False, disable_timing: bool = True) -> None:
        self.done = False

    def record(self, stream: Any = None) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = True) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Device:
    def __init__(self, device: int = 0) -> None:
        pass

    def __enter__(self) -> "_Device":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class HostPairKernel:
    """Executes ``PairCopy`` tables whose addresses are host memory of this process.

    Where a box's rows are contiguous on both sides (whole heads of one token: no HND<->NHD
    permutation), each row, or the whole box when it is one run, is one ``memmove``: about
    memory speed, ~8 GB/s for 32 KiB boxes on the 2-core CI host. Other boxes (a permutation)
    are copied through two strided numpy views (``tokens x heads x vector_bytes``), one small
    numpy assignment per pair. The copies address raw pointers of the tables: the caller
    guarantees they are valid (the agent only builds tables over its registered cache and
    staging area).
    """

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=_Device, Stream=_Stream, Event=_Event))

    def __init__(self, device: int = 0) -> None:
        self.device = int(device)

    def launch(self, copy: PairCopy, stream: int | None = None) -> None:
        if copy.n == 0:
            return None
        if copy.src_hs == 1 and copy.dst_hs == 1:
            _copy_rows(copy)
        else:
            _copy_boxes(copy)
        return None


def _copy_rows(copy: PairCopy) -> None:
    """Boxes whose token rows are contiguous on both sides: one ``memmove`` per run of rows."""
    import ctypes  # noqa: PLC0415 - only the host twin copies by raw pointer

    vb, heads = copy.vector_bytes, copy.heads
    src, dst = copy.src, copy.dst
    if copy.src_ts == heads and copy.dst_ts == heads:  # the whole box is one run on both sides
        runs, nbytes = zip(src.tolist(), dst.tolist()), copy.tokens * heads * vb
    else:
        tok = np.arange(copy.tokens, dtype=np.uint64)
        s = (src[:, None] + tok * np.uint64(copy.src_ts * vb)).ravel()
        d = (dst[:, None] + tok * np.uint64(copy.dst_ts * vb)).ravel()
        runs, nbytes = zip(s.tolist(), d.tolist()), heads * vb
    move = ctypes.memmove
    for s_addr, d_addr in runs:
        move(d_addr, s_addr, nbytes)


def _copy_boxes(copy: PairCopy) -> None:
    """Any box: two strided numpy views per pair."""
    vb = copy.vector_bytes
    shape = (copy.tokens, copy.heads, vb)
    s_strides = (copy.src_ts * vb, copy.src_hs * vb, 1)
    d_strides = (copy.dst_ts * vb, copy.dst_hs * vb, 1)
    s_extent = _extent(shape, s_strides)
    d_extent = _extent(shape, d_strides)
    for s, d in zip(copy.src.tolist(), copy.dst.tolist()):
        src = np.lib.stride_tricks.as_strided(_host_bytes(s, s_extent), shape, s_strides)
        dst = np.lib.stride_tricks.as_strided(_host_bytes(d, d_extent), shape, d_strides)
        dst[...] = src


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Bytes from a box's first byte to one past its last."""
    return sum((n - 1) * s for n, s in zip(shape, strides)) + 1


def _host_bytes(addr: int, nbytes: int) -> np.ndarray:
    import ctypes  # noqa: PLC0415 - only the host twin needs raw pointers

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
