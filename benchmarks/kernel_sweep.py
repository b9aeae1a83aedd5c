"""GPU time of the pair-copy kernel per (threads, unroll, blocks per SM), against one contiguous copy.

Run:  python3 benchmarks/kernel_sweep.py [--tokens 2048,8192] [--batch 1]
"""
import argparse

import numpy as np

import launch_pieces  # beside this script: run it as python3 benchmarks/kernel_sweep.py

from kvxfer.gpu.ops import PairKernel
from kvxfer.layout.pairs import DirectTemplate
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.types import MemKind

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="llama-3-8b")


def main() -> None:
    import cupy as cp
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    stream = cp.cuda.Stream(non_blocking=True)

    def gpu_us(fn) -> float:
        return launch_pieces.gpu_us(cp, stream, fn, reps=15)

    for tokens in map(int, args.tokens.split(",")):
        blocks = tokens // 16 * args.batch
        spec = KVSpec(**SHAPE, num_blocks=2 * blocks)
        caches = [[torch.empty(s, dtype=torch.int16, device="cuda:0") for s in spec.tensor_shapes()] for _ in range(2)]
        geoms = [CacheGeometry(np.array([[t[kv].data_ptr() for kv in range(2)] for t in c], dtype=np.uint64), 0,
                               MemKind.VRAM) for c in caches]
        rng = np.random.default_rng(0)
        src, dst = rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]
        copy = DirectTemplate(spec, geoms[0], spec, geoms[1]).copy(src, dst)
        a = cp.empty(copy.nbytes, dtype=cp.uint8)
        b = cp.empty(copy.nbytes, dtype=cp.uint8)
        base = gpu_us(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, copy.nbytes,
                                                          cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr))
        print(f"## {args.batch} x {tokens} tokens: contiguous copy {base:.1f} us")
        for threads in (128, 256, 512, 1024):
            for unroll in (4, 8):
                k = PairKernel(0, threads=threads, unroll=unroll)
                res = []
                for per_sm in (1, 2, 4, 8, 16, 64):
                    k.blocks_per_sm = per_sm
                    res.append(f"{per_sm}:{base / gpu_us(lambda: k.launch(copy, stream.ptr)):.2f}")
                print(f"  threads {threads:4d} unroll {unroll}: " + " ".join(res))
        del caches, a, b


if __name__ == "__main__":
    main()
