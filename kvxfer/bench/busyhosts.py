"""``kvxfer bench --busy-engine --two-hosts``: a fragmented read across two namespaces with the
producer's main thread busy in Python (layer: bench app).

The issue-35 goal's rows, in one run and fresh processes (``kvxfer.bench.run``), the producer in one
network namespace and the consumer in the other, UCX over TCP (``kvxfer.bench.hosts``; needs root):

* ``nixl-per-block``: raw NIXL, one descriptor per layer x K/V x block, as stock vLLM posts it: no
  producer CPU (and no protection against reused blocks);
* ``kvxfer-agent-direct``: ``Agent.read`` with the claim (the producer's interpreter answers it);
* ``kvxfer-token-direct``: ``Agent.read`` with the producer's hold token: no claim; the hold word is
  read with one small NIXL READ once the move completed.

While each row is measured the producer's main thread runs Python (``BenchConfig.busy`` = 1.0: a
loop of 1 ms spins; raw NIXL's producer polls its agent between spins when it runs no NIXL progress
thread, as kvxfer's does). Every read is checked byte for byte. ``vs_per_block`` is a row's GB/s
over ``nixl-per-block``'s at the same tokens in the same run.
"""

from __future__ import annotations

import dataclasses
import os

from kvxfer.bench.hosts import two_hosts
from kvxfer.bench.report import _tokens_cell
from kvxfer.bench.run import BenchConfig, run_bench

__all__ = ["METHODS", "add_per_block", "run_busy_two_hosts", "table"]

METHODS = ("nixl-per-block", "kvxfer-agent-direct", "kvxfer-token-direct")


def run_busy_two_hosts(cfg: BenchConfig, progress_thread: str = "auto", busy: float = 1.0) -> dict:
    """The rows of ``METHODS`` (or ``cfg.methods``) between two namespaces with the producer busy;
    ``progress_thread``: KVXFER_NIXL_PROGRESS_THREAD for every agent (auto, on, off). Raises
    ``HostsUnavailableError`` when namespaces cannot be made."""
    env = {} if "UCX_TLS" in os.environ else {"UCX_TLS": "tcp"}
    env["KVXFER_NIXL_PROGRESS_THREAD"] = {"on": "1", "off": "0"}.get(progress_thread, "auto")
    with two_hosts() as hosts:
        run = dataclasses.replace(cfg, device="cpu", scenario="same", methods=cfg.methods or METHODS,
                                  hosts=hosts, env=env, producer_path="staged", busy=busy)
        report = run_bench(run)
    report["config"].pop("hosts", None)
    report["env"] = env
    report["busy"] = busy
    return add_per_block(report)


def add_per_block(report: dict) -> dict:
    """``vs_per_block`` on every timed row: its GB/s over ``nixl-per-block``'s at the same tokens."""
    base = {r["tokens"]: r["gbps"] for r in report["rows"] if r["method"] == "nixl-per-block" and "gbps" in r}
    for row in report["rows"]:
        if "gbps" in row and row["tokens"] in base:
            row["vs_per_block"] = row["gbps"] / base[row["tokens"]]
    return report


def table(report: dict) -> str:
    head = ["tokens", "method", "MiB", "median ms", "GB/s", "/ nixl-per-block", "verified", "notes"]
    lines = [head]
    for r in report["rows"]:
        if "gbps" not in r:
            lines.append([_tokens_cell(r), r["method"], f"{r['bytes'] / 2**20:.0f}", "-", "-", "-", "-",
                          "ERROR " + (r.get("error") or "?").strip().splitlines()[-1][:100]])
            continue
        notes = ("path " + "/".join(r["modes"]) if r.get("modes") else "") + (
            f", claim {r['claim_ms']:.2f} ms" if r.get("claim_ms") else "")
        lines.append([_tokens_cell(r), r["method"], f"{r['bytes'] / 2**20:.0f}", f"{r['median_s'] * 1e3:.1f}",
                      f"{r['gbps']:.2f}", f"{r['vs_per_block']:.2f}" if "vs_per_block" in r else "-",
                      f"{r['verified']}/{r['verified'] + r['failed']}", notes])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in lines)
