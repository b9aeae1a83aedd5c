"""Claim round trip on the side channel, back to back vs after the link sat idle (two processes,
loopback, real ZMQ and NIXL agents). Shows the cost of waking the threads of a round trip, and
the multiplexed session against one request at a time (the previous protocol) in the same run.

Run:  .venv/bin/python benchmarks/claim_latency.py [--requests 30] [--idle-ms 10]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from nixl_peers import Producer, cache_for, free_port_block  # noqa: E402

from kvxfer import Agent, AgentConfig, KVSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--idle-ms", type=float, default=10.0)
    args = ap.parse_args()
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=1024,
                  dtype="bfloat16", model="claim-bench")
    ids = np.random.default_rng(0).permutation(1024)[:512]
    n = args.requests
    prod = Producer(spec, seed=1, port=free_port_block(), holds={f"r{i}": ids for i in range(2 * n)})
    agent = Agent("claimer", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1)))
    try:
        agent.register(cache_for(spec, 2))
        links, _ = agent._links_for(prod.address)

        def claim(rid: str) -> float:
            t0 = time.perf_counter()
            agent._claim_answers(rid, agent._claim_send(rid, ids, links))
            return time.perf_counter() - t0

        hot, cold, serial = [], [], []
        for i in range(n):  # back to back, multiplexed and one-at-a-time interleaved (same run, same peer)
            hot.append(claim(f"r{i}"))
            for link in links:
                link.client.multiplexed = False  # what a peer without PeerInfo.multiplexed gets
            serial.append(claim(f"r{i}"))
            for link in links:
                link.client.multiplexed = link.info.multiplexed
        for i in range(n, 2 * n):
            time.sleep(args.idle_ms / 1e3)
            cold.append(claim(f"r{i}"))
        med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
        print(f"claim of 512 blocks: back to back median {med(hot):.0f} us multiplexed, {med(serial):.0f} us "
              f"one request at a time (ratio {med(hot) / med(serial):.2f}); after {args.idle_ms:g} ms idle "
              f"median {med(cold):.0f} us ({n} each)")
    finally:
        agent.close()
        prod.stop()


if __name__ == "__main__":
    main()
