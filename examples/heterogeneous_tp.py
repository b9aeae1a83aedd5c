"""Prefill with TP=2 and the HND layout, decode with TP=1 and NHD: kvxfer gathers and permutes.

Run:  python examples/heterogeneous_tp.py
Each prefill rank is its own process and holds half of the KV heads; the decode rank reads
both halves (its plan is *staged*: whole HND head slices land in a staging buffer and are
permuted into NHD on arrival).
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

COMMON = dict(num_layers=2, num_kv_heads=4, head_dim=32, block_size=8, num_blocks=32,
              dtype="float16", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5720"))  # prefill rank r listens on PORT + r


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def prefill_rank(rank: int, ready, stop) -> None:
    spec = KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=rank)
    with Agent(f"prefill-tp{rank}", spec,
               AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)) as agent:
        agent.register(cache_for(spec, seed=rank))
        agent.listen()
        agent.hold("req-7", [5, 6])
        ready.set()
        stop.wait(60)


def main() -> int:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=prefill_rank, args=(r, readies[r], stop)) for r in range(2)]
    for p in procs:
        p.start()
    for ready in readies:
        ready.wait(60)
    spec = KVSpec(**COMMON, layout="NHD")
    cache = cache_for(spec, seed=9)
    with Agent("decode", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 10)) as agent:
        agent.register(cache)
        stats = agent.read(("127.0.0.1", PORT), [0, 1], [5, 6], "req-7", timeout=30).wait()
    stop.set()
    for p in procs:
        p.join(10)
    # decode NHD [2, blocks, tokens, 4 heads, dim]; prefill rank r HND [2, blocks, 2 heads, tokens, dim]
    for r in range(2):
        src = cache_for(KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=r), seed=r)
        for layer in range(2):
            want = src[layer][:, [5, 6]].transpose(0, 1, 3, 2, 4)        # -> [2, blocks, tokens, heads, dim]
            got = cache[layer][:, [0, 1], :, 2 * r:2 * r + 2]
            assert np.array_equal(got, want), f"rank {r} layer {layer} differs"
    print(f"decode: gathered 2 TP ranks, HND -> NHD, {stats.num_bytes} bytes ({stats.mode}); every byte matches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
