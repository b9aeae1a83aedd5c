"""The least any Python-launched GPU request can cost on this machine, against a plain copy (issue 15).

One process, GPU 0, cupy, medians of ``--reads``. Per request size (Llama-3-8B shape, bf16):

* ``copy``: one contiguous device-to-device copy of the request's bytes, timed on the host from
  the call to the stream being done (what the bench's ``peer-copy`` row does);
* ``nop``: an empty kernel with no arguments, launched, its event recorded and waited for: the
  least a Python launch plus completion costs;
* ``nop, 25 args``: the same kernel taking ``kvx_pair_copy``'s 25 arguments as numpy scalars
  (what cupy packs for every IPC read);
* ``floor``: copy / (copy + nop with 25 args): the best ratio to ``peer-copy`` that a request
  launched from Python with kvxfer's argument list could reach if its kernel ran at copy speed
  and the host did nothing else at all (no tables, no id upload, no checks).

The issue's goal for the IPC path is >= 0.8 of peer-copy at 2,048 tokens and >= 0.9 at 8,192;
``floor`` says how much room a request's host work has under it.

Run:  python3 benchmarks/gpu_floor.py [--tokens 512,2048,8192] [--reads 50] [--json PATH]
"""

import argparse
import json
import statistics
import time

import numpy as np

_SRC = r"""
extern "C" __global__ void nop0() {}
extern "C" __global__ void nop25(long long a0, long long a1, long long a2, int a3, int a4, int a5,
    long long a6, int a7, int a8,
    unsigned long long s0, unsigned long long s1, unsigned long long s2, long long s3, long long s4,
    long long s5, long long s6, long long s7,
    unsigned long long d0, unsigned long long d1, unsigned long long d2, long long d3, long long d4,
    long long d5, long long d6, long long d7) {}
"""

BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x K/V x kv heads x head dim x bf16


def main() -> None:
    import cupy as cp  # noqa: PLC0415 - GPU only

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reads", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    module = cp.RawModule(code=_SRC)
    nop0, nop25 = module.get_function("nop0"), module.get_function("nop25")
    stream = cp.cuda.Stream(non_blocking=True)
    i64, u64, i32 = np.int64, np.uint64, np.int32
    side = [u64(1), u64(2), u64(0), i64(4), i64(16), i64(8), i64(1), i64(0)]
    launch_args = (i64(0), i64(512), i64(1), i32(16), i32(8), i32(16), i64(256), i32(0), i32(1), *side, *side)

    def launched(fn, fn_args) -> float:
        t0 = time.perf_counter()
        with stream:
            fn((1,), (32,), fn_args)
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        event.synchronize()
        return time.perf_counter() - t0

    def median_us(fn, *a) -> float:
        for _ in range(5):
            fn(*a)
        return statistics.median(fn(*a) for _ in range(args.reads)) * 1e6

    rows = []
    nop = median_us(launched, nop0, ())
    nop_args = median_us(launched, nop25, launch_args)
    for tokens in (int(t) for t in args.tokens.split(",")):
        nbytes = tokens * BYTES_PER_TOKEN
        src, dst = cp.empty(nbytes, dtype=cp.uint8), cp.empty(nbytes, dtype=cp.uint8)

        def copy() -> float:
            t0 = time.perf_counter()
            dst.data.copy_from_device_async(src.data, nbytes, stream)
            stream.synchronize()
            return time.perf_counter() - t0

        c = median_us(copy)
        rows.append({"tokens": tokens, "mib": nbytes >> 20, "copy_us": c, "nop_us": nop, "nop25_us": nop_args,
                     "floor": c / (c + nop_args)})
        del src, dst
    print(f"GPU {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, medians of {args.reads} (us)")
    print("| tokens | MiB | copy | nop launch + event | nop, 25 args | floor (copy / (copy + nop 25)) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['mib']} | {r['copy_us']:.1f} | {r['nop_us']:.1f} | {r['nop25_us']:.1f} | "
              f"{r['floor']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
