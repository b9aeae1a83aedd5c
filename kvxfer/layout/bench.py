"""Micro-benchmark of per-request planning (layer: layout, pure; numpy/stdlib only, no nixl/zmq/torch).

``time_for_request`` measures ``TransferPlan.for_request`` for a model-shaped cache pair and
reports descriptor counts; ``python -m kvxfer.layout.bench`` prints a table of common cases.
Figures are for docs/benchmarks.md, never for timed tests.
"""

from __future__ import annotations

import time

import numpy as np

from kvxfer.layout.plan import CacheView, build_plan
from kvxfer.layout.spec import CacheGeometry, KVSpec

__all__ = ["CASES", "time_for_request"]


def _view(spec: KVSpec, base: int) -> CacheView:
    return CacheView(spec, CacheGeometry.contiguous(spec, base))


def time_for_request(local: KVSpec, remote: KVSpec, num_blocks: int = 512, *,
                     fragmented: bool = False, repeats: int = 200, seed: int = 0,
                     **plan_kwargs) -> dict:
    """Median microseconds of ``for_request`` for ``num_blocks`` local blocks, plus counts.

    ``fragmented``: block ids are a random permutation (no two consecutive), else one run.
    Returns ``{"mode", "unpack_map_us", "us_median", "us_min", "descriptors", "pieces_per_block",
    "bytes", "staging_bytes", "build_ms"}`` (``unpack_map_us``: staged only, building the
    vector map once; ``build_ms``: ``build_plan`` once).
    """
    t0 = time.perf_counter()
    plan = build_plan(_view(local, 0x1000_0000), _view(remote, 0x7000_0000_0000), **plan_kwargs)
    build_ms = (time.perf_counter() - t0) * 1e3
    tokens = num_blocks * local.block_size
    n_remote = tokens // remote.block_size
    rng = np.random.default_rng(seed)
    if fragmented:
        lb = rng.permutation(local.num_blocks)[:num_blocks]
        rb = rng.permutation(remote.num_blocks)[:n_remote]
    else:
        lb, rb = np.arange(num_blocks), np.arange(n_remote)
    req = plan.for_request(lb, rb)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        plan.for_request(lb, rb)
        samples.append(time.perf_counter_ns() - t)
    map_us = None
    if plan.mode == "host-staged":
        t = time.perf_counter_ns()
        req.unpack_map          # built lazily on first use; what a GPU unpack would upload
        map_us = (time.perf_counter_ns() - t) / 1e3
    return {
        "mode": str(plan.mode),
        "unpack_map_us": map_us,
        "us_median": float(np.median(samples)) / 1e3,
        "us_min": min(samples) / 1e3,
        "descriptors": int(req.local.shape[0]),
        "pieces_per_block": plan.pieces_per_block,
        "bytes": req.num_bytes,
        "staging_bytes": req.staging_bytes,
        "build_ms": build_ms,
    }


def _llama(**kw) -> KVSpec:
    """Llama-3-8B-shaped: 32 layers, 8 KV heads, head dim 128, bf16, block size 16."""
    base = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2048,
                dtype="bfloat16", model="llama-3-8b")
    base.update(kw)
    return KVSpec(**base)


#: (name, local spec, remote spec): decode (local) reads from prefill (remote).
CASES = [
    ("same NHD split", _llama(), _llama()),
    ("same cross_layer", _llama(storage="cross_layer"), _llama(storage="cross_layer")),
    ("same packed", _llama(storage="packed"), _llama(storage="packed")),
    ("TP1->TP2 HND", _llama(layout="HND", tp_size=2), _llama(layout="HND")),
    ("TP2->TP1 HND (one of 2)", _llama(layout="HND"), _llama(layout="HND", tp_size=2)),
    ("TP1->TP2 NHD (staged)", _llama(tp_size=2), _llama()),
    ("HND->NHD (staged)", _llama(), _llama(layout="HND")),
    ("split<-cross_layer", _llama(), _llama(storage="cross_layer")),
    ("bs16<-bs32 NHD", _llama(), _llama(block_size=32, num_blocks=1024)),
]


def main() -> None:
    print(f"{'case':28} {'ids':7} {'mode':11} {'us/req':>8} {'descs':>7} {'pcs/blk':>7} {'MiB':>7} "
          f"{'map us':>7} {'build ms':>8}")
    for name, local, remote in CASES:
        for frag in (False, True):
            r = time_for_request(local, remote, fragmented=frag)
            m = "-" if r["unpack_map_us"] is None else f"{r['unpack_map_us']:.0f}"
            print(f"{name:28} {'random' if frag else 'run':7} {r['mode']:11} {r['us_median']:8.1f} "
                  f"{r['descriptors']:7d} {r['pieces_per_block']:7d} {r['bytes'] / 2**20:7.1f} {m:>7} "
                  f"{r['build_ms']:8.2f}")


if __name__ == "__main__":
    main()
