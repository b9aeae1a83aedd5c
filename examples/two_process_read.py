"""Two processes, one KV request: the decode side pulls (READ) blocks held by the prefill side.

Run:  python examples/two_process_read.py
Copy the two functions into your engine: `prefill` is what a prefill worker does after
computing a request's KV, `decode` what a decode worker does before decoding it.
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec, RequestState

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=64,
              dtype="bfloat16", layout="NHD", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5710"))


def make_cache(seed: int) -> list[np.ndarray]:
    """One [2, blocks, block_size, heads, head_dim] tensor per layer (uint16 stands in for bf16)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for shape in SPEC.tensor_shapes()]


def prefill(ready, done) -> None:
    cache = make_cache(seed=1)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)
    with Agent("prefill", SPEC, config) as agent:
        agent.register(cache)
        agent.listen()
        agent.hold("req-42", [10, 11, 3])     # blocks of the request, in token order
        ready.set()
        while "req-42" not in agent.finished().freed:  # sent once the decode side is done (or aborted, expired)
            done.wait(0.01)
        assert agent.status("req-42") is RequestState.SENT
    print("prefill: decode finished reading req-42; its blocks are free again")


def decode() -> None:
    cache = make_cache(seed=2)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 1)
    with Agent("decode", SPEC, config) as agent:
        agent.register(cache)
        stats = agent.read(("127.0.0.1", PORT), [0, 1, 2], [10, 11, 3], "req-42", timeout=30).wait()
        expected = make_cache(seed=1)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(cache[layer][:, [0, 1, 2]], expected[layer][:, [10, 11, 3]])
        print(f"decode: {stats.num_bytes} bytes in {stats.descriptors} descriptors, "
              f"{stats.total_seconds * 1e3:.2f} ms from read() to completion; every byte matches")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=prefill, args=(ready, done))
    p.start()
    if not ready.wait(60):
        raise SystemExit("prefill did not start")
    decode()
    p.join(30)
    raise SystemExit(p.exitcode)
