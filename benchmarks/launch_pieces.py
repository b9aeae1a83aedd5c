"""What one same-host IPC launch costs on the host, piece by piece, and its kernel on the GPU.

One process, GPU 0, two Llama-3-8B-shaped caches (fragmented ids). For each request shape
(``--tokens`` per request x ``--batch`` requests in one launch), medians of ``--reps`` of:

* the id checks and the pair-copy table (what the agent does before launching);
* ``PairKernel.launch`` as a whole, then its pieces replayed one by one (stream and device
  switch, region-base uploads, id ring, async id copy, ``cuLaunchKernel``, event record);
* the kernel's own GPU time (CUDA events around it) against one contiguous device copy of the
  same bytes.

Run:  python3 benchmarks/launch_pieces.py [--tokens 512,2048,8192] [--batch 1] [--reps 200]
"""

import argparse
import statistics
import time

import numpy as np

from kvxfer.gpu.ops import PairKernel
from kvxfer.layout.pairs import DirectTemplate
from kvxfer.layout.request import check_block_ids
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.types import MemKind

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="llama-3-8b")


def gpu_us(cp, stream, fn, reps: int = 20) -> float:
    """Median GPU time (us) of what ``fn`` enqueues on ``stream``, between two CUDA events."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(reps):
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(out) * 1e3


def _med(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    import cupy as cp
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    for tokens in map(int, args.tokens.split(",")):
        blocks = tokens // 16 * args.batch
        spec = KVSpec(**SHAPE, num_blocks=2 * blocks)
        caches = [[torch.empty(s, dtype=torch.int16, device="cuda:0") for s in spec.tensor_shapes()]
                  for _ in range(2)]
        geoms = []
        for cache in caches:
            bases = np.array([[t[kv].data_ptr() for kv in range(2)] for t in cache], dtype=np.uint64)
            geoms.append(CacheGeometry(bases, 0, MemKind.VRAM))
        rng = np.random.default_rng(0)
        src, dst = rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]
        template = DirectTemplate(spec, geoms[0], spec, geoms[1])
        kernel = PairKernel(0)
        stream = cp.cuda.Stream(non_blocking=True)
        rows = {}
        rows["ids checked (2 arrays)"] = _med(lambda: (check_block_ids("l", dst, spec.num_blocks),
                                                       check_block_ids("r", src, spec.num_blocks)), args.reps)
        copy = template.copy(src, dst)
        rows["pair-copy table"] = _med(lambda: template.copy(src, dst), args.reps)

        def launch():
            kernel.launch(copy, stream.ptr)
            stream.synchronize()
        launch()
        rows["PairKernel.launch + sync (whole)"] = _med(launch, args.reps)

        def launch_only():
            t0 = time.perf_counter()
            kernel.launch(copy, stream.ptr)
            spent = time.perf_counter() - t0
            stream.synchronize()
            return spent
        rows["PairKernel.launch (host, async)"] = statistics.median(launch_only() for _ in range(args.reps)) * 1e6
        rows["  cp.cuda.runtime.getDevice()"] = _med(cp.cuda.runtime.getDevice, args.reps)
        rows["  with cp.cuda.Device(0)"] = _med(lambda: cp.cuda.Device(0).__enter__() and None, args.reps)
        rows["  copy.alignment()"] = _med(copy.alignment, args.reps)
        rows["  _upload(bases) x2"] = _med(lambda: (kernel._upload(copy.src_side.bases, np.uint64),
                                                    kernel._upload(copy.dst_side.bases, np.uint64)), args.reps)
        host = cp.cuda.alloc_pinned_memory(blocks * 16)
        hv = np.frombuffer(host, dtype=np.int64, count=2 * blocks)
        dev = cp.cuda.alloc(blocks * 16)
        rows["  ids into pinned buffer"] = _med(lambda: (hv.__setitem__(slice(0, blocks), src),
                                                         hv.__setitem__(slice(blocks, 2 * blocks), dst)), args.reps)
        rows["  memcpyAsync ids"] = _med(lambda: cp.cuda.runtime.memcpyAsync(
            dev.ptr, host.ptr, blocks * 16, cp.cuda.runtime.memcpyHostToDevice, stream.ptr), args.reps)
        stream.synchronize()
        ev = cp.cuda.Event(block=False, disable_timing=True)
        rows["  new cp.cuda.Event"] = _med(lambda: cp.cuda.Event(block=False, disable_timing=True), args.reps)
        rows["  eventRecord"] = _med(lambda: cp.cuda.runtime.eventRecord(ev.ptr, stream.ptr), args.reps)
        rows["  event.done (query)"] = _med(lambda: ev.done, args.reps)
        stream.synchronize()
        rows["  stream.synchronize (idle)"] = _med(stream.synchronize, args.reps)
        # GPU time of the kernel against one contiguous copy of the same bytes
        a = cp.empty(copy.nbytes, dtype=cp.uint8)
        b = cp.empty(copy.nbytes, dtype=cp.uint8)
        rows["GPU: pair-copy kernel"] = gpu_us(cp, stream, lambda: kernel.launch(copy, stream.ptr))
        rows["GPU: one contiguous copy"] = gpu_us(cp, stream, lambda: cp.cuda.runtime.memcpyAsync(
            b.data.ptr, a.data.ptr, copy.nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr))
        print(f"## {args.batch} x {tokens} tokens, {copy.nbytes / 2**20:.0f} MiB, {copy.n} pairs (us, medians)")
        for name, us in rows.items():
            print(f"  {name:38s} {us:9.1f}")
        del caches, a, b


if __name__ == "__main__":
    main()
