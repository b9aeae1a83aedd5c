"""The producer's side of one claim: ``LeaseTable.claim`` of a 512-block request while many
requests are held, and ``expire()`` over them (one process, no I/O).

Run:  .venv/bin/python benchmarks/lease_claim.py [--holds 2000]
"""

import argparse
import time

import numpy as np

from kvxfer.engine.leases import LeaseTable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--holds", type=int, default=2000)
    n = ap.parse_args().holds
    table = LeaseTable(480)
    ids = np.random.default_rng(0).permutation(1024)[:512]
    for i in range(n):
        table.hold(f"r{i}", ids, 1024)
    wanted = ids.tolist()  # what a Claim decodes to: the held ids, in the consumer's order
    t0 = time.perf_counter()
    for i in range(n):
        table.claim(f"r{i}", "consumer", wanted, 1, 5.0)
    claim = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(200):
        table.expire()
    expire = (time.perf_counter() - t0) / 200
    print(f"{n} holds of 512 blocks: claim {claim * 1e6:.1f} us, expire {expire * 1e6:.1f} us")


if __name__ == "__main__":
    main()
