"""Executors for ``PairCopy`` tables: one fused CUDA kernel, and a numpy twin for host memory and tests (layer: gpu; cupy is imported lazily, never nixl/zmq).

The CUDA kernel (compiled once per process with NVRTC through cupy) gives every thread block
one pair at a time and lets its threads walk the pair's ``tokens x heads x vector`` box in
the widest unit that every address allows (16-byte loads for bf16 head vectors), four loads
in flight per thread before the stores. Gathering a request's fragmented blocks, slicing heads
and permuting HND<->NHD therefore cost one pass over the bytes at HBM speed, and the same kernel
reads a peer GPU's cache through CUDA IPC for the same-host single pass.

Contracts: the launch is asynchronous on the given CUDA stream, and so is the upload of the
request's block ids (one copy from pinned memory on that stream, ordered before the kernel);
the buffers it uses stay alive in the returned ``Launch`` until the caller drops it after the
stream has passed it.
Source and destination boxes must not overlap.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import ConfigError
from kvxfer.layout.pairs import PairCopy, Side

__all__ = ["PairKernel", "Launch", "cupy_missing", "pair_copy_numpy", "vector_offsets"]

_RING_SLOTS = 16  # lean launches whose ids may be in flight at once
_RING_IDS = 1 << 14  # ids per ring slot (both sides of a request): 128 KiB pinned + 128 KiB device
_WIDE_THREADS = 512  # threads per block for large boxes (see ``launch``)
_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

_SOURCE_HEAD = r"""
struct KvxSide {
    const unsigned long long* bases;  /* per-region bases, or 0 for a staging side */
    const long long* ids;             /* block ids (cache side) */
    unsigned long long base;          /* staging base (staging side) */
    long long stride;                 /* block stride, or pair bytes for staging */
    long long bs, ts, hs, head;
};

__device__ __forceinline__ unsigned long long kvx_addr(const KvxSide& s, long long p, long long n_chunks,
                                                       long long chunk, long long vb) {
    if (s.bases == 0) return s.base + (unsigned long long)(p * s.stride);
    long long r = p / n_chunks, tok = (p - r * n_chunks) * chunk;
    long long blk = s.ids[tok / s.bs];
    return s.bases[r] + (unsigned long long)(blk * s.stride + ((tok % s.bs) * s.ts + s.head * s.hs) * vb);
}

#define KVX_PAIR_COPY(NAME, T, UNROLL)                                                       \
extern "C" __global__ void NAME(long long p0, long long n_pairs, long long n_chunks, int tokens,\
                                int heads, int vu, long long vb, int h_outer, int flat,       \
    unsigned long long sb, unsigned long long si, unsigned long long s0, long long s1,         \
    long long s2, long long s3, long long s4, long long s5,                                   \
    unsigned long long db, unsigned long long di, unsigned long long d0, long long d1,         \
    long long d2, long long d3, long long d4, long long d5)                                   \
{                                                                                             \
    const KvxSide S = {(const unsigned long long*)sb, (const long long*)si, s0, s1, s2, s3, s4, s5}; \
    const KvxSide D = {(const unsigned long long*)db, (const long long*)di, d0, d1, d2, d3, d4, d5}; \
    const int per = tokens * heads * vu;                                                      \
    for (long long q = blockIdx.x; q < n_pairs; q += gridDim.x) {                             \
        const T* __restrict__ s = (const T*)kvx_addr(S, p0 + q, n_chunks, tokens, vb);       \
        T* __restrict__ d = (T*)kvx_addr(D, p0 + q, n_chunks, tokens, vb);                   \
        for (int base = threadIdx.x; base < per; base += UNROLL * blockDim.x) {              \
            T buf[UNROLL];                                                                    \
            long long off[UNROLL];                                                            \
            _Pragma("unroll")                                                                 \
            for (int u = 0; u < UNROLL; ++u) {                                                \
                int i = base + u * blockDim.x;                                                \
                if (i < per && flat) { buf[u] = s[i]; off[u] = i; }                           \
                else if (i < per) {                                                           \
                    int v = i % vu, r = i / vu, t, h;                                         \
                    if (h_outer) { t = r % tokens; h = r / tokens; }                          \
                    else { h = r % heads; t = r / heads; }                                    \
                    buf[u] = s[(t * S.ts + h * S.hs) * vu + v];                               \
                    off[u] = (t * D.ts + h * D.hs) * vu + v;                                  \
                }                                                                             \
            }                                                                                 \
            _Pragma("unroll")                                                                 \
            for (int u = 0; u < UNROLL; ++u) {                                                \
                if (base + u * blockDim.x < per) d[off[u]] = buf[u];                          \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
"""


def _kernel_source() -> tuple[str, list[str]]:
    names, lines = [], [_SOURCE_HEAD]
    for width, ctype in _UNITS.items():
        for unroll in (4, 8):
            name = f"kvx_pair_copy_{width}_u{unroll}"
            names.append(name)
            lines.append(f"KVX_PAIR_COPY({name}, {ctype}, {unroll})")
    return "\n".join(lines), names


@dataclass
class Launch:
    """Keeps a launch's device address arrays alive; drop it once its stream has passed the kernel."""

    addresses: Any
    nbytes: int


class PairKernel:
    """The pair-copy kernel for one CUDA device (compiled lazily, shared by all tables).

    Args:
        device: CUDA ordinal the kernel runs on (the copying GPU; its peers' memory may be read
            when peer access / CUDA IPC mapping allows it).
        threads: threads per block; None (the default): 512 for boxes of at least 2,048 vectors
            (a whole 16-token block of a layer), else 256.
        unroll: loads in flight per thread before storing: 4 or 8.
        lean: launch through ``cuLaunchKernel`` from one prepared argument block, the block ids
            through a ring of preallocated pinned/device slots (the default; about 60-100 us
            less host time per launch on an H200 host, docs/benchmarks.md, "One GPU"). False: cupy's
            generic kernel call and pooled buffers for every launch (kept for comparison, and
            used whenever the ring's next slot is busy or too small).

    Raises:
        ConfigError: cupy is not importable (the GPU path needs it), or bad arguments.
    """

    _lock = threading.Lock()
    _modules: dict[int, Any] = {}

    def __init__(self, device: int = 0, threads: int | None = None, unroll: int = 8, lean: bool = True) -> None:
        if unroll not in (4, 8):
            raise ConfigError(f"unroll must be 4 or 8; got {unroll!r}")
        self.auto_threads = threads is None
        threads = 256 if threads is None else threads
        if threads <= 0 or threads % 32 or threads > 1024:
            raise ConfigError(f"threads must be a multiple of 32 in [32, 1024]; got {threads!r}")
        self.cp = _cupy()
        self.device = int(device)
        self.threads = threads
        self.unroll = unroll
        self.lean = lean
        self.blocks_per_sm = 64  # grid cap: thread blocks per SM (the kernel walks pairs grid-stride)
        self._uploads: dict[tuple, Any] = {}
        self._streams: dict[int, Any] = {}
        self._fptrs: dict[str, int] = {}  # kernel name -> CUfunction
        self._ring: _IdRing | None = None  # made on the first lean launch
        self._lean_lock = threading.Lock()  # the argument block and the ring are shared
        # The kernel's 25 arguments, each in its own 8-byte slot (an int argument reads the low
        # half of its slot: little-endian), and the pointer array cuLaunchKernel takes.
        self._args = np.zeros(25, dtype=np.int64)
        self._arg_ptrs_array = np.uint64(self._args.ctypes.data) + np.uint64(8) * np.arange(25, dtype=np.uint64)
        self._arg_ptrs = int(self._arg_ptrs_array.ctypes.data)
        with self.cp.cuda.Device(self.device):
            self._sms = self.cp.cuda.Device(self.device).attributes["MultiProcessorCount"]
            self._module = self._compile()

    def _compile(self) -> Any:
        with PairKernel._lock:
            module = PairKernel._modules.get(self.device)
            if module is None:
                source, names = _kernel_source()
                module = self.cp.RawModule(code=source, options=("-std=c++14",), name_expressions=None)
                for name in names:  # compile now, not inside a timed launch
                    module.get_function(name)
                PairKernel._modules[self.device] = module
            return module

    def _upload(self, arr: np.ndarray, dtype: Any) -> Any:
        """Device copy of a small host array that rarely changes (region bases), cached by content."""
        key = (arr.dtype.str, arr.tobytes())
        dev = self._uploads.get(key)
        if dev is None:
            if len(self._uploads) > 64:
                self._uploads.clear()
            host = np.ascontiguousarray(arr, dtype=dtype)
            dev = self.cp.empty(host.shape, dtype=host.dtype)
            # A synchronous copy: the array is complete before any stream's kernel may use it.
            self.cp.cuda.runtime.memcpy(dev.data.ptr, host.ctypes.data, host.nbytes,
                                        self.cp.cuda.runtime.memcpyHostToDevice)
            self._uploads[key] = dev
        return dev

    def _ids(self, sides: tuple[Side, ...], stream: int, keep: list) -> list[int]:
        """Both sides' block ids on the device through ONE asynchronous copy on ``stream``.

        Ids change with every request, so they are not cached: they are written into a pinned
        host buffer and copied on the launch's own stream, which orders the copy before the
        kernel without blocking the host. Both buffers stay alive in ``keep`` (the ``Launch``)
        until the caller drops it, after the stream has passed the kernel."""
        arrays = [np.asarray(s.ids, dtype=np.int64).reshape(-1) for s in sides if s.bases is not None]
        if not arrays:
            return []
        total = sum(a.size for a in arrays)
        cp = self.cp
        host = cp.cuda.alloc_pinned_memory(total * 8)
        flat = np.frombuffer(host, dtype=np.int64, count=total)
        dev = cp.cuda.alloc(total * 8)
        ptrs, at = [], 0
        for a in arrays:
            flat[at:at + a.size] = a
            ptrs.append(dev.ptr + at * 8)
            at += a.size
        cp.cuda.runtime.memcpyAsync(dev.ptr, host.ptr, total * 8, cp.cuda.runtime.memcpyHostToDevice, stream)
        keep += [host, dev]
        return ptrs

    def _side(self, side: Side, ids: int, keep: list) -> list:
        """The kernel's 8 arguments for one ``KvxSide`` (``ids``: the device address of its block ids)."""
        if side.bases is None:
            ptrs = (0, 0, side.base)
        else:
            bases = self._upload(side.bases, np.uint64)
            keep.append(bases)
            ptrs = (bases.data.ptr, ids, 0)
        return [np.uint64(x) for x in ptrs] + [np.int64(x) for x in
                                                (side.stride, side.block_size, side.ts, side.hs, side.head)]

    def launch(self, copy: PairCopy, stream: int | None = None) -> Launch | None:
        """Enqueue ``copy`` on ``stream`` (a ``cudaStream_t`` as int; None: cupy's current stream).

        Returns a ``Launch`` to hold until the stream has passed the kernel (None if there is
        nothing to copy). Thread-safe.
        """
        if copy.n == 0:
            return None
        cp = self.cp
        width = copy.alignment()
        vu = copy.vector_bytes // width
        name = f"kvx_pair_copy_{width}_u{self.unroll}"
        # Walk the box in the order the source is contiguous in (heads outer for HND sources).
        h_outer = int(copy.src_ts == 1 and copy.heads > 1)
        # Both boxes dense and walked in the same order: each pair is one flat run of bytes.
        same = (copy.src_ts, copy.src_hs) == (copy.dst_ts, copy.dst_hs)
        if h_outer:
            dense = copy.src_hs == copy.tokens
        else:
            dense = copy.src_ts == copy.heads and (copy.src_hs == 1 or copy.heads == 1)
        flat = int(same and dense)
        blocks = int(min(copy.n, self._sms * self.blocks_per_sm))
        # Large boxes (a whole 16-token block of a layer and more) move fastest with 512 threads
        # (benchmarks/kernel_sweep.py on an H200: 0.87 of a contiguous copy against 0.84 at 256)
        threads = self.threads
        if self.auto_threads and copy.tokens * copy.heads * vu >= _WIDE_THREADS * 4:
            threads = _WIDE_THREADS
        head = (copy.p0, copy.n, copy.n_chunks, copy.tokens, copy.heads, vu, copy.vector_bytes, h_outer, flat)
        with contextlib.ExitStack() as scope:
            if cp.cuda.runtime.getDevice() != self.device:
                scope.enter_context(cp.cuda.Device(self.device))
            if self.lean:
                on = stream if stream is not None else cp.cuda.get_current_stream().ptr
                keep = self._lean_launch(name, blocks, threads, head, copy, on)
                if keep is not None:
                    return Launch(keep, copy.nbytes)
            fn = self._module.get_function(name)
            if stream is not None:
                ext = self._streams.get(stream)
                if ext is None:  # wrapping a stream costs host time: once per stream handle
                    if len(self._streams) > 256:
                        self._streams.clear()
                    ext = self._streams[stream] = cp.cuda.ExternalStream(stream)
                scope.enter_context(ext)
            keep: list = []
            on = stream if stream is not None else cp.cuda.get_current_stream().ptr
            ids = iter(self._ids((copy.src_side, copy.dst_side), on, keep))
            sides: list = []
            for side in (copy.src_side, copy.dst_side):
                sides += self._side(side, next(ids) if side.bases is not None else 0, keep)
            i64, i32 = np.int64, np.int32
            fn((blocks,), (threads,),
               (i64(head[0]), i64(head[1]), i64(head[2]), i32(head[3]), i32(head[4]), i32(head[5]), i64(head[6]),
                i32(head[7]), i32(head[8]), *sides))
        return Launch(keep, copy.nbytes)

    def _lean_launch(self, name: str, blocks: int, threads: int, head: tuple, copy: PairCopy,
                     stream: int) -> list | None:
        """Launch through ``cuLaunchKernel`` with one prepared argument block; returns what the
        ``Launch`` keeps, or None when the ids do not fit the ring's next slot or it is still in
        use (the caller then launches the generic way)."""
        cp = self.cp
        sides = (copy.src_side, copy.dst_side)
        counts = [0 if s.bases is None else len(s.ids) for s in sides]
        total = sum(counts)
        bases = [None if s.bases is None else self._upload(s.bases, np.uint64) for s in sides]
        fptr = self._fptrs.get(name)
        if fptr is None:
            fn = self._module.get_function(name)
            fptr = self._fptrs[name] = getattr(fn, "kernel", fn).ptr
        with self._lean_lock:
            if self._ring is None:
                self._ring = _IdRing(cp, _RING_SLOTS, _RING_IDS)
            slot = self._ring.take(total)
            if slot is None:
                return None
            host, dev, event = slot
            try:
                at, args = 0, self._args
                args[:9] = head
                for k, (side, count, dev_bases) in enumerate(zip(sides, counts, bases)):
                    if dev_bases is None:
                        first = (0, 0, side.base)
                    else:
                        host[at:at + count] = side.ids
                        first = (dev_bases.data.ptr, dev + at * 8, 0)
                        at += count
                    args[9 + 8 * k:17 + 8 * k] = (*first, side.stride, side.block_size, side.ts, side.hs, side.head)
                if total:
                    cp.cuda.runtime.memcpyAsync(dev, host.ctypes.data, total * 8,
                                                cp.cuda.runtime.memcpyHostToDevice, stream)
                # cuLaunchKernel copies the arguments: the block may be refilled right after.
                cp.cuda.driver.launchKernel(fptr, blocks, 1, 1, threads, 1, 1, 0, stream, self._arg_ptrs, 0)
            finally:  # the slot is free again once the stream passed whatever was enqueued
                cp.cuda.runtime.eventRecord(event.ptr, stream)
        return [b for b in bases if b is not None]


class _IdRing:
    """Preallocated pinned and device buffers for requests' block ids, used in turn.

    A slot is handed out again only once the event recorded after the launch that used it has
    passed (the copy from its pinned half and the kernel reading its device half both ended);
    ``take`` never waits: it returns None when the next slot is still in use or too small."""

    def __init__(self, cp: Any, slots: int, ids: int) -> None:
        self._pinned = [cp.cuda.alloc_pinned_memory(ids * 8) for _ in range(slots)]
        self._host = [np.frombuffer(p, dtype=np.int64, count=ids) for p in self._pinned]
        self._dev = [cp.cuda.alloc(ids * 8) for _ in range(slots)]
        self._events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(slots)]
        self._used = [False] * slots
        self._ids = ids
        self._next = 0

    def take(self, count: int) -> tuple[np.ndarray, int, Any] | None:
        if count > self._ids:
            return None
        i = self._next
        if self._used[i] and not self._events[i].done:
            return None
        self._used[i] = True
        self._next = (i + 1) % len(self._host)
        return self._host[i], self._dev[i].ptr, self._events[i]


def cupy_missing() -> str:
    """Why the GPU kernel cannot run in this process ("" when cupy imports)."""
    try:
        _cupy()
    except ConfigError as exc:
        return str(exc)
    return ""


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported on first GPU use
    except ImportError as exc:
        raise ConfigError("the GPU path needs cupy (pip install cupy-cuda12x or cupy-cuda13x); "
                          f"import failed: {exc}") from exc
    return cupy


def vector_offsets(copy: PairCopy) -> tuple[np.ndarray, np.ndarray]:
    """Byte addresses (uint64) of every vector the copy reads and writes, in box order.

    For tests and host-memory execution; ``n * tokens * heads`` entries each.
    """
    t = np.arange(copy.tokens, dtype=np.uint64)[:, None]
    h = np.arange(copy.heads, dtype=np.uint64)[None, :]
    vb = np.uint64(copy.vector_bytes)
    s_in = ((t * np.uint64(copy.src_ts) + h * np.uint64(copy.src_hs)) * vb).reshape(-1)
    d_in = ((t * np.uint64(copy.dst_ts) + h * np.uint64(copy.dst_hs)) * vb).reshape(-1)
    return ((copy.src[:, None] + s_in[None, :]).reshape(-1),
            (copy.dst[:, None] + d_in[None, :]).reshape(-1))


def pair_copy_numpy(copy: PairCopy, memory: np.ndarray, base: int | None = None) -> None:
    """Execute ``copy`` on host bytes: addresses are ``base`` + offsets into the uint8 array ``memory``.

    ``base`` defaults to ``memory``'s own address, so tables built from real host addresses work.
    Raises ConfigError when any vector falls outside ``memory``.
    """
    mem = memory.reshape(-1).view(np.uint8)
    base = int(mem.ctypes.data) if base is None else int(base)
    src, dst = vector_offsets(copy)
    vb = copy.vector_bytes
    for name, arr in (("source", src), ("destination", dst)):
        if arr.size and (int(arr.min()) < base or int(arr.max()) + vb > base + mem.size):
            raise ConfigError(f"{name} vectors must lie in [{base:#x}, {base + mem.size:#x}); got "
                              f"[{int(arr.min()):#x}, {int(arr.max()) + vb:#x})")
    lanes = np.arange(vb, dtype=np.int64)[None, :]
    s = (src.astype(np.int64) - base)[:, None] + lanes
    d = (dst.astype(np.int64) - base)[:, None] + lanes
    mem[d] = mem[s]
