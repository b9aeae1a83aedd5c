"""Producer holds: claims, completion, abort and expiry on a manual clock."""

import pytest

from kvxfer.clock import ManualClock
from kvxfer.engine.leases import LeaseTable
from kvxfer.errors import BlockIdError, ConfigError


def make(lease=10.0):
    clock = ManualClock()
    released = []
    table = LeaseTable(lease, clock, lambda rid, why: released.append((rid, why)))
    return table, clock, released


def test_done_by_every_expected_consumer_releases_once():
    table, _, released = make()
    table.hold("r1", [3, 4, 5], num_blocks=8, consumers=2)
    assert table.claim("r1", "d0", [3, 4]).granted
    assert table.claim("r1", "d1", [5]).granted
    assert not table.done("r1", "d0")
    assert table.held("r1")
    assert table.done("r1", "d1")
    assert released == [("r1", "sent")]
    assert not table.done("r1", "d1")  # a duplicate notification changes nothing
    assert released == [("r1", "sent")]


def test_expected_count_comes_from_first_claim_when_unset():
    table, _, released = make()
    table.hold("r", [0], num_blocks=1)
    assert table.claim("r", "a", [0], expected_if_unset=2).granted
    table.done("r", "a")
    assert released == []
    table.done("r", "b")
    assert released == [("r", "sent")]


def test_claim_of_block_not_held_is_refused_and_changes_nothing():
    table, _, released = make()
    table.hold("r", [1, 2], num_blocks=4)
    result = table.claim("r", "a", [2, 3])
    assert not result.granted and "block 3" in result.reason
    assert table.held("r") and released == []


def test_late_claim_after_expiry_is_refused():
    table, clock, released = make(lease=5.0)
    table.hold("r", [0, 1], num_blocks=2)
    clock.advance(4.9)
    assert table.expire() == []
    clock.advance(0.2)
    assert table.expire() == ["r"]
    assert released == [("r", "expired")]
    result = table.claim("r", "a", [0])
    assert not result.granted and "not held" in result.reason


def test_claim_and_heartbeat_extend_the_lease():
    table, clock, _ = make(lease=5.0)
    table.hold("r", [0], num_blocks=1)
    clock.advance(4.0)
    table.claim("r", "a", [0])
    clock.advance(4.0)
    assert table.expire() == []
    alive, gone = table.heartbeat(["r", "other"], "a")
    assert alive == ["r"] and gone == ["other"]
    clock.advance(4.0)
    assert table.expire() == []
    clock.advance(1.5)
    assert table.expire() == ["r"]


def test_release_is_idempotent():
    table, _, released = make()
    table.hold("r", [0], num_blocks=1)
    assert table.release("r")
    assert not table.release("r")
    assert released == [("r", "aborted")]


@pytest.mark.parametrize("blocks", [[-1], [8], [0, 9]])
def test_hold_of_unknown_block_ids_names_the_id_and_bound(blocks):
    table, _, _ = make()
    with pytest.raises(BlockIdError, match=r"outside this cache's \[0, 8\)"):
        table.hold("r", blocks, num_blocks=8)
    assert len(table) == 0


def test_bad_consumers_or_lease_are_config_errors():
    table, _, _ = make()
    with pytest.raises(ConfigError):
        table.hold("r", [0], num_blocks=1, consumers=0)
    with pytest.raises(ConfigError):
        table.hold("r", [0], num_blocks=1, lease=-1)
    with pytest.raises(ConfigError):
        LeaseTable(0)
