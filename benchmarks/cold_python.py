"""How much slower the same few microseconds of Python run after the thread was idle, on this
host (one process, no I/O, no other thread).

The work is one 512-block claim framed and decoded (what both ends of a claim do at least). It is
timed back to back, then right after the thread slept or spun for ``--idle-ms`` values. On a
machine whose caches and TLBs stay warm the rows are equal; where they are not, the difference
is what every side-channel message pays after idle, whatever carries it
(docs/benchmarks.md, "The claim's floor").

Run:  .venv/bin/python benchmarks/cold_python.py [--samples 60] [--idle-ms 1,3,10]
"""

import argparse
import time

import numpy as np

from kvxfer.protocol import Claim, pack_ids
from kvxfer.protocol.codec import Codec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--idle-ms", default="1,3,10")
    args = ap.parse_args()
    codec = Codec("ab" * 32)
    ids = np.random.default_rng(0).permutation(1024)[:512]

    def timed() -> float:
        t0 = time.perf_counter_ns()
        codec.decode(codec.encode(Claim("r1", [], "engine", 0.0, pack_ids(ids))))
        return (time.perf_counter_ns() - t0) / 1e3

    for _ in range(200):
        timed()
    print(f"one claim framed and decoded, median of {args.samples} (us)")
    print("| idle before | sleep | spin |")
    print("|---|---|---|")
    print(f"| none (back to back) | {np.median([timed() for _ in range(args.samples)]):.1f} | |")
    for ms in (float(x) for x in args.idle_ms.split(",")):
        slept, spun = [], []
        for _ in range(args.samples):
            time.sleep(ms / 1e3)
            slept.append(timed())
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass
            spun.append(timed())
        print(f"| {ms:g} ms | {np.median(slept):.1f} | {np.median(spun):.1f} |")


if __name__ == "__main__":
    main()
