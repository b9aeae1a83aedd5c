"""Producer holds: claims, completion, abort and expiry on a manual clock."""

import pytest

from kvxfer.clock import ManualClock
from kvxfer.engine.leases import LeaseTable
from kvxfer.errors import AlreadyHeldError, BlockIdError, ConfigError
from kvxfer.types import ReleaseOutcome, RequestState


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


def test_heartbeat_extends_the_lease_and_a_claim_window_passing_without_done_frees():
    table, clock, released = make(lease=5.0)
    table.hold("r", [0], num_blocks=1)
    clock.advance(4.0)
    alive, gone = table.heartbeat(["r", "other"], "a")
    assert alive == ["r"] and gone == ["other"]
    clock.advance(4.0)
    assert table.expire() == []          # the heartbeat moved the lease to 9
    assert table.claim("r", "a", [0], window=2.0).granted
    clock.advance(1.9)
    assert table.expire() == []
    clock.advance(0.2)                   # the claimant's window passed without its done
    assert table.expire() == ["r"] and released == [("r", "expired")]


def test_release_is_idempotent():
    table, _, released = make()
    table.hold("r", [0], num_blocks=1)
    assert table.release("r")
    assert not table.release("r")
    assert released == [("r", "aborted")]


@pytest.mark.parametrize("blocks", [[-1], [8], [0, 9]])
def test_hold_of_unknown_block_ids_names_the_id_and_bound(blocks):
    table, _, _ = make()
    with pytest.raises(BlockIdError, match=r"outside \[0, 8\)"):
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


# ---- claim windows: release, abort and expiry never free blocks a claimant may still read ----

def test_release_inside_a_claim_window_defers_the_free_until_done():
    table, clock, released = make(lease=10.0)
    table.hold("r", [1, 2], num_blocks=4)
    assert table.claim("r", "d", [1, 2], window=5.0).granted
    assert table.release("r", "aborted")
    assert released == [] and table.held("r")          # still being read
    assert not table.claim("r", "other", [1]).granted   # but nobody new may start
    assert not table.release("r")                       # already ending
    assert table.done("r", "d")
    assert released == [("r", "aborted")] and not table.held("r")


def test_release_inside_a_claim_window_frees_when_the_window_passes():
    table, clock, released = make(lease=10.0)
    table.hold("r", [0], num_blocks=1)
    table.claim("r", "d", [0], window=2.0)
    table.release("r")
    clock.advance(1.9)
    assert table.expire() == [] and released == []
    clock.advance(0.2)
    assert table.expire() == ["r"] and released == [("r", "aborted")]


def test_lease_expiry_during_a_window_waits_for_the_window():
    # A producer stalled past its lease wakes inside a consumer's window: the blocks stay.
    table, clock, released = make(lease=0.5)
    table.hold("r", [0, 1], num_blocks=2)
    table.claim("r", "d", [0, 1], window=3.0)
    clock.advance(1.5)
    assert table.expire() == [] and table.held("r")
    assert table.counts().ending == 1 and table.counts().claimed == 1
    assert table.done("r", "d")
    assert released == [("r", "expired")]


def test_window_is_capped_and_zero_means_the_lease():
    clock = ManualClock()
    table = LeaseTable(4.0, clock, max_window=60.0)
    table.hold("r", [0], num_blocks=1)
    assert table.claim("r", "d", [0], window=1e6).lease_remaining == 60.0
    table.hold("s", [0], num_blocks=1)
    assert table.claim("s", "d", [0]).lease_remaining == 4.0


def test_release_outcome_says_when_the_blocks_may_be_reused():
    table, clock, released = make(lease=10.0)
    table.hold("idle", [0], num_blocks=4)
    assert table.release("idle") is ReleaseOutcome.FREE_NOW and released == [("idle", "aborted")]
    table.hold("read", [1, 2], num_blocks=4)
    table.claim("read", "d", [1, 2], window=5.0)
    outcome = table.release("read")
    assert outcome is ReleaseOutcome.FREE_WHEN_FINISHED and not outcome.free_now
    assert table.held("read") and table.state("read") is RequestState.ENDING   # not free yet
    assert table.release("read") is ReleaseOutcome.ALREADY_ENDING
    assert table.release("never") is ReleaseOutcome.NOT_HELD and ReleaseOutcome.NOT_HELD.free_now
    table.done("read", "d")
    assert released[-1] == ("read", "aborted") and table.state("read") is None


def test_state_tells_held_from_claimed_without_changing_anything():
    table, clock, released = make(lease=10.0)
    table.hold("r", [0], num_blocks=1)
    assert table.state("r") is RequestState.HELD
    table.claim("r", "d", [0], window=2.0)
    assert table.state("r") is RequestState.CLAIMED
    clock.advance(2.1)
    assert table.state("r") is RequestState.HELD and released == []   # the window passed; expire decides


def test_hold_of_a_held_request_is_refused_naming_it_unless_replace():
    table, _, _ = make()
    table.hold("r", [0, 1], num_blocks=4)
    with pytest.raises(AlreadyHeldError, match="'r' is already held") as info:
        table.hold("r", [2, 3], num_blocks=4)
    assert info.value.request_id == "r" and isinstance(info.value, ConfigError)
    assert table.claim("r", "d", [0, 1]).granted          # the first hold is untouched
    table.done("r", "d")
    table.hold("r", [2], num_blocks=4)                     # free again: a new hold is fine
    table.hold("r", [3], num_blocks=4, replace=True)       # replaced on purpose
    assert not table.claim("r", "d", [2]).granted and table.claim("r", "d", [3]).granted


def test_consumer_abort_of_an_ending_hold_closes_its_own_window():
    table, clock, released = make(lease=10.0)
    table.hold("r", [0], num_blocks=1)
    table.claim("r", "d", [0], window=5.0)
    assert table.release("r") is ReleaseOutcome.FREE_WHEN_FINISHED
    # The reader aborts: it will not read, so nothing is left to wait for.
    assert table.release("r", consumer="d") is ReleaseOutcome.ALREADY_ENDING
    assert released == [("r", "aborted")] and not table.held("r")


def test_rehold_inside_a_window_is_refused_and_changes_nothing():
    table, _, _ = make()
    table.hold("r", [0, 1], num_blocks=4)
    table.claim("r", "d", [0, 1], window=5.0)
    with pytest.raises(AlreadyHeldError, match="claim window"):
        table.hold("r", [2, 3], num_blocks=4, replace=True)
    assert table.check_claimed("r", "d", [0, 1]) == ""


@pytest.mark.parametrize("blocks", [[3.7], [1 << 63], [True], [[1, 2]], ["1"], [1, 1]])
def test_hold_refuses_ids_that_are_not_distinct_integers(blocks):
    table, _, _ = make()
    with pytest.raises(BlockIdError):
        table.hold("r", blocks, num_blocks=8)
    assert len(table) == 0


def test_counts_report_holds_blocks_claims_and_ending():
    table, _, _ = make()
    table.hold("a", [0, 1, 2], num_blocks=8)
    table.hold("b", [3], num_blocks=8)
    table.claim("b", "d", [3], window=1.0)
    table.release("b")
    c = table.counts()
    assert (c.requests, c.blocks, c.claimed, c.ending) == (2, 4, 1, 1)


def test_an_abort_by_the_claimant_closes_its_own_window_only():
    table, clock, released = make()
    table.hold("r", [0], num_blocks=1, consumers=2)
    table.claim("r", "a", [0], window=5.0)
    table.claim("r", "b", [0], window=5.0)
    assert table.release("r", consumer="a")       # a will not read; b still may be
    assert released == [] and table.held("r")
    table.done("r", "b")
    assert released == [("r", "aborted")]
    table.hold("s", [0], num_blocks=1)
    table.claim("s", "a", [0], window=5.0)
    assert table.release("s", consumer="a")       # its only claimant undoes its claim: free now
    assert released[-1] == ("s", "aborted")


def test_a_heartbeat_extends_a_hold_by_its_own_lease_not_the_tables():
    table, clock, released = make(lease=100.0)
    table.hold("short", [1], num_blocks=4, lease=2.0)
    table.hold("long", [2], num_blocks=4, lease=50.0)
    clock.advance(1.0)
    assert table.heartbeat(["short", "long"], "d") == (["short", "long"], [])
    clock.advance(2.5)  # past the short hold's own lease from the heartbeat; the table's would keep it
    table.expire()
    assert released == [("short", "expired")]
    clock.advance(40.0)
    table.expire()
    assert released == [("short", "expired")]  # the long one lives by its own 50 s


def test_a_done_never_frees_the_blocks_under_another_claimants_open_window():
    """Two consumers read one hold that expects one done: the first done marks it sent, but the
    blocks are freed only once the other claimant is done too, or its window has passed; new
    claims are refused meanwhile (before, the first done freed the blocks under the second read)."""
    table, clock, released = make(lease=10.0)
    table.hold("r", [1, 2], num_blocks=4)
    assert table.claim("r", "a", [1, 2], window=5.0).granted
    assert table.claim("r", "b", [1, 2], window=5.0).granted
    assert not table.done("r", "a")
    assert released == [] and table.held("r") and table.state("r") is RequestState.ENDING
    assert not table.claim("r", "c", [1]).granted
    assert table.done("r", "b")
    assert released == [("r", "sent")]
    table.hold("s", [3], num_blocks=4)  # the other claimant never reports: its window's end frees
    assert table.claim("s", "a", [3], window=5.0).granted
    assert table.claim("s", "b", [3], window=2.0).granted
    assert not table.done("s", "a")
    clock.advance(1.9)
    assert table.expire() == [] and released == [("r", "sent")]
    clock.advance(0.2)
    assert table.expire() == ["s"] and released[-1] == ("s", "sent")
