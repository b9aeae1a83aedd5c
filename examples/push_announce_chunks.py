"""Consumer first (SGLang's model): the decode side announces its blocks, the prefill side pushes
the request chunk by chunk and finishes it with a small aux payload. Two processes.

Run:  python examples/push_announce_chunks.py
1. The decode process listens and announces request "req-7": its destination blocks, and a
   payload of its own (here: the number of chunks to expect).
2. The prefill process sees the announcement, opens a write stream to the decode rank, writes
   the request in two chunks as its "prefill" produces them, and finishes with an aux payload
   (the first generated token, say). The stream's handle completes once.
3. The decode side sees the request RECEIVED only after every chunk landed and the aux arrived,
   takes the aux, and checks every byte.
"""

import multiprocessing as mp
import os
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec, RequestState

SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=32,
              dtype="bfloat16", model="example-model")
DECODE_PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5750"))
PREFILL_PORT = DECODE_PORT + 5
PREFILL_BLOCKS = [9, 3, 12, 4]      # where the prefill side keeps the request's KV, token order
DECODE_BLOCKS = [20, 21, 2, 30]     # where the decode side reserved room for it


def cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in SPEC.tensor_shapes()]


def prefill(ready, done) -> None:
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PREFILL_PORT)
    with Agent("prefill", SPEC, config) as agent:
        agent.register(cache(seed=1))
        agent.listen()
        ready.set()
        deadline = time.monotonic() + 60
        while not agent.announced("req-7"):                   # the engine polls this each step
            if time.monotonic() > deadline:
                raise SystemExit("no announcement arrived")
            time.sleep(0.01)
        (ann,) = agent.announced("req-7")
        stream = agent.open_writes(ann.remote, "req-7", timeout=30)
        for lo, hi in ((0, 2), (2, 4)):                        # two prefill chunks of two blocks each
            stream.write(PREFILL_BLOCKS[lo:hi], ann.block_ids[lo:hi])
        stream.finish(aux=b"first-token:42")
        stream.handle.wait(30)                                 # raises if the push failed
        agent.forget_announced("req-7")
        done.wait(30)                                          # keep serving until the decode side checked


def main() -> int:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=prefill, args=(ready, done))
    proc.start()
    mine = cache(seed=2)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=DECODE_PORT)
    with Agent("decode", SPEC, config) as agent:
        agent.register(mine)
        agent.listen()                                         # producers write to this listener
        if not ready.wait(60):
            raise SystemExit("prefill did not start")
        # returns at once; a producer that cannot be reached fails the request (status FAILED)
        agent.announce(("127.0.0.1", PREFILL_PORT), "req-7", DECODE_BLOCKS, payload=b"chunks=2", timeout=30)
        deadline = time.monotonic() + 60
        while agent.status("req-7") not in (RequestState.RECEIVED, RequestState.FAILED):
            if time.monotonic() > deadline:
                raise SystemExit(f"req-7 still {agent.status('req-7')}")
            time.sleep(0.01)
        if agent.status("req-7") is RequestState.FAILED:
            raise SystemExit(f"req-7 failed: {agent.finished().failed.get('req-7')}")
        aux = agent.take_aux("req-7")
        assert list(aux.values()) == [b"first-token:42"], aux
        theirs = cache(seed=1)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(mine[layer][:, DECODE_BLOCKS], theirs[layer][:, PREFILL_BLOCKS])
    done.set()
    proc.join(30)
    print("decode: req-7 received in two chunks with its aux payload; every byte matches")
    return proc.exitcode or 0


if __name__ == "__main__":
    raise SystemExit(main())
