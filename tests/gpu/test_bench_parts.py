"""`kvxfer bench`'s pure parts: presets x scenarios give valid specs, id patterns, ratios and the table."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.bench.cli import config_from, parser
from kvxfer.bench.report import add_ratios, table
from kvxfer.bench.scenarios import PRESETS, SCENARIOS, block_ids, build_scenario
from kvxfer.errors import ConfigError
from kvxfer.layout.pairs import pack_pairs
from kvxfer.layout.spec import CacheGeometry


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_preset_and_scenario_builds_matching_tables(preset, scenario):
    geo = PRESETS[preset]
    if geo.get("mla") and scenario == "packed":
        with pytest.raises(ConfigError, match="MLA"):
            build_scenario(scenario, geo, 256)
        return
    if not geo.get("mla") and geo["num_kv_heads"] % max(SCENARIOS[scenario][:2]):
        with pytest.raises(ConfigError, match="divisible"):
            build_scenario(scenario, geo, 256)
        return
    sc = build_scenario(scenario, geo, 256)
    ids = np.arange(sc.producer_blocks)
    total = 0
    for p in sc.producers:
        copy = pack_pairs(p, CacheGeometry.contiguous(p, 1 << 30), ids, sc.consumer, ids)
        total += copy.nbytes
    assert total == sc.request_bytes  # the producers together deliver exactly the consumer's share


def test_block_id_patterns():
    c = block_ids(8, 100, "contiguous", 1)
    assert np.array_equal(c, np.arange(c[0], c[0] + 8))
    f = block_ids(8, 100, "fragmented", 1)
    assert len(set(f.tolist())) == 8 and f.max() < 100
    with pytest.raises(ConfigError):
        block_ids(101, 100, "fragmented", 1)


def test_ratios_and_table():
    report = {"rows": [
        {"tokens": 8, "method": "peer-copy", "bytes": 2**30, "gbps": 400.0, "median_s": 0.0027, "verified": 5, "failed": 0},
        {"tokens": 8, "method": "kvxfer-ipc", "bytes": 2**30, "gbps": 360.0, "median_s": 0.003, "verified": 5, "failed": 0},
        {"tokens": 8, "method": "kvxfer-staged-read", "bytes": 2**30, "error": "boom\nTransferTimeoutError: late"},
    ]}
    add_ratios(report)
    assert report["rows"][1]["vs_peer-copy"] == pytest.approx(0.9)
    text = table(report)
    assert "0.90" in text and "TransferTimeoutError: late" in text


def test_cli_parses_a_full_command():
    args = parser().parse_args(["--preset", "custom", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
                                "--tokens", "16,32", "--piece-mib", "0,64", "--device", "cpu"])
    cfg = config_from(args)
    assert cfg.model() == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64}
    assert cfg.tokens == (16, 32) and cfg.piece_bytes == (0, 64 << 20)


def test_rounds_merge_and_pair_their_ratios():
    """Interleaved rounds: times add up, each round keeps its median, and the ratio is the median
    of per-round ratios, so a machine that slows down between rounds does not skew it."""
    from kvxfer.bench.run import _merge_round, _summary

    base, row = {"tokens": 8, "method": "nixl-per-block", "bytes": 1000}, {"tokens": 8, "method": "kvxfer-agent", "bytes": 1000}
    # (baseline ms, kvxfer ms) per round; the machine was 4x slower during kvxfer's 2nd round and
    # the baseline's 3rd: medians taken apart give 2 ms / 4 ms = 0.5, the paired rounds 2, 0.5, 2
    for (b, r), extra in zip([(2, 1), (2, 4), (8, 4)], [{"modes": ["direct"]}, {"modes": ["staged"]}, {}]):
        _merge_round(base, {"times": [b / 1e3, b / 1e3], "verified": 2, "failed": 0, "descriptors": 64})
        _merge_round(row, {"times": [r / 1e3, r / 1e3], "verified": 2, "failed": 0, "setup_ms": float(r), **extra})
    assert row["times"] == [0.001, 0.001, 0.004, 0.004, 0.004, 0.004]
    assert row["round_medians_s"] == [0.001, 0.004, 0.004]
    assert (row["verified"], row["failed"]) == (6, 0) and row["modes"] == ["direct", "staged"]
    assert row["setup_ms"] == 4.0 and row["per_round"]["setup_ms"] == [1.0, 4.0, 4.0]
    report = {"rows": [{**base, **_summary(base, 1000)}, {**row, **_summary(row, 1000)}]}
    add_ratios(report)
    got = report["rows"][1]
    assert got["vs_nixl-per-block_rounds"] == pytest.approx([2.0, 0.5, 2.0])
    assert got["vs_nixl-per-block"] == pytest.approx(2.0)
    assert "2.00 (0.50-2.00)" in table(report)


def test_a_failed_round_keeps_the_error_and_drops_the_figures():
    from kvxfer.bench.run import _merge_round

    row = {"tokens": 8, "method": "kvxfer-agent", "bytes": 1000}
    _merge_round(row, {"times": [0.001], "verified": 1, "failed": 0})
    _merge_round(row, {"error": "TransferTimeoutError: late"})
    _merge_round(row, {"times": [0.001], "verified": 1, "failed": 0})
    assert row["error"] == "TransferTimeoutError: late" and "times" not in row and "round_medians_s" not in row


def test_rounds_and_iters_must_be_positive():
    from kvxfer.bench.run import BenchConfig, run_bench

    with pytest.raises(ConfigError, match="rounds=0"):
        run_bench(BenchConfig(device="cpu", rounds=0))
