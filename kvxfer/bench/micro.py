"""Kernel-level GPU figures in one process: pack/unpack kernel vs torch gathers vs copies (layer: bench app).

``python -m kvxfer.bench.micro [--json PATH]`` times, on a Llama-3-8B-shaped cache with
fragmented block ids, every way kvxfer can gather a request on one GPU (and, with two GPUs,
read it from the peer GPU in one pass), each checked byte for byte against ``torch.index_select``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import numpy as np

from kvxfer.bench.caches import fill_random, make_cache
from kvxfer.gpu.ops import PairKernel
from kvxfer.layout.pairs import direct_pairs, pack_pairs
from kvxfer.layout.spec import KVSpec

__all__ = ["main"]


def _time(fn, iters: int = 10, warmup: int = 2) -> float:
    import torch

    times = []
    for i in range(warmup + iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        keep = fn()
        b.record()
        torch.cuda.synchronize()
        del keep
        if i >= warmup:
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m kvxfer.bench.micro")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2048,
                  dtype="bfloat16", layout="HND")
    n = args.tokens // 16
    ids = np.random.default_rng(0).permutation(spec.num_blocks)[:n]
    nbytes = spec.num_layers * 2 * n * spec.block_bytes
    cache = make_cache(spec, "cuda:0")
    fill_random(cache, 5)
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    ref = torch.empty_like(staging)

    def add(name: str, seconds: float, moved: int, ok: bool | None) -> None:
        rows.append({"name": name, "ms": seconds * 1e3, "gbps": moved / seconds / 1e9, "verified": ok})
        print(f"{name:48s} {seconds * 1e3:8.3f} ms {moved / seconds / 1e9:8.1f} GB/s  ok={ok}", flush=True)

    src1 = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda:0")
    dst1 = torch.empty_like(src1)
    add("torch copy 1 GiB on GPU0 (read+write counted once)", _time(lambda: dst1.copy_(src1)), 1 << 30, None)

    idx = torch.as_tensor(ids, device="cuda:0")
    rows64 = [t.view(torch.int64).view(2 * spec.num_blocks, -1) for t in cache.tensors]
    ref_rows = ref.view(torch.int64).view(spec.num_layers * 2, n, -1)

    def torch_gather():
        for layer, r in enumerate(rows64):
            for kv in range(2):
                torch.index_select(r, 0, idx + kv * spec.num_blocks, out=ref_rows[layer * 2 + kv])
    add("torch index_select int64 rows (reference gather)", _time(torch_gather), nbytes, None)
    base = staging.data_ptr()
    for unroll in (4, 8):
        k = PairKernel(0, unroll=unroll)
        add(f"kvxfer pack kernel u{unroll} (same layout)",
            _time(lambda: k.launch(pack_pairs(spec, cache.geometry, ids, spec, ids, base))), nbytes,
            bool(torch.equal(staging, ref)))
    k = PairKernel(0)
    nhd = dataclasses.replace(spec, layout="NHD")
    add("kvxfer pack kernel HND->NHD", _time(lambda: k.launch(pack_pairs(spec, cache.geometry, ids, nhd, ids, base))),
        nbytes, None)
    half = dataclasses.replace(spec, tp_size=2, tp_rank=1)
    add("kvxfer pack kernel TP1->2 half heads", _time(lambda: k.launch(pack_pairs(spec, cache.geometry, ids, half, ids, base))),
        nbytes // 2, None)
    table_ms = _time(lambda: pack_pairs(spec, cache.geometry, ids, spec, ids, base)) * 1e3
    rows.append({"name": "pack table build (numpy, host)", "ms": table_ms})
    print(f"pack table build (numpy, host) {table_ms:.3f} ms")
    if torch.cuda.device_count() > 1:
        peer = make_cache(spec, "cuda:1")
        fill_random(peer, 6)
        src1p = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda:1")
        add("torch peer copy 1 GiB GPU1->GPU0", _time(lambda: dst1.copy_(src1p)), 1 << 30, None)
        import cupy

        with cupy.cuda.Device(0):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(1)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass
        ids2 = np.random.default_rng(1).permutation(spec.num_blocks)[:n]
        for unroll in (4, 8):
            kk = PairKernel(0, unroll=unroll)
            add(f"kvxfer single pass GPU1 cache->GPU0 cache u{unroll}",
                _time(lambda: kk.launch(direct_pairs(spec, peer.geometry, ids, spec, cache.geometry, ids2))),
                nbytes, None)
        import time

        t0 = time.perf_counter()
        for _ in range(20):
            copy = direct_pairs(spec, peer.geometry, ids, spec, cache.geometry, ids2)
        t1 = time.perf_counter()
        launches = [k.launch(copy) for _ in range(20)]
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        del launches
        host = {"direct_pairs_us": (t1 - t0) / 20 * 1e6, "launch_host_us": (t2 - t1) / 20 * 1e6}
        rows.append({"name": "host cost per request", **host})
        print(f"host cost per request: direct_pairs {host['direct_pairs_us']:.0f} us, "
              f"launch {host['launch_host_us']:.0f} us", flush=True)
        add("kvxfer single pass GPU1 HND -> GPU0 NHD",
            _time(lambda: k.launch(direct_pairs(spec, peer.geometry, ids, nhd, cache.geometry, ids2))), nbytes, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
