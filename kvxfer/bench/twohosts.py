"""``kvxfer bench --two-hosts``: the across-hosts figures in one run (layer: bench app).

Creates two network namespaces joined by a veth pair (``kvxfer.bench.hosts``; needs root), puts
the producer process in one (10.88.0.1) and the consumer in the other (10.88.0.2), forces UCX
onto TCP (``UCX_TLS=tcp`` unless the caller set ``UCX_TLS``: between namespaces of one machine
UCX would otherwise read through shared memory, which no second host offers), and runs the
method list twice on host-memory caches, each time in fresh processes because UCX reads its
environment once per process:

* ``ucx-defaults``: ``KVXFER_UCX_DEFAULTS=0``, UCX's own TCP settings (kvxfer before issue 16);
* ``kvxfer``: kvxfer's TCP defaults (``kvxfer.backend.ucx_env``), plus the raw TCP socket line
  and first contact (``FIRST_CONTACT``): a fresh producer and consumer pair whose first read
  handshakes inside it (``kvxfer-fresh-pair``), the first read after the producer restarted
  (``kvxfer-restart``; both in ``kvxfer.bench.firstcontact``), the first after a link cut
  (``kvxfer-relink``) and a new consumer's first read after ``connect()`` (``kvxfer-first-read``).

Every row carries ``setting``; ``vs_nixl_best`` is its GB/s over the best raw NIXL
single-descriptor figure (``nixl-1desc``) of the same run and tokens, ``vs_socket`` over the
socket line's. The namespaces are removed when the run ends, whatever happens.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from kvxfer.bench.hosts import two_hosts
from kvxfer.bench.report import _tokens_cell, add_ratios
from kvxfer.bench.run import BenchConfig, run_bench
from kvxfer.errors import ConfigError

__all__ = ["FIRST_CONTACT", "METHODS", "SETTINGS", "run_two_hosts", "table"]

#: (name, extra environment, methods) for each pass.
SETTINGS = (
    ("ucx-defaults", {"KVXFER_UCX_DEFAULTS": "0"},
     ("nixl-1desc", "nixl-per-block", "kvxfer-agent-direct", "kvxfer-agent-staged")),
    ("kvxfer", {},
     ("tcp-socket", "nixl-1desc", "nixl-per-block", "mooncake-batch", "mooncake-1desc", "kvxfer-agent-direct",
      "kvxfer-agent-staged", "kvxfer-agent", "kvxfer-new-process", "kvxfer-fresh-pair", "kvxfer-restart",
      "kvxfer-relink", "kvxfer-first-read")),
)
#: The methods whose rows compare a first read with a warm one (``first_ms``, ``warm_ms``, ``gap_ms``).
FIRST_CONTACT = ("kvxfer-new-process", "kvxfer-fresh-pair", "kvxfer-restart", "kvxfer-relink", "kvxfer-first-read")
#: Every method a two-hosts run knows (``--methods`` naming another is refused).
METHODS = tuple(dict.fromkeys(m for _, _, methods in SETTINGS for m in methods))


def run_two_hosts(cfg: BenchConfig, save: Callable[[dict], None] | None = None) -> dict:
    """Run every setting of ``SETTINGS`` between two namespaces; returns one merged report.

    ``cfg.methods``, when given, limits each setting to those of its methods; ``save`` is called
    with the report so far after each setting (a long run keeps what it measured). Raises
    ``HostsUnavailableError`` (a KvxferError) when namespaces cannot be made (not root).
    """
    unknown = [m for m in cfg.methods or () if m not in METHODS]
    if unknown:
        raise ConfigError(f"--two-hosts runs {', '.join(METHODS)}; got {', '.join(unknown)}")
    base_env = {} if "UCX_TLS" in os.environ else {"UCX_TLS": "tcp"}
    report: dict = {"rows": [], "settings": {}}
    with two_hosts() as hosts:
        for name, env, methods in SETTINGS:
            chosen = tuple(m for m in methods if not cfg.methods or m in cfg.methods)
            if not chosen:
                continue
            run = dataclasses.replace(cfg, device="cpu", scenario="same", methods=chosen, hosts=hosts,
                                      env={**base_env, **env}, producer_path="staged")
            part = run_bench(run)
            part["config"].pop("hosts", None)
            report["settings"][name] = {"env": run.env, "config": part["config"]}
            report.setdefault("machine", part["machine"])
            report.setdefault("scenario", part["scenario"])
            report["rows"] += [{**row, "setting": name} for row in part["rows"]]
            if save is not None:
                save(add_line_ratios(report))
    report["hosts"] = {"producer": hosts[0].address, "consumer": hosts[1].address, "link": "veth pair"}
    return add_line_ratios(report)


def add_line_ratios(report: dict) -> dict:
    """Add ``vs_nixl_best`` and ``vs_socket`` to every timed row (same tokens, same run)."""
    best: dict[int, float] = {}
    line: dict[int, float] = {}
    for row in report["rows"]:
        if "gbps" not in row:
            continue
        if row["method"] == "nixl-1desc":
            best[row["tokens"]] = max(best.get(row["tokens"], 0.0), row["gbps"])
        elif row["method"] == "tcp-socket":
            line[row["tokens"]] = row["gbps"]
    for setting in {row.get("setting") for row in report["rows"]}:  # kvxfer's own ratios, per setting
        add_ratios({"rows": [row for row in report["rows"] if row.get("setting") == setting]})
    for row in report["rows"]:
        if "gbps" in row and row["tokens"] in best:
            row["vs_nixl_best"] = row["gbps"] / best[row["tokens"]]
        if "gbps" in row and row["tokens"] in line:
            row["vs_socket"] = row["gbps"] / line[row["tokens"]]
    return report


def table(report: dict) -> str:
    """Fixed-width rows: tokens, setting, method, MiB, median ms, GB/s, ratios, first-contact figures."""
    head = ["tokens", "setting", "method", "MiB", "median ms", "GB/s", "/ nixl best", "/ socket",
            "/ mooncake-batch", "/ best 1-read", "verified", "notes"]
    lines = [head]
    for r in report["rows"]:
        if "gbps" not in r:
            why = r.get("skipped") or ("ERROR " + (r.get("error") or "?").strip().splitlines()[-1][:100])
            lines.append([_tokens_cell(r), r["setting"], r["method"], f"{r['bytes'] / 2**20:.0f}", "-", "-", "-",
                          "-", "-", "-", "-", why])
            continue
        notes = ""
        if r["method"] in FIRST_CONTACT:
            notes = (f"first {r['first_ms']:.1f} ms, warm {r['warm_ms']:.1f} ms, first - warm {r['gap_ms']:.1f} ms"
                     + (f", handshake {r['handshake_ms']:.1f} ms" if "handshake_ms" in r else "")
                     + (f", fresh producer {r['fresh_ms']:.1f} ms" if r.get("fresh_ms") else "")
                     + (f", first read's set-up (handshake included) {_median_phase(r, 'setup'):.1f} ms"
                        if r.get("phases_ms") else ""))
        elif r.get("modes"):
            notes = "path " + "/".join(r["modes"])
        lines.append([_tokens_cell(r), r["setting"], r["method"], f"{r['bytes'] / 2**20:.0f}",
                      f"{r['median_s'] * 1e3:.1f}", f"{r['gbps']:.2f}",
                      f"{r['vs_nixl_best']:.2f}" if "vs_nixl_best" in r else "-",
                      f"{r['vs_socket']:.2f}" if "vs_socket" in r else "-",
                      f"{r['vs_mooncake-batch']:.2f}" if "vs_mooncake-batch" in r else "-",
                      f"{r['vs_best_1desc']:.2f}" if "vs_best_1desc" in r else "-",
                      f"{r['verified']}/{r['verified'] + r['failed']}", notes])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in lines)


def _median_phase(row: dict, phase: str) -> float:
    """The median over a first-contact row's iterations of one first-read phase (ms)."""
    values = sorted(p[phase] for p in row["phases_ms"])
    return values[len(values) // 2]
