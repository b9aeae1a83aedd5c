"""The IPC read's host cost back to back and right after torch work, shipped launch against a lean one (issue 15).

The bench's ``kvxfer-ipc`` row spends 0.31-0.42 ms of host time per 512-token request where
``benchmarks/ipc_launch.py`` (requests back to back) spends ~0.1 ms on the same tables and
launch. Between two timed requests the bench runs its poison and verify: ~130 torch calls. This
measures, in one process on GPU 0 (Llama-3-8B shape, fresh fragmented ids per request):

* ``tables``: the request's pair table: ``direct_pairs`` (ids already checked) with the generic
  launch, as before; the link's ``DirectTemplate`` (built once) with the lean one, as now;
* ``generic``: ``PairKernel(lean=False).launch``: cupy's generic kernel call, pinned and device
  buffers from cupy's pools, the stream wrapper (the launch before this change);
* ``lean``: ``PairKernel.launch`` as shipped: the arguments packed into one preallocated block
  passed to ``cuLaunchKernel`` directly, the ids through a ring of preallocated pinned/device
  slots;

each ``hot`` (right after the previous request) and ``cold`` (right after torch copied and
compared every region of a cache, as the bench's poison and verify do). Every request's bytes
are checked.

Run:  python3 benchmarks/launch_cold.py [--tokens 512,2048] [--reads 40] [--json PATH]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvxfer.bench.caches import fill_random, make_cache  # noqa: E402
from kvxfer.gpu.ops import PairKernel  # noqa: E402
from kvxfer.layout.pairs import DirectTemplate, direct_pairs  # noqa: E402
from kvxfer.layout.spec import KVSpec  # noqa: E402


def measure(tokens: int, reads: int, kernels: dict[str, PairKernel]) -> list[dict]:
    import cupy as cp

    n = tokens // 16
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=4 * n,
                  dtype="bfloat16", model="llama-3-8b")
    src, dst = make_cache(spec, "cuda:0"), make_cache(spec, "cuda:0")
    fill_random(src, 1)
    background = make_cache(spec, "cuda:0")
    fill_random(background, 2)
    rng = np.random.default_rng(tokens)
    stream = cp.cuda.Stream(non_blocking=True)

    def pollute() -> None:  # what the bench does between two timed requests
        for t, b in zip(dst.tensors, background.tensors):
            t.view(-1).copy_(b.view(-1))
        torch.cuda.synchronize()
        for t, b in zip(dst.tensors, background.tensors):
            torch.equal(t, b)

    def check(s_ids, d_ids) -> bool:
        s_t, d_t = torch.as_tensor(s_ids, device="cuda:0"), torch.as_tensor(d_ids, device="cuda:0")
        return all(bool(torch.equal(s.view(torch.int16).view(2, spec.num_blocks, -1)[:, s_t],
                                    d.view(torch.int16).view(2, spec.num_blocks, -1)[:, d_t]))
                   for s, d in zip(src.tensors, dst.tensors))

    template = DirectTemplate(spec, src.geometry, spec, dst.geometry)
    rows = []
    for variant in ("generic", "lean", "generic", "lean"):
        for state in ("hot", "cold"):
            tables, launches, ok = [], [], 0
            for i in range(reads + 3):
                s_ids = rng.permutation(4 * n)[:n].astype(np.int64)
                d_ids = rng.permutation(4 * n)[:n].astype(np.int64)
                if state == "cold":
                    pollute()
                t0 = time.perf_counter()
                if variant == "lean":
                    copy = template.copy(s_ids, d_ids)
                else:
                    copy = direct_pairs(spec, src.geometry, s_ids, spec, dst.geometry, d_ids, checked=True)
                t1 = time.perf_counter()
                keep = kernels[variant].launch(copy, stream.ptr)
                t2 = time.perf_counter()
                stream.synchronize()
                del keep
                if i >= 3:
                    tables.append(t1 - t0)
                    launches.append(t2 - t1)
                    ok += check(s_ids, d_ids)
            rows.append({"tokens": tokens, "variant": variant, "state": state, "reads": reads, "verified": ok,
                         "tables_us": round(statistics.median(tables) * 1e6, 1),
                         "launch_us": round(statistics.median(launches) * 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--reads", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels = {"generic": PairKernel(0, lean=False), "lean": PairKernel(0)}
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows += measure(tokens, args.reads, kernels)
    print("| tokens | tables + launch | state | tables (us) | launch (us) | verified |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['variant']} | {r['state']} | {r['tables_us']} | {r['launch_us']} | "
              f"{r['verified']}/{r['reads']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
