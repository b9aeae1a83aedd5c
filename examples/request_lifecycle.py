"""One request's life as an engine sees it: who owns the blocks at each step, in kvxfer's types.

Run:  python examples/request_lifecycle.py
The prefill process holds two requests. It releases one at once (``ReleaseOutcome.FREE_NOW``:
its blocks are the engine's again on return) and keeps serving the other until ``finished()``
lists it; its scheduler is the one reader of ``finished()``, while a second part of the engine
(a monitor) asks ``status()``, which drains nothing. The decode process reads with a 10 s
deadline, waits in short slices (``WaitTimeout`` only means "not yet": the read goes on), and
learns from ``keepalive`` that the released request is gone.
"""

import multiprocessing as mp
import os
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec, ReleaseOutcome, RequestState, WaitTimeout

SPEC = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=32,
              dtype="bfloat16", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5760"))


def cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in SPEC.tensor_shapes()]


def prefill(ready) -> None:
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)
    with Agent("prefill", SPEC, config) as agent:
        agent.register(cache(seed=1))
        agent.listen()
        free = set(range(SPEC.num_blocks))
        owned = {"req-1": [10, 11, 3], "req-2": [7, 8]}   # blocks kvxfer owns until finished() lists them
        for rid, blocks in owned.items():
            agent.hold(rid, blocks)
            free -= set(blocks)
        outcome = agent.release("req-2")                  # the engine changed its mind about req-2
        assert outcome is ReleaseOutcome.FREE_NOW, outcome   # nobody was reading: free on return
        free |= set(owned.pop("req-2"))
        ready.set()
        monitor = set()                                     # what a second part of the engine saw
        deadline = time.monotonic() + 60
        while owned and time.monotonic() < deadline:       # the scheduler's loop: one reader of finished()
            fin = agent.finished()
            for rid in fin.freed & owned.keys():            # sent, aborted or expired: reuse now
                free |= set(owned.pop(rid))
                print(f"prefill: {rid} is {agent.status(rid)}; its blocks are free again")
            monitor.add(agent.status("req-1"))              # status() drains nothing: ask any time
            time.sleep(0.01)
        if owned:
            raise SystemExit(f"prefill: {sorted(owned)} never came back")
        assert free == set(range(SPEC.num_blocks))
        assert RequestState.HELD in monitor or RequestState.CLAIMED in monitor, monitor


def decode() -> None:
    mine = cache(seed=2)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 1)
    with Agent("decode", SPEC, config) as agent:
        agent.register(mine)
        remote = ("127.0.0.1", PORT)
        handle = agent.read(remote, [0, 1, 2], [10, 11, 3], "req-1", timeout=10)   # the read's own deadline
        while True:
            try:
                stats = handle.wait(timeout=0.5)           # a slice of the engine's step, not a deadline
                break
            except WaitTimeout:
                print(f"decode: req-1 still {agent.status('req-1')}; its own deadline is 10 s")
        theirs = cache(seed=1)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(mine[layer][:, [0, 1, 2]], theirs[layer][:, [10, 11, 3]])
        assert agent.status("req-1") is RequestState.RECEIVED
        print(f"decode: req-1 {stats.num_bytes} bytes, {stats.total_seconds * 1e3:.2f} ms from read() to "
              f"completion ({stats.gb_per_s:.2f} GB/s); every byte matches")
        assert agent.keepalive(remote, ["req-2"]).gone == ("req-2",)   # released by the producer
        print("decode: req-2 is gone at the producer (released), as keepalive says")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=prefill, args=(ready,))
    proc.start()
    if not ready.wait(60):
        raise SystemExit("prefill did not start")
    decode()
    proc.join(30)
    raise SystemExit(proc.exitcode)
