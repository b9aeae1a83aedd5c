"""Where the time of one read (or one step of reads) goes, as a timeline across kvxfer's threads.

Two processes (producer spawned), Llama-3-8B-shaped cache, fragmented block ids. Each
iteration submits ``--batch`` reads with ``Agent.read_many`` and waits for all of them. The
steps of the read flow are wrapped to record when they begin and end, and on which thread
(the caller, the producer's lane, the progress loop); the table gives each step's median
offset from the call over the timed iterations. No profiler: the offsets are true times, plus
the wrappers' own cost (about a microsecond each).

``--cold`` makes each step start as a bench iteration does (``kvxfer bench`` overwrites and
compares the whole cache between two timed reads): 512 MiB copied on the device and a
synchronize (on ``cpu``: 512 MiB of host memory written) right before the step's requests are
made. ``--no-done`` never sends the consumer's done notices (the producer here holds every
request until it stops, so nothing waits on them): what kvxfer's done lane costs the caller.

Run:  .venv/bin/python benchmarks/read_phases.py [--device cuda:0] [--tokens 512] [--batch 1] [--reads 30]
      [--hold-tokens] [--small] [--profile] [--cold] [--no-done]
"""

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec, ReadRequest
from kvxfer.bench.phases import Timeline

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="llama-3-8b")
# --small: the busy-engine bench's cache (16 KiB a block), where a read's bytes cost next to nothing
SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16", model="busy-bench")




def _cache(spec: KVSpec, device: str, seed: int):
    shapes = spec.tensor_shapes()
    if device == "cpu":
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in shapes]
    import torch

    torch.cuda.set_device(torch.device(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(-(1 << 15), 1 << 15, s, dtype=torch.int16, device=device, generator=gen)
            for s in shapes]


def producer(spec, device, port, holds, ready, stop, tokens) -> None:
    cache = _cache(spec, device, 1)
    with Agent("producer", spec, AgentConfig.from_env(side_channel_host="127.0.0.1", side_channel_port=port)) as ag:
        ag.register(cache)
        ag.listen()
        wires = {}
        for rid, ids in holds:
            ag.hold(rid, ids)
            token = ag.hold_token(rid) if tokens is not None else None
            if token is not None:
                wires[rid] = token.wire()
        if tokens is not None:
            tokens.put(wires)
        ready.set()
        stop.wait(600)


def _chiller(device: str):
    """What runs between two of the bench's timed reads, roughly: a large copy, then a synchronize."""
    if device == "cpu":
        a, b = np.zeros(1 << 29, dtype=np.uint8), np.ones(1 << 29, dtype=np.uint8)
        return lambda: np.copyto(a, b)
    import torch

    a = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    b = torch.empty(1 << 29, dtype=torch.uint8, device=device)

    def chill() -> None:
        a.copy_(b)
        torch.cuda.synchronize(device)
    return chill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per request")
    ap.add_argument("--batch", type=int, default=1, help="requests per step (one read_many)")
    ap.add_argument("--reads", type=int, default=30, help="timed steps")
    ap.add_argument("--port", type=int, default=5950)
    ap.add_argument("--hold-tokens", action="store_true", help="reads carry the producer's hold tokens (issue 35)")
    ap.add_argument("--profile", action="store_true", help="also cProfile read_many (the caller's time, by function)")
    ap.add_argument("--small", action="store_true", help="the busy-engine bench's small cache instead of Llama-3-8B's")
    ap.add_argument("--cold", action="store_true", help="512 MiB copied (and synchronized) before each step, as the bench does")
    ap.add_argument("--no-done", action="store_true", help="never send done notices (what the done lane costs)")
    ap.add_argument("--num-blocks", type=int, default=0, help="the caches' blocks (default: twice what a step reads, at least 64)")
    args = ap.parse_args()
    if args.no_done:
        from kvxfer.agent.notices import DoneSender

        DoneSender.flush = lambda self: None  # a probe: the producer holds every request until it stops
    shape = SMALL if args.small else SHAPE
    per = args.tokens // shape["block_size"]
    blocks = per * args.batch
    spec = KVSpec(**shape, num_blocks=args.num_blocks or max(64, 2 * blocks))
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(spec.num_blocks)[:blocks], rng.permutation(spec.num_blocks)[:blocks]
    warm = 3
    steps = [[f"s{i}-r{j}" for j in range(args.batch)] for i in range(args.reads + warm)]
    holds = [(rid, src[j * per:(j + 1) * per]) for step in steps for j, rid in enumerate(step)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    queue = ctx.Queue() if args.hold_tokens else None
    proc = ctx.Process(target=producer, args=(spec, args.device, args.port, holds, ready, stop, queue), daemon=True)
    proc.start()
    wires = queue.get(timeout=300) if queue is not None else {}
    if not ready.wait(300):
        raise SystemExit("producer did not start")
    from kvxfer import HoldToken

    held = {rid: HoldToken.from_wire(w) for rid, w in wires.items()}
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    cache = _cache(spec, args.device, 2)
    timeline = Timeline.installed()
    totals, modes = [], set()
    calls: list[tuple[float, float]] = []  # read_many's wall time and the caller thread's CPU time in it
    remote = ("127.0.0.1", args.port)
    with Agent("consumer", spec, AgentConfig.from_env(side_channel_host="127.0.0.1",
                                                      side_channel_port=args.port + 1)) as ag:
        ag.register(cache)
        if held:
            ag.connect(*remote)  # token reads start on the caller's thread once the producer is known
        chill = _chiller(args.device) if args.cold else None
        for i, step in enumerate(steps):
            if chill is not None:
                chill()
            requests = [ReadRequest(remote, dst[j * per:(j + 1) * per], src[j * per:(j + 1) * per], rid, timeout=60,
                                    token=held.get(rid))
                        for j, rid in enumerate(step)]
            t0, c0 = timeline.start(), time.thread_time()
            if profile is not None and i >= warm:
                profile.enable()
            handles = ag.read_many(requests)
            if profile is not None:
                profile.disable()
            timeline.mark("read_many returned")
            call = (time.perf_counter() - t0, time.thread_time() - c0)
            stats = [h.wait(60) for h in handles]
            timeline.mark("all waits returned")
            if i < warm:
                continue
            totals.append(time.perf_counter() - t0)
            calls.append(call)
            modes.update(s.mode + (" by token" if getattr(s, "by_token", False) else "") for s in stats)
            timeline.record(t0, args.batch > 1)
    stop.set()
    proc.join(30)
    mib = spec.block_bytes * 2 * spec.num_layers * blocks / 2**20
    med = statistics.median
    print(f"{args.device}: {args.batch} x {args.tokens} tokens ({mib:.0f} MiB), path {sorted(modes)}, "
          f"{len(totals)} steps; median {med(totals) * 1e3:.3f} ms from the call to every wait returned")
    print(f"  read_many: {med([c[0] for c in calls]) * 1e6:.0f} us wall, {med([c[1] for c in calls]) * 1e6:.0f} us of "
          "the caller thread's CPU time (wall well above CPU: it waited, e.g. for the interpreter)")
    print("\n".join(timeline.lines()))
    if profile is not None:
        import pstats

        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
