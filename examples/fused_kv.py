"""Caches that keep one token's K and V in one vector (``KVSpec(kv_fused=True)``), the form of vLLM
0.32's GPU attention caches, moved between layouts and TP sizes.

Run:  python examples/fused_kv.py
Two prefill ranks (TP 2, head-major ``HND``: vLLM's ``LBHNC``) each hold 2 of the model's 4 KV
heads as ``[blocks, heads, tokens, K | V]`` per layer; one decode rank (TP 1, token-major ``NHD``:
vLLM's ``LBNHC``, in memory ``[blocks, tokens, heads, K | V]``) reads a 3-block request from both.
Here the caches are numpy arrays in host memory; on a GPU they are vLLM's tensors, described by
``kvxfer_vllm.cache.describe_cache``.
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

HEAD_SIZE = 32
COMMON = dict(num_layers=2, num_kv_heads=4, head_dim=2 * HEAD_SIZE, block_size=16, num_blocks=8,
              dtype="float16", kv_fused=True, model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5760"))
PREFILL_BLOCKS, DECODE_BLOCKS = [5, 0, 3], [1, 6, 2]


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def prefill_rank(rank: int, ready, stop) -> None:
    spec = KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=rank)
    with Agent(f"prefill-{rank}", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)) as agent:
        agent.register(cache_for(spec, seed=10 + rank))
        agent.listen()
        agent.hold("req", PREFILL_BLOCKS)
        ready.set()
        stop.wait(60)


def main() -> int:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ranks = []
    for rank in range(2):
        ready = ctx.Event()
        proc = ctx.Process(target=prefill_rank, args=(rank, ready, stop))
        proc.start()
        ready.wait(60)
        ranks.append(proc)
    spec = KVSpec(**COMMON, layout="NHD")
    cache = cache_for(spec, seed=2)
    with Agent("decode", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 10)) as agent:
        agent.register(cache)
        stats = agent.read(("127.0.0.1", PORT), DECODE_BLOCKS, PREFILL_BLOCKS, "req", timeout=30).wait()
    stop.set()
    for proc in ranks:
        proc.join(10)
    for rank in range(2):
        src = cache_for(KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=rank), seed=10 + rank)
        for layer in range(spec.num_layers):
            want = src[layer][PREFILL_BLOCKS]                       # [blocks, 2 heads, tokens, K | V]
            got = cache[layer][DECODE_BLOCKS][:, :, 2 * rank:2 * rank + 2].transpose(0, 2, 1, 3)
            assert np.array_equal(got, want), (rank, layer)
            k, v = got[..., :HEAD_SIZE], got[..., HEAD_SIZE:]       # how the attention kernels split it
            assert np.array_equal(k, want[..., :HEAD_SIZE]) and np.array_equal(v, want[..., HEAD_SIZE:])
    print(f"decode (TP 1, NHD) read 3 blocks from 2 prefill ranks (TP 2, HND): {stats.num_bytes} bytes "
          f"({stats.mode}); every token's K | V of every head is where the decode's layout keeps it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
