"""``finished()`` stays bounded for an engine that never drains it (``REPORT_LIMIT``)."""

import logging

from kvxfer.agent import reports
from kvxfer.agent.reports import Reports


def test_undrained_reports_stay_bounded_oldest_dropped_first_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(reports, "REPORT_LIMIT", 100)
    book = Reports()
    with caplog.at_level(logging.WARNING, logger="kvxfer.agent"):
        for i in range(250):
            book.released(f"h{i}", "sent" if i % 2 else "expired")
        for i in range(30):
            book.reclaimed(f"q{i}")
    fin = book.drain()
    kept = fin.sent | fin.expired | fin.reclaimed
    assert len(kept) == 100
    assert {f"q{i}" for i in range(30)} <= kept          # the newest are kept
    assert "h0" not in kept and "h249" in kept           # the oldest went first
    assert sum("has not been drained" in r.message for r in caplog.records) == 1
    assert book.ended("h0") is not None                  # status() still knows a dropped one
    book.released("after", "sent")                       # a drain starts over
    assert book.drain().sent == {"after"}
