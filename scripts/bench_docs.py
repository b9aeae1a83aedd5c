#!/usr/bin/env python3
"""Regenerate the tables (and plots) of docs/benchmarks.md from `kvxfer bench --json` reports.

    python scripts/bench_docs.py            # rewrite every generated block in place
    python scripts/bench_docs.py --check    # exit 1 if a block differs from what its JSON gives

docs/benchmarks.md marks each generated block with a pair of HTML comments:

    <!-- bench: cpu-tcp -->            (the block is made from docs/bench/cpu-tcp.json)
    ...generated: command, machine, table...
    <!-- /bench -->

To refresh a table, rerun the command printed in its block with `--json docs/bench/NAME.json`
(and `--plot`, where the block shows a plot), then run this script. A JSON may carry a
"carried" note (figures transcribed from an older run's table, no per-iteration times kept):
its block says so. Standard library only; plots need matplotlib (skipped with a note if absent).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
DATA = ROOT / "docs" / "bench"
IMG = ROOT / "docs" / "img"
BLOCK = re.compile(r"(<!-- bench: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.S)
#: Ratio columns, in order: (row key, header). A column appears only when some row has it.
#: A line row (memcpy, tcp-socket, peer-copy) gets no ratios: it is what the others are measured by.
RATIOS = (("vs_memcpy", "/ memcpy"), ("vs_socket", "/ socket"), ("vs_peer-copy", "/ peer-copy"),
          ("vs_nixl-per-block", "/ nixl-per-block"), ("vs_mooncake-batch", "/ mooncake-batch"),
          ("vs_best_1desc", "/ best one read"))
LINES = ("memcpy", "tcp-socket", "peer-copy")
FIRST_CONTACT = ("kvxfer-new-process", "kvxfer-fresh-pair", "kvxfer-restart", "kvxfer-relink", "kvxfer-first-read")
FIRST_CASES = {"kvxfer-new-process": "new producer and consumer processes, no `connect()`",
               "kvxfer-fresh-pair": "fresh producer and consumer, no `connect()`",
               "kvxfer-restart": "first read after the producer restarted",
               "kvxfer-relink": "first read after a link cut",
               "kvxfer-first-read": "new consumer, `connect()` first (the handshake not in the time)"}


def _num(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def _tokens(row: dict) -> str:
    n = row.get("requests", 1)
    return f"{n} x {row['tokens']:,}" if n > 1 else f"{row['tokens']:,}"


def _add_line_ratio(report: dict, line: str) -> None:
    """``vs_<line>`` for rows of the same tokens (and setting), from the medians."""
    base = {(r["tokens"], r.get("setting")): r["gbps"] for r in report["rows"]
            if r["method"] == line and "gbps" in r}
    for r in report["rows"]:
        key = (r["tokens"], r.get("setting"))
        if "gbps" in r and key in base and r["method"] != line:
            r[f"vs_{line}"] = r["gbps"] / base[key]


def _pairs(row: dict) -> str:
    warm = row.get("warm_times") or [None] * len(row["times"])
    return ", ".join(f"{f * 1e3:.0f}" + (f" / {w * 1e3:.0f}" if w is not None else "")
                     for f, w in zip(row["times"], warm))


def _verified(row: dict) -> str:
    if row.get("verified") is None:
        return "not kept"
    return f"{row['verified']}/{row['verified'] + row['failed']}"


def _ratio(row: dict, key: str) -> str:
    if key not in row:
        return ""
    spread = row.get(f"{key}_rounds")
    cell = _num(row[key])
    return cell + (f" ({min(spread):.2f}-{max(spread):.2f})" if spread else "")


def table(report: dict) -> str:
    """The markdown table of one report's rows (first-contact rows get their own columns)."""
    _add_line_ratio(report, "memcpy")
    rows = [r for r in report["rows"] if r["method"] not in FIRST_CONTACT]
    first = [r for r in report["rows"] if r["method"] in FIRST_CONTACT]
    out = []
    if rows:
        settings = len({r.get("setting") for r in rows}) > 1
        ratios = [(k, h) for k, h in RATIOS if any(k in r for r in rows)]
        head = ["tokens"] + (["UCX TCP settings"] if settings else []) + ["method", "MiB", "median ms", "GB/s",
                                                                         "verified"] + [h for _, h in ratios]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [_tokens(r)] + ([r.get("setting", "")] if settings else []) + [r["method"], f"{r['bytes'] / 2**20:,.0f}"]
            if "gbps" in r:
                cells += [_num(r["median_s"] * 1e3, 1 if r["median_s"] > 0.01 else 3), _num(r["gbps"]),
                          _verified(r)]
                cells += [_ratio(r, k) if r["method"] not in LINES else "" for k, _ in ratios]
            else:
                why = r.get("skipped") or "error: " + (r.get("error") or "?").strip().splitlines()[-1][:120]
                cells += ["-", "-", why] + [""] * len(ratios)
            out.append("| " + " | ".join(cells) + " |")
    if first:
        if out:
            out.append("")
        out += ["| tokens | case | MiB | first read ms (median) | warm read ms (median) | first - warm ms "
                "(median of pairs) | per iteration: first / warm ms | first read's set-up ms (median) | verified |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in first:
            if "gbps" not in r:
                out.append(f"| {_tokens(r)} | {r['method']} | {r['bytes'] / 2**20:,.0f} | - | - | - | "
                           f"{r.get('skipped') or r.get('error', '?').strip().splitlines()[-1][:120]} | - | - |")
                continue
            out.append(f"| {_tokens(r)} | {FIRST_CASES[r['method']]} (`{r['method']}`) | {r['bytes'] / 2**20:,.0f} | "
                       f"{_num(r['first_ms'], 1)} | {_num(r['warm_ms'], 1)} | **{r['gap_ms']:+.1f}** | "
                       f"{_pairs(r)} | {_setup(r)} | "
                       f"{_verified(r)} |")
    return "\n".join(out)


def _setup(row: dict) -> str:
    """The median of a first-contact row's first-read set-up (from the call to the post: the
    handshake, claim and plan), where the row kept its phases; else "-"."""
    values = sorted(p["setup"] for p in row.get("phases_ms") or [] if "setup" in p)
    return _num(values[len(values) // 2], 1) if values else "-"


def block(name: str, report: dict, plot_note: str) -> str:
    """The generated text of one block: command, machine, table, and its plot if any."""
    machine = report.get("machine", {})
    env = " ".join(f"{k}={v}" for k, v in sorted(report.get("env", {}).items()))
    command = report.get("command", "(command not recorded)")
    lines = [f"Command: `{(env + ' ') if env else ''}{command}`  ",
             f"Machine: {machine.get('description') or _machine(machine)}; "
             f"{machine.get('date', '?')[:10]}, commit `{machine.get('commit') or '?'}`."]
    if report.get("carried"):
        lines.append(f"Carried over: {report['carried']}")
    lines += ["", table(report)]
    if plot_note:
        lines += ["", plot_note]
    return "\n".join(lines) + "\n"


def _machine(m: dict) -> str:
    gpus = m.get("gpus")
    what = f"{len(gpus)} x {gpus[0]}" if gpus else f"{m.get('cpus', '?')}-core CPU host"
    return f"{what} (`{m.get('host', '?')}`), Python {m.get('python', '?')}, torch {m.get('torch', '?')}"


def _plot(name: str, report: dict) -> str:
    """Write docs/img/bench-NAME.png for a sweep (several token counts); returns its markdown."""
    tokens = {r["tokens"] for r in report["rows"] if "gbps" in r}
    if len(tokens) < 3 or report.get("carried"):
        return ""
    try:
        sys.path.insert(0, str(ROOT))
        from kvxfer.bench.report import plot  # noqa: PLC0415
        IMG.mkdir(exist_ok=True)
        target = IMG / f"bench-{name}.png"
        # memcpy runs 5-40x above every transfer: drawn, it would flatten them into one line
        plot({**report, "rows": [r for r in report["rows"] if r["method"] not in FIRST_CONTACT + ("memcpy",)]},
             str(target))
    except ImportError as exc:
        print(f"bench_docs: plot for {name} skipped ({exc})", file=sys.stderr)
    left_out = " (memcpy, the line, is in the table only)" if any(r["method"] == "memcpy" for r in report["rows"]) else ""
    return f"![GB/s against tokens per request: {name}](img/bench-{name}.png){left_out}"


def render(text: str, plots: bool = True) -> str:
    """``text`` with every generated block rebuilt from its JSON."""
    def one(match: re.Match) -> str:
        name = match.group("name")
        path = DATA / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"bench_docs: {DOC.name} names block {name!r} but {path} does not exist")
        report = json.loads(path.read_text())
        note = _plot(name, report) if plots else _existing_plot(match.group("body"))
        return match.group(1) + block(name, report, note) + match.group(4)

    return BLOCK.sub(one, text)


def _existing_plot(body: str) -> str:
    found = re.search(r"^!\[.*\]\(img/bench-[\w.-]+\.png\).*$", body, re.M)
    return found.group(0) if found else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report whether the page is up to date")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text, plots=not args.check)
    if args.check:
        if new != text:
            print("docs/benchmarks.md is out of date: run python scripts/bench_docs.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
    print(f"bench_docs: {len(BLOCK.findall(text))} blocks in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
