"""LeaseTable.expire looks only at holds that are due (a heap of due times), and a claim naming
the held ids is checked with a list compare (``Hold.missing``): both on a manual clock.

Each case makes a stale due entry (one pushed for an earlier lease, window or hold) come due
and checks that expire decides from the hold as it is now, and that no change is missed."""

import numpy as np
import pytest

from kvxfer.clock import ManualClock
from kvxfer.engine.leases import LeaseTable


def make(lease=10.0, **kw):
    clock = ManualClock()
    released = []
    table = LeaseTable(lease, clock, lambda rid, why: released.append((rid, why)), **kw)
    return table, clock, released


def test_each_hold_is_freed_when_its_own_lease_passes_and_not_before():
    table, clock, released = make()
    table.hold("long", [0], num_blocks=8, lease=9.0)
    table.hold("short", [1], num_blocks=8, lease=1.0)
    table.hold("mid", [2], num_blocks=8, lease=5.0)
    clock.advance(0.99)
    assert table.expire() == []
    clock.advance(0.02)
    assert table.expire() == ["short"]
    clock.advance(3.9)                     # t = 4.91
    assert table.expire() == []
    clock.advance(0.1)
    assert table.expire() == ["mid"]
    clock.advance(4.0)
    assert table.expire() == ["long"]
    assert released == [("short", "expired"), ("mid", "expired"), ("long", "expired")]
    assert table.expire() == [] and len(table) == 0


def test_a_claimed_hold_is_freed_when_the_claimants_window_passes_without_done():
    table, clock, released = make(lease=100.0)
    table.hold("r", [1, 2], num_blocks=4)
    assert table.claim("r", "a", [1, 2], window=3.0).granted
    clock.advance(2.99)
    assert table.expire() == [] and table.held("r")
    clock.advance(0.02)                    # the window passed, the lease (100 s) did not
    assert table.expire() == ["r"]
    assert released == [("r", "expired")]


def test_a_heartbeat_keeps_a_hold_past_its_first_due_time():
    table, clock, released = make(lease=5.0)
    table.hold("r", [0], num_blocks=2)
    clock.advance(4.0)
    assert table.heartbeat(["r"], "a") == (["r"], [])   # the lease now ends at t = 9
    clock.advance(1.5)                                  # t = 5.5: the hold's first due entry comes
    assert table.expire() == [] and table.held("r")
    clock.advance(3.4)                                  # t = 8.9
    assert table.expire() == []
    clock.advance(0.2)
    assert table.expire() == ["r"]
    assert released == [("r", "expired")]


def test_an_ending_hold_is_freed_when_the_open_window_closes():
    table, clock, released = make(lease=100.0)
    table.hold("r", [3], num_blocks=4)
    assert table.claim("r", "a", [3], window=4.0).granted
    clock.advance(1.0)
    assert table.release("r")              # the producer releases during the open window
    assert table.expire() == [] and table.held("r")
    assert not table.claim("r", "b", [3]).granted   # ending: no new reads
    clock.advance(2.9)                     # t = 3.9
    assert table.expire() == [] and released == []
    clock.advance(0.2)
    assert table.expire() == ["r"]
    assert released == [("r", "aborted")]


def test_a_hold_re_held_with_a_later_lease_outlives_the_first_holds_due_time():
    table, clock, released = make()
    table.hold("r", [0, 1], num_blocks=4, lease=2.0)
    table.hold("r", [2, 3], num_blocks=4, lease=20.0, replace=True)
    clock.advance(2.5)
    assert table.expire() == [] and table.held("r")
    assert table.claim("r", "a", [2, 3]).granted is True       # the new blocks, not the old
    assert "block 0" in table.claim("r", "a", [0, 1]).reason
    table.done("r", "a")
    assert released == [("r", "sent")]
    table.hold("r", [0], num_blocks=4, lease=30.0)              # freed, then held again
    clock.advance(29.9)                                          # t = 32.4: past every earlier due time
    assert table.expire() == [] and table.held("r")
    clock.advance(0.2)
    assert table.expire() == ["r"]
    assert released == [("r", "sent"), ("r", "expired")]


def test_a_lease_passing_inside_a_window_waits_for_the_window_then_frees():
    table, clock, released = make(lease=5.0)
    table.hold("r", [0], num_blocks=2)
    assert table.claim("r", "a", [0], window=8.0).granted
    clock.advance(5.1)
    assert table.expire() == [] and table.held("r")
    assert not table.claim("r", "b", [0]).granted               # ending once the lease passed
    clock.advance(3.0)
    assert table.expire() == ["r"] and released == [("r", "expired")]


def test_done_by_one_of_two_claimants_leaves_the_other_window_deciding():
    table, clock, released = make(lease=100.0)
    table.hold("r", [0, 1], num_blocks=2, consumers=2)
    assert table.claim("r", "a", [0], window=2.0).granted
    assert table.claim("r", "b", [1], window=6.0).granted
    clock.advance(1.0)
    assert not table.done("r", "a")
    assert table.expire() == []
    clock.advance(4.9)                     # t = 5.9: b's window still open
    assert table.expire() == []
    clock.advance(0.2)
    assert table.expire() == ["r"] and released == [("r", "expired")]


@pytest.mark.parametrize("wanted", [[5, 1, 3], [3, 5], [1], (1, 3, 5), np.array([5, 3, 1]), [1, 3, 5]])
def test_a_claim_naming_held_ids_in_any_order_or_a_subset_is_granted(wanted):
    table, _, _ = make()
    table.hold("r", [1, 3, 5], num_blocks=8)
    assert table.claim("r", "a", wanted).granted
    assert table.check_claimed("r", "a", wanted) == ""


@pytest.mark.parametrize("wanted, first", [([1, 3, 5, 7], 7), ([6, 1], 6), ([3, 4, 2], 4), ([0], 0),
                                           (np.array([1, 2]), 2)])
def test_a_claim_naming_an_id_not_held_is_refused_naming_it(wanted, first):
    table, _, released = make()
    table.hold("r", [1, 3, 5], num_blocks=8)
    result = table.claim("r", "a", wanted)
    assert not result.granted and f"block {first} is not held" in result.reason
    assert table.held("r") and released == [] and table.counts().claimed == 0


def test_expire_on_thousands_of_idle_holds_frees_exactly_the_due_ones():
    table, clock, released = make(lease=50.0)
    for i in range(3000):
        table.hold(f"r{i}", [i % 16], num_blocks=16, lease=1.0 + i % 3)
    clock.advance(1.5)
    assert sorted(table.expire()) == sorted(f"r{i}" for i in range(3000) if i % 3 == 0)
    clock.advance(1.0)
    assert len(table.expire()) == 1000
    assert len(table) == 1000 and len(released) == 2000


def test_the_due_heap_stays_bounded_by_the_holds_kept():
    """Each claim and each hold files a due entry; repeated claims on one hold (a consumer may
    send them as fast as the lane carries them) and requests freed long before their lease must
    not leave the heap growing with them. Decisions are unchanged: the hold is freed when the
    last claim's window passes."""
    table, clock, released = make(lease=480.0)
    table.hold("r", [1, 2, 3], num_blocks=8)
    for _ in range(20_000):
        assert table.claim("r", "a", [1, 2, 3], window=3.0).granted
        clock.advance(0.001)
    assert len(table._due) <= 2 * len(table) + 1025
    for i in range(5_000):                 # hold, claim, done: freed at once, lease 480 s
        table.hold(f"q{i}", [4], num_blocks=8)
        assert table.claim(f"q{i}", "a", [4]).granted
        assert table.done(f"q{i}", "a")
    assert len(table._due) <= 2 * len(table) + 1025
    clock.advance(2.9)                     # the last window (20 s - 0.001 + 3) is still open
    assert table.expire() == [] and table.held("r")
    clock.advance(0.2)
    assert table.expire() == ["r"] and released[-1] == ("r", "expired")
    assert len(released) == 5_001 and len(table) == 0
