"""WRITE (the producer pushes) and abort (the consumer gives up): two processes.

Run:  python examples/push_write_and_abort.py
1. The decode process listens; the prefill process writes a request's blocks into it and the
   decode side sees the request in ``finished().received``.
2. The prefill process holds a second request; the decode side aborts it before reading and the
   prefill side sees it released in ``finished().aborted`` (no 480 s wait).
"""

import multiprocessing as mp
import os
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=32,
              dtype="bfloat16", model="example-model")
DECODE_PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5740"))
PREFILL_PORT = DECODE_PORT + 5


def cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in SPEC.tensor_shapes()]


def prefill(decode_ready, aborted) -> None:
    with Agent("prefill", SPEC, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PREFILL_PORT)) as agent:
        agent.register(cache(seed=1))
        agent.listen()
        agent.hold("held-2", [7, 8])  # held before the write, so it exists when the decode side aborts it
        if not decode_ready.wait(60):
            raise SystemExit("decode did not start")
        agent.write(("127.0.0.1", DECODE_PORT), [4, 5, 6], [0, 1, 2], "pushed-1", timeout=60).wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "held-2" in agent.finished().aborted:
                aborted.set()
                return
            time.sleep(0.01)


def main() -> int:
    ctx = mp.get_context("spawn")
    decode_ready, aborted = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=prefill, args=(decode_ready, aborted))
    proc.start()
    mine = cache(seed=2)
    with Agent("decode", SPEC, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=DECODE_PORT)) as agent:
        agent.register(mine)
        agent.listen()
        decode_ready.set()
        deadline = time.monotonic() + 60
        while "pushed-1" not in agent.finished().received:
            if time.monotonic() > deadline:
                raise SystemExit("the write never arrived")
            time.sleep(0.01)
        theirs = cache(seed=1)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(mine[layer][:, [0, 1, 2]], theirs[layer][:, [4, 5, 6]])
        print("decode: pushed-1 arrived by WRITE; every byte matches")
        agent.abort("held-2", remote=("127.0.0.1", PREFILL_PORT))
    if not aborted.wait(30):
        raise SystemExit("prefill never saw held-2 released")
    print("prefill: held-2 released by the decode side's abort")
    proc.join(10)
    return proc.exitcode or 0


if __name__ == "__main__":
    raise SystemExit(main())
