"""A hybrid model's cache (full-attention layers, sliding-window layers, Mamba2 state) moved in one read.

Run:  python examples/hybrid_cache.py
Each process describes its cache as a ``HybridSpec`` of three groups, as vLLM's hybrid KV-cache
manager keeps them: full attention, a sliding window of 16 tokens sharing the full group's tensors
(the engine keeps their block ids apart), and one Mamba2 state slot per request. The prefill holds
one request (one block list per group); the decode reads it naming its own lists and the prompt's
length: every full-attention block, only the sliding group's window (its last 5 blocks of 4 tokens,
tokens [24, 44) of 42), and the state slot move, under one claim and in one post.
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, AttentionGroup, HybridSpec, KVSpec, StateGroup, StateSpec
from kvxfer.layout import mamba2_state

PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5760"))
PROMPT = 42  # tokens: 11 blocks of 4
PREFILL = ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [3])
DECODE = ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [0])


def spec() -> HybridSpec:
    kv = KVSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=80, dtype="float16",
                model="example-hybrid")
    state = StateSpec(num_layers=2, tensors=mamba2_state(8, 8, 2, 16, 4, conv_dtype="float16", ssm_dtype="float32"),
                      num_slots=4, model="example-hybrid")
    return HybridSpec((AttentionGroup(kv, name="full"), AttentionGroup(kv, sliding_window=16, name="swa"),
                       StateGroup(state, name="mamba")))


def cache(h: HybridSpec, seed: int):
    """Attention layers ``[2, blocks, tokens, heads, dim]`` (one set of tensors for both attention groups)
    and per state layer ``[conv, ssm]`` arrays of ``StateSpec.tensor_shapes()``."""
    rng = np.random.default_rng(seed)
    kv, state = h.groups[0].spec, h.groups[2].spec
    attn = [rng.standard_normal(s).astype(np.float16) for s in kv.tensor_shapes()]
    dtypes = [np.float16, np.float32]
    ssm = [[rng.standard_normal(s).astype(d) for s, d in zip(state.tensor_shapes(), dtypes)]
           for _ in range(state.num_layers)]
    return [attn, attn, ssm]   # one entry per group; the sliding group shares the full group's tensors


def prefill(ready, stop) -> None:
    with Agent("prefill", spec(), AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)) as agent:
        agent.register(cache(spec(), seed=1))
        agent.listen()
        agent.hold("req-hybrid", PREFILL)   # one hold for every group
        ready.set()
        stop.wait(60)


def main() -> int:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=prefill, args=(ready, stop))
    proc.start()
    ready.wait(60)
    h = spec()
    tensors = cache(h, seed=2)
    before = [t.copy() for t in tensors[0]]
    with Agent("decode", h, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 10)) as agent:
        agent.register(tensors)
        stats = agent.read(("127.0.0.1", PORT), DECODE, PREFILL, "req-hybrid", timeout=30,
                           num_tokens=PROMPT).wait()
    stop.set()
    proc.join(10)
    src = cache(h, seed=1)
    window = 5  # blocks of the sliding group that hold tokens [24, 44): the window of the 16 tokens before token 42
    for layer in range(2):
        assert np.array_equal(tensors[0][layer][:, DECODE[0]], src[0][layer][:, PREFILL[0]]), layer
        assert np.array_equal(tensors[1][layer][:, DECODE[1][-window:]], src[1][layer][:, PREFILL[1][-window:]])
        assert np.array_equal(tensors[1][layer][:, DECODE[1][:-window]], before[layer][:, DECODE[1][:-window]])
        for got, want in zip(tensors[2][layer], src[2][layer]):
            assert np.array_equal(got[DECODE[2]], want[PREFILL[2]]), layer
    print(f"decode: {len(DECODE[0])} full-attention blocks, {window} of {len(DECODE[1])} sliding-window blocks "
          f"and 1 Mamba2 state slot in one read: {stats.num_bytes} bytes from {stats.peers} producer rank "
          f"({stats.mode}); every byte matches, the blocks outside the window are untouched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
