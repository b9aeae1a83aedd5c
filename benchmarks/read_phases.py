"""Where the time of one ``Agent.read`` goes on the consumer: the call itself (ids, path choice,
tables or kernel launch, claim round trip) and the wait for completion, with a cProfile of the
calls. Two processes (producer spawned), Llama-3-8B-shaped cache, fragmented block ids.

Run:  .venv/bin/python benchmarks/read_phases.py [--device cuda:0] [--tokens 8192] [--reads 40] [--profile] [--fine]
"""

import argparse
import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import time

import numpy as np

import kvxfer.agent.claims as claims_mod
import kvxfer.agent.core as core
import kvxfer.engine.paths.reading as reading
from kvxfer import Agent, AgentConfig, KVSpec

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", model="llama-3-8b")


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


def producer(spec, device, port, rids, ids, ready, stop) -> None:
    cache = _cache(spec, device, 1)
    with Agent("producer", spec, AgentConfig.from_env(side_channel_host="127.0.0.1", side_channel_port=port)) as ag:
        ag.register(cache)
        ag.listen()
        for rid in rids:
            ag.hold(rid, ids)
        ready.set()
        stop.wait(600)


SPANS: dict[str, list[float]] = {}


def _timed(name: str, fn):
    """``fn`` with each call's duration appended to ``SPANS[name]`` (no profiler: true times)."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS.setdefault(name, []).append(time.perf_counter() - t0)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reads", type=int, default=40)
    ap.add_argument("--port", type=int, default=5950)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--profile", action="store_true", help="also cProfile the calls (a second run: it inflates times)")
    ap.add_argument("--fine", action="store_true", help="also time the steps inside path choice and launch")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="pause between reads (the previous read's Done goes out in the background meanwhile)")
    args = ap.parse_args()
    blocks = args.tokens // SHAPE["block_size"]
    spec = KVSpec(**SHAPE, num_blocks=4 * blocks)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(4 * blocks)[:blocks], rng.permutation(4 * blocks)[:blocks]
    warm = 3
    rids = [f"r{i}" for i in range(args.reads + warm)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=producer, args=(spec, args.device, args.port, rids, src, ready, stop), daemon=True)
    proc.start()
    if not ready.wait(300):
        raise SystemExit("producer did not start")
    cache = _cache(spec, args.device, 2)
    core.plan_read = _timed("plan_read (ids, path choice, tables)", core.plan_read)
    reading.ReadRoute.start = _timed("ReadRoute.start (kernel launch / parts)", reading.ReadRoute.start)
    claims_mod.Claims.send = _timed("claim sent", claims_mod.Claims.send)
    claims_mod.Claims.answers = _timed("claim answers awaited (after start)", claims_mod.Claims.answers)
    if args.fine:  # inside the steps above (their own spans include these)
        import kvxfer.engine.paths.kit as kit_mod
        import kvxfer.engine.transfers as transfers_mod

        core.check_block_ids = _timed("  . id checks in Agent.read (each)", core.check_block_ids)
        reading.direct_pairs = _timed("  . direct_pairs (IPC tables)", reading.direct_pairs)
        kit_mod.PathKit.launch_and_record = _timed("  . launch_and_record (upload, launch, event)",
                                                   kit_mod.PathKit.launch_and_record)
        transfers_mod.TransferEngine.submit = _timed("  . engine submit", transfers_mod.TransferEngine.submit)
        if args.device != "cpu":
            import kvxfer.gpu.ops as ops

            ops.PairKernel.launch = _timed("  . . PairKernel.launch", ops.PairKernel.launch)
            ops.PairKernel._ids = _timed("  . . . id upload", ops.PairKernel._ids)
    calls, waits, claims, modes = [], [], [], set()
    prof = cProfile.Profile()
    cfg = AgentConfig.from_env(side_channel_host="127.0.0.1", side_channel_port=args.port + 1)
    with Agent("consumer", spec, cfg) as ag:
        ag.register(cache)
        for i, rid in enumerate(rids):
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)
            t0 = time.perf_counter()
            if i == warm:
                SPANS.clear()
            if i >= warm and args.profile:
                prof.enable()
            handle = ag.read(("127.0.0.1", args.port), dst, src, rid)
            if i >= warm and args.profile:
                prof.disable()
            t1 = time.perf_counter()
            stats = handle.wait(60)
            t2 = time.perf_counter()
            if i >= warm:
                calls.append(t1 - t0)
                waits.append(t2 - t1)
                claims.append(stats.claim_seconds)
                modes.add(stats.mode)
    stop.set()
    proc.join(30)
    med = statistics.median
    mib = spec.block_bytes * 2 * spec.num_layers * blocks / 2**20
    print(f"{args.device}, {args.tokens} tokens ({mib:.0f} MiB), path {sorted(modes)}, {len(calls)} reads:")
    print(f"  Agent.read call  median {med(calls) * 1e3:.3f} ms, of which:")
    for name, spans in SPANS.items():
        print(f"    {name:42s} median {med(spans) * 1e3:.3f} ms")
    print(f"  wait after call  median {med(waits) * 1e3:.3f} ms")
    print(f"  read + wait      median {med(c + w for c, w in zip(calls, waits)) * 1e3:.3f} ms")
    if args.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print("cProfile of the Agent.read calls (own time; profiling inflates the absolute times):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
