"""``kvxfer bench --busy-engine --two-hosts``'s ratios and table (pure; the run itself needs root)."""

import pytest

from kvxfer.bench.busyhosts import add_per_block, table
from kvxfer.bench.cli import main


def _row(method, gbps, **extra):
    return {"tokens": 2048, "method": method, "bytes": 64 << 20, "gbps": gbps, "median_s": (64 << 20) / gbps / 1e9,
            "verified": 10, "failed": 0, **extra}


def test_rows_are_put_against_nixl_per_block_of_the_same_run():
    report = add_per_block({"rows": [
        _row("nixl-per-block", 1.0),
        _row("kvxfer-agent-direct", 0.8, modes=["direct"], claim_ms=2.5),
        _row("kvxfer-token-direct", 1.2, modes=["direct", "by token"]),
        {"tokens": 2048, "method": "kvxfer-agent-staged", "bytes": 64 << 20, "error": "Traceback\nBoom: x"},
    ]})
    rows = report["rows"]
    assert rows[1]["vs_per_block"] == pytest.approx(0.8) and rows[2]["vs_per_block"] == pytest.approx(1.2)
    text = table(report)
    assert "path direct/by token" in text and "claim 2.50 ms" in text and "ERROR Boom: x" in text


def test_busy_two_hosts_without_root_says_why(monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["--busy-engine", "--two-hosts", "--quiet"]) == 2
    assert "need root" in capsys.readouterr().err
