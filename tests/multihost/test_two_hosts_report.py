"""The two-hosts report's ratios and table (pure; the run itself is `kvxfer bench --two-hosts`)."""

import pytest

from kvxfer.bench.cli import main
from kvxfer.bench.twohosts import add_line_ratios, table


def _row(tokens, setting, method, gbps, **extra):
    return {"tokens": tokens, "setting": setting, "method": method, "bytes": 1 << 20, "gbps": gbps,
            "median_s": (1 << 20) / gbps / 1e9, "verified": 3, "failed": 0, **extra}


def test_ratios_use_the_best_single_descriptor_nixl_figure_and_the_socket_of_the_same_tokens():
    report = {"rows": [
        _row(2048, "ucx-defaults", "nixl-1desc", 0.5),
        _row(2048, "kvxfer", "nixl-1desc", 1.25),
        _row(2048, "kvxfer", "tcp-socket", 2.0),
        _row(2048, "kvxfer", "kvxfer-agent-direct", 1.0, modes=["direct"]),
        _row(8192, "kvxfer", "nixl-1desc", 2.0),
        _row(8192, "kvxfer", "kvxfer-first-read", 0.5, handshake_ms=40.0, first_ms=90.0, warm_ms=60.0,
             gap_ms=30.0),
        {"tokens": 8192, "setting": "kvxfer", "method": "kvxfer-agent-staged", "bytes": 1 << 20,
         "error": "Traceback\nTransferFailedError: boom"},
    ]}
    rows = add_line_ratios(report)["rows"]
    assert rows[0]["vs_nixl_best"] == pytest.approx(0.4) and rows[0]["vs_socket"] == pytest.approx(0.25)
    assert rows[3]["vs_nixl_best"] == pytest.approx(0.8)
    assert rows[5]["vs_nixl_best"] == pytest.approx(0.25) and "vs_socket" not in rows[5]
    text = table(report)
    assert "first - warm 30.0 ms" in text and "ERROR TransferFailedError: boom" in text
    assert "path direct" in text


def test_two_hosts_without_root_says_why(monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["--two-hosts", "--quiet"]) == 2
    assert "need root" in capsys.readouterr().err
