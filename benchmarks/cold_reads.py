"""Does a cold start cost kvxfer more than raw NIXL? A token read against raw NIXL's read of the same
4 blocks, back to back ("warm") and with 512 MiB of host memory copied right before each read
("cold": the CPU caches hold none of the read path's code or data, as after an engine's step).

Two processes, the busy bench's cache and producer (``kvxfer.bench.busy``: an Agent and a raw NIXL
agent over one cache, idle here); warm-up 3 reads each; then two rounds of warm and cold, 30 reads
each by default; medians from the call to the read's end.

Run:  .venv/bin/python benchmarks/cold_reads.py [--reads 30]
"""

import argparse
import statistics
import time

import numpy as np

from kvxfer import Agent, AgentConfig, HoldToken, ReadRequest
from kvxfer.bench import busy
from kvxfer.layout.spec import KVSpec
from kvxfer.testing import free_port_block


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=30, help="reads per row")
    args = ap.parse_args()
    spec = KVSpec(**busy.SPEC)
    cache = busy._cache(spec, 2)
    big_a, big_b = np.zeros(1 << 29, dtype=np.uint8), np.ones(1 << 29, dtype=np.uint8)
    rng = np.random.default_rng(3)
    count = [0]
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1))
    with busy.producer_process() as (address, meta, bases, ask):
        with Agent("cold-consumer", spec, config) as agent:
            agent.register(cache)
            raw = busy._Raw(agent, meta, bases)

            def pick():
                count[0] += 1
                return (f"cold-{count[0]}", np.sort(rng.choice(spec.num_blocks, busy.BLOCKS, replace=False)),
                        np.sort(rng.choice(spec.num_blocks, busy.BLOCKS, replace=False)))

            def token_read(cold: bool) -> float:
                rid, src, dst = pick()
                token = HoldToken.from_wire(ask(("hold", [(rid, src.tolist())]))[0])
                if cold:
                    np.copyto(big_a, big_b)
                started = time.perf_counter()
                agent.read_many([ReadRequest(address, dst, src, rid, 10, token=token)])[0].wait()
                return time.perf_counter() - started

            def raw_read(cold: bool) -> float:
                _, src, dst = pick()
                if cold:
                    np.copyto(big_a, big_b)
                started = time.perf_counter()
                raw.read(dst, src, lambda: None)
                return time.perf_counter() - started

            for _ in range(3):
                token_read(False), raw_read(False)
            for cold in (False, True, False, True):
                for name, fn in (("token", token_read), ("raw NIXL", raw_read)):
                    times = [fn(cold) for _ in range(args.reads)]
                    print(f"{'cold' if cold else 'warm'} {name:9s} p50 {statistics.median(times) * 1e3:.3f} ms")
            raw.close()


if __name__ == "__main__":
    main()
