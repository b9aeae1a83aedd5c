"""An engine's step: every load scheduled in it submitted at once, from two prefill instances.

Run:  python examples/engine_step.py

The decode side submits eight reads (four from each prefill instance) with one ``read_many``
call, which returns at once: kvxfer claims each producer's four requests with one message and
moves them on its own thread per producer. One request was never held by its producer: only
that one fails (``LeaseExpiredError``), the other seven land exactly. Then one prefill instance
is frozen (SIGSTOP) and the step is repeated: the healthy instance's reads finish as before,
the frozen one's fail typed within their timeout. Last, the decode side runs like an engine's
step loop: a slice of its own work, then ``Agent.poll()`` once (the claims' answers, the posts
and the completions happen there, on its own thread), then a look at its handles and at
``finished()``; it never waits on a handle.
"""

import multiprocessing as mp
import os
import signal
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec, KvxferError, LeaseExpiredError, ReadRequest

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=64,
              dtype="bfloat16", layout="NHD", model="example-model")
BASE = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5730"))  # the side channels: BASE, BASE + 1 (prefill), BASE + 2 (decode)
PORTS = (BASE, BASE + 1)


def make_cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for shape in SPEC.tensor_shapes()]


def src_blocks(i: int) -> list[int]:
    return [2 * i, 2 * i + 1]


def prefill(index: int, ready, stop) -> None:
    with Agent(f"prefill{index}", SPEC, AgentConfig(side_channel_host="127.0.0.1",
                                                    side_channel_port=PORTS[index])) as agent:
        agent.register(make_cache(seed=index + 1))
        agent.listen()
        for i in range(8):
            if (index, i) != (1, 3):  # request 3 of instance 1 is never held: its claim is refused
                agent.hold(f"p{index}-r{i}", src_blocks(i))
        for i in range(4):  # the engine loop's loads (step 3)
            agent.hold(f"p{index}-s{i}", [32 + 2 * i, 33 + 2 * i])
        ready.set()
        stop.wait(120)


def _state(pid: int) -> str:
    """A process's scheduler state on Linux (T: stopped), for the diagnostic above."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "unknown"


def main() -> None:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=prefill, args=(i, readies[i], stop)) for i in range(2)]
    for p in procs:
        p.start()
    for ready in readies:
        if not ready.wait(60):
            raise SystemExit("a prefill instance did not start")
    cache = make_cache(seed=9)
    sources = [make_cache(seed=1), make_cache(seed=2)]
    with Agent("decode", SPEC, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=BASE + 2)) as agent:
        agent.register(cache)
        # Step 1: four loads from each instance, one call.
        loads = [(index, i) for i in range(4) for index in range(2)]
        requests = [ReadRequest(("127.0.0.1", PORTS[index]), [8 * index + 2 * i, 8 * index + 2 * i + 1],
                                src_blocks(i), f"p{index}-r{i}", timeout=10) for index, i in loads]
        started = time.monotonic()
        handles = agent.read_many(requests)
        print(f"read_many returned {len(handles)} handles in {(time.monotonic() - started) * 1e3:.2f} ms")
        for (index, i), request, handle in zip(loads, requests, handles):
            if (index, i) == (1, 3):
                try:
                    handle.wait()
                except LeaseExpiredError as exc:
                    print(f"  {request.request_id}: refused alone, as expected ({type(exc).__name__})")
                    continue
                raise SystemExit("the request that was never held did not fail")
            handle.wait()
            for layer in range(SPEC.num_layers):
                assert np.array_equal(cache[layer][:, request.local_blocks],
                                      sources[index][layer][:, request.remote_blocks])
        print("  the other seven reads are byte-exact")
        # Step 2: instance 1 frozen; instance 0's reads are not held up by it.
        os.kill(procs[1].pid, signal.SIGSTOP)
        try:
            requests = [ReadRequest(("127.0.0.1", PORTS[index]), [40 + 8 * index + i], [2 * (4 + i)],
                                    f"p{index}-r{4 + i}", timeout=2) for i in range(4) for index in range(2)]
            started = time.monotonic()
            handles = agent.read_many(requests)
            for request, handle in zip(requests, handles):
                if request.remote[1] == PORTS[0]:
                    handle.wait()
            healthy = time.monotonic() - started
            failed = 0
            for request, handle in zip(requests, handles):
                if request.remote[1] == PORTS[1]:
                    try:
                        stats = handle.wait()
                    except KvxferError:
                        failed += 1
                    else:  # not expected: say how it completed
                        print(f"  {request.request_id} completed from the frozen instance: mode {stats.mode}, "
                              f"by token {stats.by_token}, claim {stats.claim_seconds * 1e3:.2f} ms, "
                              f"{time.monotonic() - started:.3f} s after the call; the instance's state: "
                              f"{_state(procs[1].pid)}")
            print(f"frozen instance: the healthy one's 4 reads took {healthy * 1e3:.1f} ms; "
                  f"the frozen one's {failed} failed typed after {time.monotonic() - started:.2f} s (timeout 2 s)")
            assert healthy < 1.0 and failed == 4
        finally:
            os.kill(procs[1].pid, signal.SIGCONT)
        # Step 3: an engine's step loop. Loads go out with read_many; each step runs the engine's
        # own work, then one poll(); the handles and finished() are only looked at, never waited on.
        requests = [ReadRequest(("127.0.0.1", PORTS[0]), [20 + 2 * i, 21 + 2 * i], [32 + 2 * i, 33 + 2 * i],
                                f"p0-s{i}", timeout=10) for i in range(4)]
        pending = dict(zip((r.request_id for r in requests), agent.read_many(requests)))
        received: set[str] = set()
        wanted = {r.request_id for r in requests}
        steps = 0
        # A handle may read done a moment before finished() lists it (the thread that completed
        # it files the report next): an engine keyed on finished() sees it at its next step.
        while (pending or not received >= wanted) and steps < 5000:
            steps += 1
            time.sleep(0.004)                      # the engine's own work for this step
            agent.poll()                           # moves every transfer on, on this thread
            received |= agent.finished().received  # one reader drains the reports
            pending = {rid: h for rid, h in pending.items() if not h.done()}
        assert not pending and received >= wanted, (pending, received)
        for r in requests:
            for layer in range(SPEC.num_layers):
                assert np.array_equal(cache[layer][:, r.local_blocks], sources[0][layer][:, r.remote_blocks])
        print(f"engine loop: 4 reads done and byte-exact after {steps} step(s) of 4 ms, polled once per step")
    stop.set()
    for p in procs:
        p.join(30)


if __name__ == "__main__":
    main()
