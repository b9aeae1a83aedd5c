"""Control-plane costs on loopback, two real processes: new-peer handshake + plan (with its phases),
and per request plan + claim + post (Llama-3-8B shape, 512 blocks per request).

Both agents take the rest of their configuration from the environment (``AgentConfig.from_env``),
e.g. ``KVXFER_NIXL_PROGRESS_THREAD=0``; ``UCX_*`` variables reach UCX as always.

Run:  .venv/bin/python benchmarks/control_plane.py [--peers 10] [--requests 50]
"""

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="llama-3-8b")
PHASES = {  # PeerLink.timings, plus the plan this benchmark builds
    "hello": "Hello/Welcome round trip (ZMQ connect + both sessions)",
    "metadata": "NIXL metadata load (add_remote_agent: UCX endpoint creation)",
    "connect": "UCX connect (make_connection)",
    "plan": "plan build",
}


def producer(port: int, n_requests: int, ready, stop) -> None:
    spec = KVSpec(**SHAPE, num_blocks=1024)
    cache = [np.zeros(s, np.uint16) for s in spec.tensor_shapes()]
    with Agent("producer", spec, _config(port)) as agent:
        agent.register(cache)
        agent.listen()
        ids = np.random.default_rng(0).permutation(1024)[:512]
        for i in range(n_requests):
            agent.hold(f"r{i}", ids)
        ready.set()
        stop.wait(300)


def _config(port: int) -> AgentConfig:
    return AgentConfig.from_env(side_channel_host="127.0.0.1", side_channel_port=port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=10, help="fresh consumer agents (handshakes)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--port", type=int, default=5900)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=producer, args=(args.port, args.requests, ready, stop), daemon=True)
    proc.start()
    ready.wait(120)
    spec = KVSpec(**SHAPE, num_blocks=1024)
    cache = [np.zeros(s, np.uint16) for s in spec.tensor_shapes()]
    handshakes, phases = [], []
    for i in range(args.peers):
        with Agent(f"consumer{i}", spec, _config(args.port + 1 + i)) as agent:
            agent.register(cache)
            t0 = time.perf_counter()
            link = agent.connect("127.0.0.1", args.port)
            t1 = time.perf_counter()
            link.plan(agent.cache, allow_conversion=True)
            t2 = time.perf_counter()
            handshakes.append((t2 - t0) * 1e3)
            phases.append({**link.timings, "plan": t2 - t1})
    with Agent("consumer", spec, _config(args.port + 50)) as agent:
        agent.register(cache)
        link = agent.connect("127.0.0.1", args.port)
        plan = link.plan(agent.cache, allow_conversion=True)
        src = np.random.default_rng(0).permutation(1024)[:512]
        dst = np.random.default_rng(1).permutation(1024)[:512]
        plans, claims = [], []
        for i in range(args.requests):
            t0 = time.perf_counter()
            plan.for_request(dst, src)
            t1 = time.perf_counter()
            agent._claims.answers(f"r{i}", agent._claims.send(f"r{i}", src, [link]))
            claims.append((time.perf_counter() - t1) * 1e6)
            plans.append((t1 - t0) * 1e6)
    stop.set()
    proc.join(10)
    med = statistics.median
    print(f"new-peer handshake + plan (ZMQ round trip, NIXL metadata load, UCX connect): "
          f"median {med(handshakes):.1f} ms, min {min(handshakes):.1f} ms over {len(handshakes)} peers")
    for phase, what in PHASES.items():
        ms = [p[phase] * 1e3 for p in phases]
        print(f"  {what}: median {med(ms):.2f} ms, min {min(ms):.2f} ms")
    print(f"per-request plan, 512 fragmented blocks x 32 layers x K/V (32768 descriptors): "
          f"median {med(plans):.0f} us")
    print(f"per-request claim round trip on the side channel: median {med(claims):.0f} us")


if __name__ == "__main__":
    main()
