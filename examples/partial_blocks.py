"""A 21-token prompt moved between caches of other block sizes, partial last blocks included.

Run:  python examples/partial_blocks.py
The prefill process uses blocks of 4 tokens (NHD), the decode blocks of 16 (HND). The 21 tokens
fill 6 prefill blocks (the last holds 1 token) and 2 decode blocks (the last holds 5). Naming the
token count, ``read(..., num_tokens=21)``, moves exactly those tokens: tokens 21-31 of the
decode's second block are left as they were.
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

COMMON = dict(num_layers=2, num_kv_heads=4, head_dim=32, num_blocks=16, dtype="float16", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5740"))
PROMPT = 21
PREFILL_BLOCKS = [7, 1, 2, 3, 12, 5]   # ceil(21 / 4) = 6
DECODE_BLOCKS = [9, 4]                 # ceil(21 / 16) = 2


def cache_for(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def tokens(t: np.ndarray, spec: KVSpec, ids: list[int]) -> np.ndarray:
    """``[K/V, tokens, heads, dim]`` of the given blocks of one layer, token order."""
    x = t[:, ids]
    if spec.layout.value == "HND":
        x = x.transpose(0, 1, 3, 2, 4)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def prefill(ready, stop) -> None:
    spec = KVSpec(**COMMON, block_size=4, layout="NHD")
    with Agent("prefill", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)) as agent:
        agent.register(cache_for(spec, seed=1))
        agent.listen()
        agent.hold("req-21", PREFILL_BLOCKS)
        ready.set()
        stop.wait(60)


def main() -> int:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=prefill, args=(ready, stop))
    proc.start()
    ready.wait(60)
    spec = KVSpec(**COMMON, block_size=16, layout="HND")
    cache = cache_for(spec, seed=2)
    before = [t.copy() for t in cache]
    with Agent("decode", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 10)) as agent:
        agent.register(cache)
        stats = agent.read(("127.0.0.1", PORT), DECODE_BLOCKS, PREFILL_BLOCKS, "req-21", timeout=30,
                           num_tokens=PROMPT).wait()
    stop.set()
    proc.join(10)
    pspec = KVSpec(**COMMON, block_size=4, layout="NHD")
    src = cache_for(pspec, seed=1)
    for layer in range(spec.num_layers):
        got = tokens(cache[layer], spec, DECODE_BLOCKS)
        assert np.array_equal(got[:, :PROMPT], tokens(src[layer], pspec, PREFILL_BLOCKS)[:, :PROMPT]), layer
        assert np.array_equal(got[:, PROMPT:], tokens(before[layer], spec, DECODE_BLOCKS)[:, PROMPT:]), layer
    print(f"decode: {PROMPT} tokens, blocks of 4 (NHD) -> blocks of 16 (HND), {stats.num_bytes} bytes "
          f"({stats.mode}); every token matches and tokens {PROMPT}-31 of the last block are untouched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
