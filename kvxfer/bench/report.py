"""Tables, ratios and plots of a ``kvxfer bench`` report (layer: bench app; matplotlib lazily)."""

from __future__ import annotations

import json
import statistics
from typing import Any

__all__ = ["add_ratios", "table", "write_json", "plot"]

#: Baselines each row is compared with, when the run measured them (same tokens, same run).
BASELINES = ("peer-copy", "nixl-1desc", "nixl-per-block", "mooncake-batch")
#: One-read rows whose better GB/s is ``vs_best_1desc``'s baseline (the link as a library reads it).
ONE_READ = ("nixl-1desc", "mooncake-1desc")


def add_ratios(report: dict) -> dict:
    """Add ``vs_<baseline>`` (this row's GB/s over the baseline's) to every timed row.

    When both rows ran the same number (> 1) of interleaved rounds, the ratio is the median of
    the per-round ratios (``vs_<baseline>_rounds`` lists them): each pair was measured minutes
    apart at most, so the machine's drift cancels. Otherwise it is the ratio of the two medians.
    """
    by_tokens: dict[int, dict[str, dict]] = {}
    for row in report["rows"]:
        if "gbps" in row:
            by_tokens.setdefault(row["tokens"], {})[row["method"]] = row
    for row in report["rows"]:
        base = by_tokens.get(row["tokens"], {})
        for name in BASELINES:
            if "gbps" in row and name in base and row["method"] != name:
                paired = _paired(base[name].get("round_medians_s"), row.get("round_medians_s"))
                if paired:
                    row[f"vs_{name}_rounds"] = paired
                    row[f"vs_{name}"] = statistics.median(paired)
                else:
                    row[f"vs_{name}"] = row["gbps"] / base[name]["gbps"]
        best = max((base[m]["gbps"] for m in ONE_READ if m in base), default=None)
        if "gbps" in row and best and row["method"] not in ONE_READ:
            row["vs_best_1desc"] = row["gbps"] / best
    return report


def _paired(base_s: list[float] | None, row_s: list[float] | None) -> list[float]:
    """Per-round speed ratios (baseline time / row time), or ``[]`` unless both have >1 round."""
    if not base_s or not row_s or len(base_s) != len(row_s) or len(row_s) < 2:
        return []
    return [b / r for b, r in zip(base_s, row_s)]


def table(report: dict) -> str:
    """A fixed-width text table of every row, ratios included."""
    present = [b for b in BASELINES + ("best_1desc",) if any(f"vs_{b}" in r for r in report["rows"])]
    head = ["tokens", "method", "MiB", "median ms", "GB/s", "verified"] + [f"/ {b}" for b in present]
    lines = []
    for r in report["rows"]:
        if "gbps" not in r:
            why = r.get("skipped") or ("ERROR " + r.get("error", "?").strip().splitlines()[-1][:100])
            lines.append([_tokens_cell(r), r["method"], f"{r['bytes'] / 2**20:.0f}", "-", "-", why])
            continue
        cells = [_tokens_cell(r), r["method"], f"{r['bytes'] / 2**20:.0f}", f"{r['median_s'] * 1e3:.3f}",
                 f"{r['gbps']:.1f}", f"{r['verified']}/{r['verified'] + r['failed']}"]
        cells += [_ratio_cell(r, b) for b in present]
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *[ln + [""] * (len(head) - len(ln)) for ln in lines])]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(ln) for ln in lines])


def _ratio_cell(row: dict, baseline: str) -> str:
    """``0.97``, or ``0.97 (0.85-1.10)`` with the spread of paired rounds."""
    if f"vs_{baseline}" not in row:
        return ""
    cell = f"{row[f'vs_{baseline}']:.2f}"
    rounds = row.get(f"vs_{baseline}_rounds")
    return cell + (f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds else "")


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_plain)


def _plain(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def plot(report: dict, path: str) -> None:
    """GB/s against tokens per request, one line per method (needs matplotlib)."""
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = sorted({r["method"] for r in report["rows"] if "gbps" in r})
    for m in methods:
        pts = sorted((r["tokens"], r["gbps"]) for r in report["rows"] if r["method"] == m and "gbps" in r)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per request")
    ax.set_ylabel("GB/s")
    sc = report.get("scenario", {})
    ax.set_title(f"kvxfer bench: {sc.get('name', '')} ({report['config'].get('preset')}, "
                 f"{report['config'].get('ids')} ids)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tokens_cell(row: dict) -> str:
    """``2048``, or ``32x256`` for a ``--batch`` step of 32 requests of 256 tokens."""
    n = row.get("requests", 1)
    return f"{n}x{row['tokens']}" if n > 1 else str(row["tokens"])
