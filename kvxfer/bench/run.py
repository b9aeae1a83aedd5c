"""Orchestrates one ``kvxfer bench`` run: start one process per agent, time every method on the same request (layer: bench app).

``run_bench(BenchConfig)`` returns a JSON-ready dict: the configuration, the machine, and one
row per (tokens, method) with every timed iteration, its median, GB/s and the verification
counts. All rows of one run share processes, caches and block ids, so ratios are like for like.
With ``rounds > 1`` the whole method list runs that many times in turn (A B C A B C ...) and each
row keeps its per-round medians, so ``report.add_ratios`` can pair rounds: on a shared host
whose speed drifts, a ratio of two medians taken minutes apart says more about the drift.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.bench.scenarios import PRESETS, Scenario, block_ids, build_scenario
from kvxfer.errors import ConfigError

__all__ = ["BenchConfig", "run_bench", "GPU_METHODS", "CPU_METHODS"]

GPU_METHODS = ("peer-copy", "nixl-1desc", "nixl-per-block", "kvxfer-staged", "kvxfer-ipc", "kvxfer-agent")
CPU_METHODS = ("memcpy", "nixl-1desc", "nixl-per-block", "mooncake-batch", "mooncake-1desc", "kvxfer-agent")


@dataclass
class BenchConfig:
    """Everything one run needs (the CLI fills it)."""

    preset: str = "llama-3-8b"
    geometry: dict = field(default_factory=dict)
    scenario: str = "same"
    ids: str = "fragmented"
    device: str = "gpu"
    op: str = "read"
    tokens: tuple[int, ...] = (8192,)
    block_size: int = 16
    iters: int = 10
    warmup: int = 2
    rounds: int = 1   # the method list runs this many times, interleaved (see ``_run_tokens``)
    methods: tuple[str, ...] = ()
    producer_gpu: int = 1
    consumer_gpu: int = 0
    slot_bytes: int = 256 << 20
    slots: int = 4
    piece_bytes: tuple[int, ...] = (0,)
    seed: int = 1234
    cache_factor: int = 0  # cache blocks per request block; 0: 4 on GPU, 2 on CPU (host RAM is smaller)
    port: int = 0
    progress: bool = True
    transfer_path: str = "auto"   # kvxfer-agent: the Agent's transfer_path (--gpu-path)
    # Two-hosts runs (kvxfer.bench.twohosts): (producer, consumer) ``hosts.Host`` whose namespaces
    # the processes enter; ``env``: extra environment for every process (e.g. UCX_TLS=tcp).
    hosts: tuple | None = None
    env: dict = field(default_factory=dict)
    producer_path: str | None = None  # the producer Agent's own transfer_path (None: as transfer_path)
    # ``--batch``: each timed iteration is one step of this many requests of ``tokens`` each (the
    # kvxfer rows submit them together; the baselines move the same bytes in one post)
    batch: int = 1
    # ``--busy-engine --two-hosts`` (kvxfer.bench.busyhosts): the share of the producer's main thread
    # that runs Python while a row is measured (0: idle)
    busy: float = 0.0

    def model(self) -> dict:
        if self.preset == "custom":
            return dict(self.geometry)
        if self.preset not in PRESETS:
            raise ConfigError(f"preset must be one of {sorted(PRESETS) + ['custom']}; got {self.preset!r}")
        return {**PRESETS[self.preset], **self.geometry}


class _Proc:
    def __init__(self, ctx: Any, label: str, host: Any = None, extra_env: dict | None = None) -> None:
        self.label = label
        self.conn, child = ctx.Pipe()
        from kvxfer.bench.worker import worker_main  # noqa: PLC0415

        env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "CUDA_", "KVXFER_UCX"))}
        env.update(extra_env or {})
        self.proc = ctx.Process(target=worker_main, args=(child, env, host), name=label, daemon=True)
        self.proc.start()

    def send(self, cmd: str, **kwargs: Any) -> None:
        self.conn.send((cmd, kwargs))

    def recv(self, timeout: float = 600.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.label}: no reply in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.label} failed:\n{value}")
        return value

    def call(self, cmd: str, **kwargs: Any) -> Any:
        self.send(cmd, **kwargs)
        return self.recv()

    def stop(self) -> None:
        try:
            self.send("exit")
            self.recv(60)
        except Exception:  # the process may already be gone; reap it below
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _say(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[kvxfer bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(result: dict, nbytes: int) -> dict:
    times = result.get("times") or []
    if not times:
        return result
    med = statistics.median(times)
    q = sorted(times)
    return {**result, "median_s": med, "min_s": q[0], "max_s": q[-1], "gbps": nbytes / med / 1e9}


def run_bench(cfg: BenchConfig) -> dict:
    """Run every method of ``cfg`` on the same caches and requests; returns the report dict."""
    if cfg.rounds < 1 or cfg.iters < 1 or cfg.batch < 1:
        raise ConfigError(f"rounds, iters and batch must be >= 1; got rounds={cfg.rounds}, iters={cfg.iters}, "
                          f"batch={cfg.batch}")
    if cfg.batch > 1 and any(t % cfg.block_size for t in cfg.tokens):
        raise ConfigError(f"--batch needs --tokens in whole blocks of {cfg.block_size} (each request "
                          f"of the step owns its blocks); got {cfg.tokens}")
    gpu = cfg.device == "gpu"
    # "kvxfer-staged" follows --op; the raw NIXL baselines always READ (NIXL moves both ways alike).
    methods = tuple(f"kvxfer-staged-{cfg.op}" if m == "kvxfer-staged" else m
                    for m in (cfg.methods or (GPU_METHODS if gpu else CPU_METHODS)))
    max_tokens = max(cfg.tokens) * cfg.batch   # a step's blocks, all distinct
    factor = cfg.cache_factor or (4 if gpu else 2)
    scen = build_scenario(cfg.scenario, cfg.model(), max_tokens, cfg.block_size, factor)
    dev_c = f"cuda:{cfg.consumer_gpu}" if gpu else "cpu"
    dev_p = f"cuda:{cfg.producer_gpu}" if gpu else "cpu"
    link_bytes = dataclasses.replace(scen, tokens=max_tokens).request_bytes
    ctx = mp.get_context("spawn")
    port = cfg.port or _free_port()
    report: dict = {"config": {**dataclasses.asdict(cfg), "methods": list(methods)},
                    "machine": _machine(gpu), "scenario": _describe(scen), "rows": []}
    _say(cfg, f"starting {1 + len(scen.producers)} processes ({dev_p} -> {dev_c})")
    p_host, c_host = cfg.hosts or (None, None)
    consumer = _Proc(ctx, "consumer", c_host, cfg.env)
    producers = [_Proc(ctx, f"producer{i}", p_host, cfg.env) for i in range(len(scen.producers))]
    procs = [consumer, *producers]
    try:
        n = len(producers)
        consumer.send("setup", name="bench-c", spec=scen.consumer, device=dev_c, seed=cfg.seed,
                      link_bytes=link_bytes, slot_bytes=cfg.slot_bytes, slots=cfg.slots * n, ipc=False)
        for i, (p, spec) in enumerate(zip(producers, scen.producers)):
            p.send("setup", name=f"bench-p{i}", spec=spec, device=dev_p, seed=cfg.seed + 100 * (i + 1),
                   link_bytes=link_bytes // n, slot_bytes=cfg.slot_bytes, slots=cfg.slots, ipc=gpu)
        c_info = consumer.recv()
        p_infos = [p.recv() for p in producers]
        for info in p_infos:
            info["map_ipc"] = gpu
        consumer.call("connect", peers=p_infos)
        for p in producers:
            p.call("connect", peers=[c_info])
        _say(cfg, "agents connected; caches filled with seeded random bytes")
        for tokens in sorted(cfg.tokens):
            _run_tokens(cfg, scen, tokens, methods, consumer, producers, p_infos, port, report, dev_p)
    finally:
        for p in procs:
            p.stop()
    return report


def _run_tokens(cfg, scen: Scenario, tokens: int, methods, consumer, producers, p_infos, port,
                report, dev_p) -> None:
    sc = dataclasses.replace(scen, tokens=tokens * cfg.batch)  # the step: batch requests' blocks
    nbytes = sc.request_bytes
    p_ids = block_ids(sc.producer_blocks, scen.producers[0].num_blocks, cfg.ids, cfg.seed + tokens)
    c_ids = block_ids(sc.consumer_blocks, scen.consumer.num_blocks, cfg.ids, cfg.seed + 2 * tokens + 1)
    requests = [{"name": info["name"], "spec": info["spec"], "seed": info["seed"], "ids": p_ids,
                 "local_ids": c_ids, "consumer_spec": scen.consumer,
                 "remote_slots": (i * cfg.slots, cfg.slots)} for i, info in enumerate(p_infos)]
    step_tokens = sc.tokens   # what the methods move per timed iteration (all of a step's requests)
    got = consumer.call("expect", requests=requests, tokens=step_tokens)
    _say(cfg, f"tokens={tokens}: {nbytes / 2**20:.1f} MiB per request, expected cache built "
              f"({got['changed_bytes']} bytes differ from background)")
    twin = None
    if scen.producers[0].layout is not scen.consumer.layout:
        twin = scen.producers[0].layout.value
        consumer.call("expect", requests=requests, tokens=step_tokens, twin_layout=twin)
    rows: dict[str, dict] = {}
    for rnd in range(cfg.rounds):
        for method in methods:
            for piece in (cfg.piece_bytes if method.startswith("kvxfer-staged") else (0,)):
                label = method + (f"@{piece >> 20}MiB" if piece else "")
                when = f" round {rnd + 1}/{cfg.rounds}" if cfg.rounds > 1 else ""
                _say(cfg, f"tokens={tokens}: {label} x{cfg.iters} (+{cfg.warmup} warm-up){when}")
                path = method.rsplit("-", 1)[1] if method.startswith("kvxfer-agent-") else cfg.transfer_path
                options = {"request_bytes": nbytes, "twin": twin, "port": port, "piece_bytes": piece,
                           "run": f"{tokens}-{label}-{rnd}", "transfer_path": path,
                           "slot_bytes": cfg.slot_bytes if cfg.device == "gpu" else 0, "slots": cfg.slots,
                           "batch": cfg.batch, "busy": cfg.busy,
                           **_addresses(cfg)}
                t0 = time.monotonic()
                res = _measure(cfg, method, options, consumer, producers, requests, step_tokens, dev_p,
                               nbytes)
                res["wall_s"] = time.monotonic() - t0
                row = rows.setdefault(label, {"tokens": tokens, "method": label, "bytes": nbytes,
                                              "requests": cfg.batch})
                _merge_round(row, res)
                _say(cfg, "   " + _short({**row, **_summary(res, nbytes)}))
    for row in rows.values():
        report["rows"].append({**row, **_summary(row, nbytes)})


def _measure(cfg, method, options, consumer, producers, requests, tokens, dev_p, nbytes) -> dict:
    """One method, ``cfg.iters`` timed iterations; errors come back as ``{"error": ...}``."""
    try:
        if method == "peer-copy":
            return consumer.call("peer_copy", src_device=dev_p, nbytes=nbytes, iters=cfg.iters,
                                 warmup=cfg.warmup)
        ready = []  # e.g. hold the requests the consumer will claim; a peer engine's address
        for p, req in zip(producers, requests):
            ready.append(p.call("prepare", method=method, consumer="bench-c", request=req, tokens=tokens,
                                rounds=cfg.iters + cfg.warmup, options=options))
        for p, req in zip(producers, requests):
            p.send("serve", method=method, consumer="bench-c", request=req, tokens=tokens,
                   rounds=cfg.iters + cfg.warmup, options=options)
        try:
            res = consumer.call("measure", method=method, tokens=tokens,
                                requests=[{**req, "prepared": r} for req, r in zip(requests, ready)],
                                iters=cfg.iters, warmup=cfg.warmup, options=options)
        except Exception as exc:  # the consumer's error first; then reap the producers
            res = {"error": str(exc)[-3000:]}
        for p in producers:  # ends a serve that runs until told (``drive``)
            p.send("release")
        for p in producers:  # every producer replies once per serve and once per release, error or not
            for _ in range(2):
                try:
                    p.recv(timeout=300)
                except Exception as exc:
                    res.setdefault("producer_errors", []).append(str(exc)[-1500:])
        if res.get("producer_errors") and "error" not in res:  # e.g. it never learnt a read was done
            res["error"] = "producer failed: " + res["producer_errors"][0]
        return res
    except Exception as exc:  # one failing method must not hide the others' figures
        return {"error": str(exc)[-2000:]}


def _addresses(cfg: BenchConfig) -> dict:
    """Where the producer listens and the consumer binds (two hosts: their namespaces' addresses)."""
    out: dict = {"producer_path": cfg.producer_path}
    if cfg.hosts:
        out.update(producer_host=cfg.hosts[0].address, consumer_host=cfg.hosts[1].address,
                   consumer_device=cfg.hosts[1].device)
    return out


def _merge_round(row: dict, res: dict) -> None:
    """Fold one round's result into the method's row: times appended, counts added, the round's
    median kept (``round_medians_s``); the first error is kept and ends the row's figures."""
    if "error" in row:
        return
    if "error" in res or not res.get("times"):
        for key in ("times", "round_medians_s"):
            row.pop(key, None)
        row.update({k: v for k, v in res.items() if k != "times"})
        return
    row.setdefault("times", []).extend(res["times"])
    row.setdefault("round_medians_s", []).append(statistics.median(res["times"]))
    for key, value in res.items():
        if key in ("verified", "failed", "wall_s", "total_over_wall"):
            row[key] = row.get(key, 0) + value
        elif key == "modes":
            row[key] = sorted(set(row.get(key, [])) | set(value))
        elif isinstance(value, float):  # per-round details (setup_ms, claim_ms, ...): their median
            row.setdefault("per_round", {}).setdefault(key, []).append(value)
            row[key] = statistics.median(row["per_round"][key])
        elif key != "times":
            row[key] = value


def _short(row: dict) -> str:
    if "error" in row:
        return f"{row['method']}: ERROR " + " | ".join(row["error"].strip().splitlines()[-6:])[:900]
    if "skipped" in row:
        return f"{row['method']}: skipped ({row['skipped']})"
    modes = f", path {'/'.join(row['modes'])}" if row.get("modes") else ""
    if row.get("gap_ms") is not None:  # kvxfer-first-read
        modes += (f", handshake {row.get('handshake_ms', 0):.1f} ms, first {row['first_ms']:.1f} ms, "
                  f"warm {row['warm_ms']:.1f} ms, first - warm {row['gap_ms']:.1f} ms")
    if row.get("setup_ms") is not None:
        modes += (f", setup {row['setup_ms']:.3f} ms (claims {row['claim_ms']:.3f}), "
                  f"post to done {row['posted_ms']:.3f} ms")
    if row.get("total_vs_wall") is not None:  # TransferStats against the bench's own clock
        modes += (f", stats total/wall {row['total_vs_wall']:.2f} (over: {row.get('total_over_wall', 0)}), "
                  f"posted/wall {row['posted_vs_wall']:.2f}")
    return (f"{row['method']}: {row['gbps']:.1f} GB/s, median {row['median_s'] * 1e3:.3f} ms, "
            f"verified {row['verified']}/{row['verified'] + row['failed']}{modes}")


def _describe(s: Scenario) -> dict:
    c = s.consumer
    return {"name": s.name, "consumer": repr(c), "producers": [repr(p) for p in s.producers],
            "layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "dtype": c.dtype, "block_size": c.block_size, "mla": c.mla}


def _machine(gpu: bool) -> dict:
    out = {"host": platform.node(), "python": platform.python_version(), "commit": _commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpus": os.cpu_count()}
    try:
        import torch  # noqa: PLC0415

        out["torch"] = torch.__version__
        if gpu and torch.cuda.is_available():
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return out


def _commit() -> str | None:
    """The kvxfer checkout's commit (``+dirty`` with uncommitted changes), or None outside git."""
    import subprocess  # noqa: PLC0415

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
