"""A read's done notice that reaches a producer after its hold ended (aborted, expired, sent) is a
late read's, not a write: the hold's report stands. Before, the notice was counted as a write
arrived, and the producer reported the request ``received``: ``status`` turned from ABORTED to
RECEIVED and ``finished().received`` listed a request that was never written here."""

import logging

from kvxfer.agent.progress import on_notification
from kvxfer.agent.reports import Reports
from kvxfer.protocol import encode_notification
from kvxfer.types import RequestState

from agent_helpers import spec


def test_a_notice_after_the_hold_ended_is_not_a_write():
    reports = Reports()
    reports.released("r", "aborted")
    assert reports.drain().aborted == {"r"}
    reports.write_arrived("r", "consumer-engine")
    assert reports.ended("r") is RequestState.ABORTED
    assert reports.drain().received == set()


def test_writes_still_count_where_they_are_expected_or_nothing_was_held():
    reports = Reports()
    reports.released("r", "sent")
    reports.expect_writes("r")                 # the same id, now expected as a write: it counts
    reports.write_arrived("r", "p")
    assert reports.drain().received == {"r"}
    reports.write_arrived("w", "p")            # never held here, not expected: a plain write, as before
    assert reports.drain().received == {"w"}


def test_a_producer_keeps_its_abort_when_a_late_notice_arrives(harness, caplog):
    prod, _ = harness.agent(spec(), seed=1)
    prod.hold("r", [1])
    prod.release("r")
    assert prod.finished().aborted == {"r"}
    note = encode_notification("r", "consumer-engine", prod.config.auth_key)
    with caplog.at_level(logging.DEBUG, logger="kvxfer.agent"):
        on_notification(prod._parts, "consumer", note)   # as the progress loop delivers one
    assert prod.status("r") is RequestState.ABORTED
    assert prod.finished().received == set()
    assert any("after its hold ended" in r.getMessage() for r in caplog.records)
