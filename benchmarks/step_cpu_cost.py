"""What a step of token reads costs the caller's interpreter: CPU time inside ``read_many`` and
inside the waits, per step, on the CPU host (issue 34, rule 4: a step as arrays), and what the
interpreter's cycle collector spends in this process over the same steps.

Two processes (producer spawned), the busy-engine bench's small cache (16 KiB a block), so that
the bytes cost next to nothing and what is measured is kvxfer's Python around them (and NIXL's
post, which raw NIXL pays too). The producer holds every request with a hold token; each step
is one ``read_many`` of ``--batch`` token reads of ``--blocks`` blocks, then a wait on every
handle. Prints medians over the timed steps; ``--prof`` adds a cProfile of the whole step (or of
the waits only with ``--prof-wait``, or of the call up to the step's first backend post or
kernel launch with ``--prof-pre``): its call count per step is a steady measure of the
per-request Python where the host's timing is noisy. It also prints the time from the call to
the step's first post or launch: the Python every read of the step waits through before any
byte moves (issue 34, rule 4).

``--device cuda:0`` measures the same on one GPU (both processes on it: the CUDA IPC kernel
path, issue 34's "the caller's time inside ``read_many`` <= 10 us per request").

Run:  .venv/bin/python benchmarks/step_cpu_cost.py [--device cuda:0] [--batch 32] [--blocks 4] [--n 200] [--prof | --prof-wait | --prof-pre]
"""

import argparse
import gc
import multiprocessing as mp
import statistics
import time
from functools import partial

import numpy as np

from kvxfer import Agent, AgentConfig, HoldToken, KVSpec, ReadRequest
from read_phases import SMALL, _cache, producer  # the same producer (this directory is on sys.path)

WARM = 20


class Collector:
    """The cycle collector's passes in this process while ``on``: count and time by generation."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.on, self._t0 = False, 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            self.passes[info["generation"]].append(time.perf_counter() - self._t0)

    def line(self, steps: int) -> str:
        total = sum(sum(t) for t in self.passes.values())
        each = ", ".join(f"gen{g} {len(t)} x {statistics.mean(t) * 1e6:.0f} us" for g, t in self.passes.items() if t)
        return f"the cycle collector: {total * 1e3:.1f} ms over {steps} steps ({total / steps * 1e6:.0f} us a step; {each or 'no pass'})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32, help="token reads per step (one read_many)")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per read")
    ap.add_argument("--n", type=int, default=200, help="timed steps")
    ap.add_argument("--port", type=int, default=6150)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N (both processes on it: the IPC kernel path)")
    ap.add_argument("--prof", action="store_true", help="cProfile the timed steps")
    ap.add_argument("--prof-wait", action="store_true", help="cProfile the waits only")
    ap.add_argument("--prof-pre", action="store_true", help="cProfile the call up to the step's first post or launch")
    ap.add_argument("--sort", default="tottime", help="the profile's order (tottime, cumulative, ncalls)")
    ap.add_argument("--dump", default="", help="also write the profile to this file (pstats)")
    args = ap.parse_args()
    first_move = _watch_first_move()
    profile = None
    spec = KVSpec(**SMALL, num_blocks=4096)
    per, rng = args.blocks, np.random.default_rng(0)
    steps = [[f"s{i}-{j}" for j in range(args.batch)] for i in range(args.n + WARM)]
    holds, reads = [], []
    for step in steps:
        src = rng.permutation(spec.num_blocks)[:per * args.batch]
        dst = rng.permutation(spec.num_blocks)[:per * args.batch]
        for j, rid in enumerate(step):
            holds.append((rid, src[j * per:(j + 1) * per]))
            reads.append((dst[j * per:(j + 1) * per], src[j * per:(j + 1) * per]))
    ctx = mp.get_context("spawn")
    ready, stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=producer, args=(spec, args.device, args.port, holds, ready, stop, queue), daemon=True)
    proc.start()
    wires = queue.get(timeout=300)
    if not ready.wait(300):
        raise SystemExit("producer did not start")
    if args.prof or args.prof_wait or args.prof_pre:
        import cProfile

        profile = cProfile.Profile()
        if args.prof_pre:
            first_move.profile = profile  # disabled at the step's first post or launch
    held = _cache(spec, args.device, 1)  # the producer's bytes (its cache is made from this seed)
    cache = [c.clone().zero_() if hasattr(c, "clone") else np.zeros_like(c) for c in held]
    index = np.asarray  # a step's ids, as the caches index them (a device tensor on the GPU)
    if args.device != "cpu":
        import torch

        index = partial(torch.as_tensor, device=args.device)
    remote = ("127.0.0.1", args.port)
    collector = Collector()
    in_call, in_waits, walls, to_move = [], [], [], []
    with Agent("consumer", spec, AgentConfig.from_env(side_channel_host="127.0.0.1",
                                                      side_channel_port=args.port + 1)) as ag:
        ag.register(cache)
        ag.connect(*remote)
        k = 0
        for i, step in enumerate(steps):
            requests = []
            for rid in step:
                dst, src = reads[k]
                k += 1
                requests.append(ReadRequest(remote, dst, src, rid, timeout=30, token=HoldToken.from_wire(wires[rid])))
            timed = i >= WARM
            collector.on = timed
            if profile is not None and timed and not args.prof_wait:  # (--prof-pre: stops at the move)
                profile.enable()
            first_move.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            handles = ag.read_many(requests)
            c1 = time.thread_time()
            if profile is not None and timed and args.prof_wait:
                profile.enable()
            for h in handles:
                h.wait(30)
            c2, t2 = time.thread_time(), time.perf_counter()
            if profile is not None:
                profile.disable()
            if timed:
                in_call.append(c1 - c0)
                in_waits.append(c2 - c1)
                walls.append(t2 - t0)
                to_move.append(first_move[0] - t0 if first_move else float("nan"))
            landed = index(np.concatenate([reads[j][0] for j in range(k - len(step), k)]))
            source = index(np.concatenate([reads[j][1] for j in range(k - len(step), k)]))
            if not all(bool((c[:, landed] == h[:, source]).all()) for c, h in zip(cache, held)):  # (K/V, blocks, ...)
                raise SystemExit(f"step {i}: a read's bytes differ from the producer's")
            for c in cache:
                c[:, landed] = 0  # the next step that lands there must write it again
    stop.set()
    proc.join(10)
    med = statistics.median
    print(f"{args.device}: {args.batch} token reads x {per} blocks a step: read_many {med(in_call) * 1e6:.0f} us of the caller's CPU "
          f"(mean {statistics.mean(in_call) * 1e6:.0f}), "
          f"the waits {med(in_waits) * 1e6:.0f} us, call to last wait {med(walls) * 1e6:.0f} us (medians of {args.n})")
    print(f"call to the step's first post or launch: {med(to_move) * 1e6:.0f} us (median; p10 "
          f"{sorted(to_move)[len(to_move) // 10] * 1e6:.0f}, p90 {sorted(to_move)[len(to_move) * 9 // 10] * 1e6:.0f})")
    print(collector.line(args.n))
    if profile is not None:
        import pstats

        stats = pstats.Stats(profile)
        if args.dump:
            stats.dump_stats(args.dump)
        print(f"{stats.total_calls / args.n:.0f} Python calls a step (profiled)")
        stats.sort_stats(args.sort).print_stats(30)


class _Moves(list):
    profile = None


def _watch_first_move() -> list:
    """A list that gets the ``perf_counter`` of the step's first backend post or kernel launch
    (the caller clears it before each step): the Python before the move starts."""
    from kvxfer.backend.nixl import NixlBackend
    from kvxfer.engine.paths.kit import PathKit

    first = _Moves()
    for cls, name in ((NixlBackend, "post_prepared"), (PathKit, "launch_and_record")):
        real = getattr(cls, name)

        def watched(self, *a, _real=real, **kw):
            if not first:
                first.append(time.perf_counter())
                if first.profile is not None:
                    first.profile.disable()
            return _real(self, *a, **kw)
        setattr(cls, name, watched)
    return first


if __name__ == "__main__":
    main()
