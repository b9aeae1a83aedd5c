"""``kvxfer bench``: measure kvxfer against raw NIXL and the link limit in one run (layer: bench app).

Example (two GPUs of one host, Llama-3-8B shape, fragmented block ids, 8k tokens)::

    kvxfer bench --preset llama-3-8b --scenario same --ids fragmented --device gpu \\
        --tokens 8192 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from kvxfer.bench.report import add_ratios, plot, table, write_json
from kvxfer.bench.run import CPU_METHODS, GPU_METHODS, BenchConfig, run_bench
from kvxfer.bench.scenarios import PRESETS, SCENARIOS
from kvxfer.errors import KvxferError

__all__ = ["main", "parser"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def _mib(text: str) -> tuple[int, ...]:
    return tuple(x << 20 for x in _ints(text))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS) + ["custom"],
                   help="model cache shape; 'custom' takes --layers/--kv-heads/--head-dim/--dtype")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype")
    p.add_argument("--mla", action="store_true", help="replicated latent cache (K only)")
    p.add_argument("--scenario", default="same", choices=sorted(SCENARIOS))
    p.add_argument("--ids", default="fragmented", choices=("contiguous", "fragmented"))
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--op", default="read", choices=("read", "write"),
                   help="direction of kvxfer's staged path (raw NIXL baselines READ)")
    p.add_argument("--tokens", type=_ints, default=(8192,), help="tokens per request; several = a sweep")
    p.add_argument("--batch", type=int, default=1,
                   help="requests per step: each timed iteration submits this many requests of --tokens "
                        "(Agent.read_many where the Agent has it) and waits for all; the baselines move "
                        "the same bytes in one post")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the method list this many times in turn (A B A B ...); ratios then pair "
                        "each round's medians, which holds up when a shared machine's speed drifts")
    p.add_argument("--methods", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                   help=f"default gpu: {','.join(GPU_METHODS)}; cpu: {','.join(CPU_METHODS)}")
    p.add_argument("--gpu-path", "--transfer-path", dest="transfer_path", default="auto",
                   choices=("auto", "ipc", "staged", "direct"),
                   help="kvxfer-agent: the Agent's transfer_path (auto picks per request)")
    p.add_argument("--producer-gpu", type=int, default=1)
    p.add_argument("--consumer-gpu", type=int, default=0)
    p.add_argument("--slot-mib", type=int, default=256, help="staging slot size (MiB)")
    p.add_argument("--slots", type=int, default=4, help="staging slots per peer")
    p.add_argument("--piece-mib", type=_mib, default=(0,),
                   help="staged piece sizes to try (MiB, comma-separated; 0 = one slot)")
    p.add_argument("--cache-factor", type=int, default=0,
                   help="cache size in requests (fragmented ids spread over it); 0: 4 on gpu, 2 on cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plot", help="write a GB/s vs tokens plot here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--busy-engine", action="store_true",
                   help="small reads while the engines are busy: a producer whose main thread is 0/50/100%% "
                        "busy in Python, a consumer that steps 4 ms at a time and polls; raw NIXL as stock "
                        "vLLM posts and polls it, in the same run (kvxfer.bench.busy; host memory); with "
                        "--two-hosts: a fragmented read across two namespaces with the producer busy, raw NIXL "
                        "per block against kvxfer with the claim and with the hold token (kvxfer.bench.busyhosts)")
    p.add_argument("--reads", type=int, default=20, help="--busy-engine: reads per row")
    p.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto",
                   help="NIXL's progress thread in every agent of the run (AgentConfig.nixl_progress_thread, "
                        "through KVXFER_NIXL_PROGRESS_THREAD for the spawned processes; --busy-engine: kvxfer's "
                        "agents only, raw NIXL always runs it, as vLLM does); auto: the environment's setting")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="--busy-engine: the interpreter's switch interval in both processes, seconds "
                        "(AgentConfig.switch_interval; default: CPython's 5 ms)")
    p.add_argument("--two-hosts", action="store_true",
                   help="producer and consumer in two network namespaces joined by a veth pair (needs "
                        "root; host memory, UCX over TCP): socket line, raw NIXL with UCX's and kvxfer's "
                        "TCP settings, kvxfer direct and staged, first contact (kvxfer.bench.twohosts)")
    return p


def config_from(args: argparse.Namespace) -> BenchConfig:
    geometry = {k: v for k, v in (("num_layers", args.layers), ("num_kv_heads", args.kv_heads),
                                  ("head_dim", args.head_dim), ("dtype", args.dtype)) if v is not None}
    if args.mla:
        geometry["mla"] = True
    return BenchConfig(preset=args.preset, geometry=geometry, scenario=args.scenario, ids=args.ids,
                       device=args.device, op=args.op, tokens=args.tokens, block_size=args.block_size,
                       iters=args.iters, warmup=args.warmup, rounds=args.rounds, methods=args.methods,
                       producer_gpu=args.producer_gpu, consumer_gpu=args.consumer_gpu,
                       slot_bytes=args.slot_mib << 20, slots=args.slots, piece_bytes=args.piece_mib,
                       seed=args.seed, cache_factor=args.cache_factor, progress=not args.quiet,
                       transfer_path=args.transfer_path, batch=args.batch)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the table (stdout). Returns 0, 1 if any timed transfer failed
    verification or a method errored, 2 for bad arguments."""
    args = parser().parse_args(argv)
    if args.busy_engine and args.two_hosts:
        return _busy_hosts(args, argv)
    if args.busy_engine:
        return _busy(args, argv)
    if args.nixl_progress_thread != "auto":  # the workers (and the two hosts' processes) read it from here
        os.environ["KVXFER_NIXL_PROGRESS_THREAD"] = "1" if args.nixl_progress_thread == "on" else "0"
    try:
        if args.two_hosts:
            from kvxfer.bench import twohosts  # noqa: PLC0415

            save = (lambda part: write_json(part, args.json)) if args.json else None
            report = twohosts.run_two_hosts(config_from(args), save)
        else:
            report = add_ratios(run_bench(config_from(args)))
    except KvxferError as exc:
        print(f"kvxfer bench: {exc}", file=sys.stderr)
        return 2
    # how to get this report again (scripts/bench_docs.py prints it above the tables it makes)
    report["command"] = "kvxfer bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    report["env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "KVXFER_", "MC_", "NIXL_"))}
    print(twohosts.table(report) if args.two_hosts else table(report))
    if args.json:
        write_json(report, args.json)
    if args.plot and not args.two_hosts:
        plot(report, args.plot)
    bad = [r for r in report["rows"] if r.get("failed") or "error" in r]
    if bad:
        print(json.dumps([{k: r.get(k) for k in ("tokens", "method", "failed", "error")} for r in bad]),
              file=sys.stderr)
    return 1 if bad else 0


def _busy_hosts(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--busy-engine --two-hosts``: a fragmented read across namespaces, the producer busy
    (``kvxfer.bench.busyhosts``: raw NIXL per block, kvxfer with the claim and with the hold token)."""
    from kvxfer.bench import busyhosts  # noqa: PLC0415

    try:
        report = busyhosts.run_busy_two_hosts(config_from(args), args.nixl_progress_thread)
    except KvxferError as exc:
        print(f"kvxfer bench --busy-engine --two-hosts: {exc}", file=sys.stderr)
        return 2
    report["command"] = "kvxfer bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(busyhosts.table(report))
    if args.json:
        write_json(report, args.json)
    bad = [r for r in report["rows"] if r.get("failed") or "error" in r]
    return 1 if bad else 0


def _busy(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--busy-engine``: the table of ``kvxfer.bench.busy`` (every read checked byte for byte)."""
    from kvxfer.bench import busy  # noqa: PLC0415

    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.quiet else (lambda line: None)
    try:
        thread = {"auto": None, "on": True, "off": False}[args.nixl_progress_thread]
        report = busy.run_busy(reads=args.reads, progress=progress, progress_thread=thread,
                               switch_interval=args.switch_interval)
    except RuntimeError as exc:
        print(f"kvxfer bench --busy-engine: {exc}", file=sys.stderr)
        return 1
    report["command"] = "kvxfer bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(busy.table(report))
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
