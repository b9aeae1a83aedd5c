"""P/D benchmark against real vLLM: one workload through several connector configs, in one run.

For each config it starts a prefill and a decode server (tiny real model, CPU, bound to
core 0 and 1), checks that every P/D answer equals the single-instance answer, then
reports end-to-end latency (median, p90) and, where the decode server exports them, the
connector's transfer figures (transfer time, bytes, descriptors) from /metrics.

    python benchmarks/vllm_pd.py                       # stock NixlConnector vs KvxferConnector
    python benchmarks/vllm_pd.py --connectors NixlConnector --prompt-len 512 --requests 40

Figures are comparable only within one run on one machine (other load skews both sides).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from vllm_harness import (  # noqa: E402  (the harness lives beside the tests that share it)
    Client, VllmServer, free_port, make_tiny_model, prompt_of, route_pd, start_all,
)

#: kv_transfer_config of each connector the benchmark knows.
CONNECTORS: dict[str, dict] = {
    "NixlConnector": {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                      "kv_buffer_device": "cpu"},
    "KvxferConnector": {"kv_connector": "KvxferConnector", "kv_role": "kv_both",
                        "kv_buffer_device": "cpu"},
}

#: Prometheus series the stock connector's decode server exports about transfers.
NIXL_SERIES = ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred", "vllm:nixl_num_descriptors")

#: The line KvxferConnector's decode worker logs per completed read.
KVXFER_READ = re.compile(r"kvxfer read \S+: (\d+) bytes, (\d+) descriptors, ([0-9.]+) ms")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def transfer_figures(d: VllmServer) -> dict[str, float]:
    """Per-transfer means (time, bytes, descriptors): NIXL's Prometheus series, else kvxfer's log lines."""
    c = d.client()
    count = c.metric(NIXL_SERIES[0] + "_count")
    if count:
        return {"transfers": count, "xfer_ms_mean": 1e3 * c.metric(NIXL_SERIES[0] + "_sum") / count,
                "bytes_mean": c.metric(NIXL_SERIES[1] + "_sum") / count,
                "descs_mean": c.metric(NIXL_SERIES[2] + "_sum") / count}
    reads = [tuple(map(float, m.groups())) for m in KVXFER_READ.finditer(d.log_text())]
    if not reads:
        return {}
    return {"transfers": len(reads), "xfer_ms_mean": statistics.mean(r[2] for r in reads),
            "xfer_ms_median": statistics.median(r[2] for r in reads),
            "bytes_mean": statistics.mean(r[0] for r in reads),
            "descs_mean": statistics.mean(r[1] for r in reads)}


def run_config(name: str, model: Path, logs: Path, args: argparse.Namespace) -> dict:
    """Start one P/D pair with connector ``name``, run the workload, stop it; return the figures."""
    config = json.dumps(CONNECTORS[name])
    side = free_port(8)
    common = ("--block-size", str(args.block_size), "--kv-transfer-config", config)
    p = VllmServer(f"bench-{name}-prefill", model, logs, "0", common,
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
    d = VllmServer(f"bench-{name}-decode", model, logs, "1", common,
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side + 4)})
    start_all([p, d], timeout=args.start_timeout)
    try:
        pc, dc = p.client(), d.client()
        prompts = [prompt_of(args.prompt_len, seed=1000 + i) for i in range(args.requests + args.warmup)]
        mismatches, latencies = 0, []
        for i, prompt in enumerate(prompts):
            ref = pc.complete(prompt, args.max_tokens).token_ids
            t0 = time.perf_counter()
            got = route_pd(pc, dc, prompt, args.max_tokens).token_ids
            dt = time.perf_counter() - t0
            mismatches += got != ref
            if i >= args.warmup:
                latencies.append(dt)
        return {
            "connector": name, "requests": len(latencies), "mismatches": mismatches,
            "latency_ms_median": 1e3 * statistics.median(latencies),
            "latency_ms_p90": 1e3 * percentile(latencies, 0.9),
            **transfer_figures(d),
        }
    finally:
        d.stop()
        p.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=list(CONNECTORS))
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--logs", type=Path, default=None, help="keep server logs here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        logs = args.logs or Path(tmp) / "logs"
        rows = [run_config(name, model, logs, args) for name in args.connectors]
    for row in rows:
        print(json.dumps(row))
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
