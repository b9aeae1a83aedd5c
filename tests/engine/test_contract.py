"""Issue 24, items 3-12: the engine-facing contract says what it does, in types.

Every test drives public ``Agent`` calls over ``FakeBackend`` (real bytes, transfers that can be
held in flight) and the in-memory side channel, and checks the outcome an engine acts on.
"""

import logging
import threading
import time
import warnings

import numpy as np
import pytest

from kvxfer import (AbortOutcome, AlreadyHeldError, ConfigError, KvxferError, ReleaseOutcome, ReleaseReason,
                    RequestState, TransferTimeoutError, WaitTimeout)
from kvxfer.agent.reports import Reports

from agent_helpers import spec, wait_for


# ---- 3. release() says when the blocks may be reused ------------------------------------------
def test_release_of_an_unclaimed_hold_is_free_now_and_listed_as_aborted(harness):
    prod, _ = harness.agent(spec(), seed=1)
    prod.hold("r", [1, 2])
    assert prod.release("r") is ReleaseOutcome.FREE_NOW
    assert not prod.holding("r") and "r" in prod.finished().aborted
    assert prod.release("r") is ReleaseOutcome.NOT_HELD


def test_release_during_a_read_is_free_only_once_finished_lists_it(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [5, 1])
    cons._backend.hold_transfers(True)           # the read is claimed and posted, its bytes wait
    handle = cons.read(prod.address, [0, 3], [5, 1], "r", timeout=10)
    assert wait_for(lambda: prod.status("r") is RequestState.CLAIMED)  # read() returns before its claim
    outcome = prod.release("r")
    assert outcome is ReleaseOutcome.FREE_WHEN_FINISHED and not outcome.free_now
    assert prod.release("r") is ReleaseOutcome.ALREADY_ENDING
    assert prod.holding("r") and prod.status("r") is RequestState.ENDING
    assert prod.finished().freed == set()         # not yet: the engine must keep the blocks
    cons._backend.hold_transfers(False)
    handle.wait(5)
    for layer in range(s.num_layers):             # the read that was in flight got the held bytes
        np.testing.assert_array_equal(ccache[layer][:, [0, 3]], pcache[layer][:, [5, 1]])
    assert wait_for(lambda: not prod.holding("r"))
    assert "r" in prod.finished().aborted and prod.status("r") is RequestState.ABORTED


# ---- 4. aborted and expired are distinct -------------------------------------------------------
def test_a_consumer_abort_is_reported_aborted_and_a_lapsed_lease_expired(harness):
    prod, _ = harness.agent(spec(), seed=1, lease_timeout=0.2)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("by-abort", [1], lease=30)
    prod.hold("by-lease", [2])
    assert cons.abort("by-abort", remote=prod.address) is AbortOutcome.RELEASED
    assert wait_for(lambda: not prod.holding("by-lease"))
    fin = prod.finished()
    assert fin.aborted == {"by-abort"} and fin.expired == {"by-lease"} and fin.freed == {"by-abort", "by-lease"}
    assert fin.reason("by-abort") is ReleaseReason.ABORTED and fin.reason("by-lease") is ReleaseReason.EXPIRED
    assert fin.reason("never") is None


# ---- 5. hold() of a held request --------------------------------------------------------------
def test_holding_a_held_request_again_is_refused_naming_it_and_changes_nothing(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [5, 1])
    with pytest.raises(AlreadyHeldError, match="'r' is already held") as info:
        prod.hold("r", [7, 8])                    # a duplicated scheduler event
    assert info.value.request_id == "r" and isinstance(info.value, ConfigError)
    cons.read(prod.address, [0, 3], [5, 1], "r").wait(5)   # the first hold still serves its blocks
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 3]], pcache[layer][:, [5, 1]])


def test_replace_true_replaces_an_unclaimed_hold(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [5, 1])
    prod.hold("r", [7, 8], replace=True)
    cons.read(prod.address, [0, 3], [7, 8], "r").wait(5)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 3]], pcache[layer][:, [7, 8]])


# ---- 6. a wait that runs out is not a failed transfer ----------------------------------------
def test_a_wait_that_runs_out_leaves_the_read_going_and_it_completes_exact(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [4])
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [2], [4], "r", timeout=10)
    with pytest.raises(WaitTimeout) as info:
        handle.wait(0.05)
    assert isinstance(info.value, TimeoutError) and not isinstance(info.value, TransferTimeoutError)
    assert not handle.done() and cons.status("r") is RequestState.IN_FLIGHT
    cons._backend.hold_transfers(False)
    assert handle.wait(5).num_bytes > 0
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [2]], pcache[layer][:, [4]])


# ---- 7. expect_writes: default 1, and chunked writes ------------------------------------------
def test_chunked_writes_are_received_only_after_the_last_chunk(harness):
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    prod, pcache = harness.agent(s, seed=1, listen=False)
    cons.expect_writes("w", writes=2)
    prod.write(cons.address, [1, 2], [0, 1], "w").wait(5)
    time.sleep(0.05)                              # the notification had every chance to arrive
    assert "w" not in cons.finished().received and cons.status("w") is RequestState.IN_FLIGHT
    prod.write(cons.address, [3], [2], "w").wait(5)
    assert wait_for(lambda: cons.status("w") is RequestState.RECEIVED)
    assert "w" in cons.finished().received
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 1, 2]], pcache[layer][:, [1, 2, 3]])


def test_expect_writes_defaults_to_one_producer_and_rejects_bad_counts(harness):
    cons, _ = harness.agent(spec(), seed=2)
    cons.expect_writes("w")                       # producers=1, writes=1
    with pytest.raises(ConfigError, match="producers must be an integer >= 1; got 0"):
        cons.expect_writes("w", 0)
    with pytest.raises(ConfigError, match="writes must be an integer >= 1; got 1.5"):
        cons.expect_writes("w", writes=1.5)


@pytest.mark.parametrize("remote, timeout, match", [
    ("nowhere", None, "remote must be a \\(host, port\\) pair; got 'nowhere'"),
    (None, -1.0, "timeout must be a positive, finite number of seconds or None; got -1.0"),
    (None, "5", "timeout must be a positive, finite number of seconds or None; got .5."),
])
def test_a_write_with_a_bad_remote_or_timeout_raises_at_once_and_books_nothing(harness, remote, timeout, match):
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    prod, pcache = harness.agent(s, seed=1, listen=False)
    with pytest.raises(ConfigError, match=match):
        prod.write(remote or cons.address, [1], [0], "w", timeout=timeout)
    assert prod.status("w") is RequestState.UNKNOWN and prod.stats().in_flight == 0
    prod.write(cons.address, [1], [0], "w").wait(5)   # the id was never taken
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0]], pcache[layer][:, [1]])


def test_two_writes_from_one_producer_do_not_count_as_two_producers():
    reports = Reports()
    reports.expect_writes("w", producers=2)
    reports.write_arrived("w", "p0")
    reports.write_arrived("w", "p0")              # a second chunk (or a retry) of the same producer
    assert reports.drain().received == set()
    reports.write_arrived("w", "p1")
    assert reports.drain().received == {"w"}


# ---- 8. a raising done-callback -----------------------------------------------------------------
def test_a_raising_done_callback_is_logged_and_later_callbacks_run(harness, caplog):
    prod, _ = harness.agent(spec(), seed=1)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("r", [1])
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [0], [1], "r", timeout=10)
    seen = []

    def broken(_):
        raise RuntimeError("engine bug in a callback")

    handle.add_done_callback(broken)
    handle.add_done_callback(lambda h: seen.append(threading.current_thread().name))
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        cons._backend.hold_transfers(False)
        handle.wait(5)
        assert wait_for(lambda: seen)
    assert any("engine bug in a callback" in (r.exc_text or "") and r.name == "kvxfer" for r in caplog.records)
    assert "r" in cons.finished().received        # the agent's own report ran too
    handle.add_done_callback(broken)              # added after completion: runs now, logged, no raise


# ---- 9. status() drains nothing -----------------------------------------------------------------
def test_status_follows_a_read_and_a_hold_without_draining_finished(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    assert prod.status("r") is RequestState.UNKNOWN
    prod.hold("r", [1])
    assert prod.status("r") is RequestState.HELD
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [0], [1], "r", timeout=10)
    assert cons.status("r") is RequestState.IN_FLIGHT  # from the call on, claiming included
    assert wait_for(lambda: prod.status("r") is RequestState.CLAIMED)
    assert cons.status("r") is RequestState.IN_FLIGHT
    cons._backend.hold_transfers(False)
    handle.wait(5)
    assert wait_for(lambda: prod.status("r") is RequestState.SENT)
    assert cons.status("r") is RequestState.RECEIVED
    for _ in range(3):                            # asked again and again: still there for finished()
        assert cons.status("r") is RequestState.RECEIVED
    assert "r" in cons.finished().received and "r" in prod.finished().sent
    assert cons.status("r") is RequestState.RECEIVED   # finished() drained; status remembers


def test_a_done_callback_finds_its_read_reported(harness):
    """The agent reports a read (``status``, ``finished``) before the read's own done-callbacks
    run: a callback that asks about its read sees how it ended, whichever thread completes it."""
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("ok", [1])
    seen = {}

    def ask(h):
        seen[h.request_id] = cons.status(h.request_id)

    cons._backend.hold_transfers(True)
    good = cons.read(prod.address, [0], [1], "ok", timeout=10)
    bad = cons.read(prod.address, [2], [3], "nobody-holds-it", timeout=10)   # refused by the producer
    good.add_done_callback(ask)
    bad.add_done_callback(ask)
    cons._backend.hold_transfers(False)
    good.wait(5)
    with pytest.raises(KvxferError):
        bad.wait(5)
    assert wait_for(lambda: len(seen) == 2)
    assert seen == {"ok": RequestState.RECEIVED, "nobody-holds-it": RequestState.FAILED}


def test_status_reports_quarantine_then_reclaim(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1, 2])
    cons._backend.hold_transfers(True)            # the transfer never confirms its end
    handle = cons.read(prod.address, [4, 5], [1, 2], "r", timeout=0.2)
    assert wait_for(handle.done, 5)
    assert handle.exception().quarantined_blocks == [4, 5]
    assert cons.status("r") is RequestState.QUARANTINED
    cons._backend.hold_transfers(False)
    assert wait_for(lambda: cons.status("r") is RequestState.RECLAIMED)
    fin = cons.finished()
    assert "r" in fin.failed and "r" in fin.reclaimed


def test_status_memory_is_bounded_oldest_first():
    reports = Reports(memory=3)
    for i in range(5):
        reports.released(f"r{i}", "sent")
    assert [reports.ended(f"r{i}") for i in range(5)] == [None, None] + [RequestState.SENT] * 3


# ---- 11. TransferStats reports the call's wall time --------------------------------------------
def test_total_seconds_covers_the_call_and_gb_per_s_uses_it(harness):
    prod, _ = harness.agent(spec(), seed=1)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("r", [1, 2, 3])
    cons.connect(*prod.address)
    started = time.perf_counter()
    handle = cons.read(prod.address, [0, 1, 2], [1, 2, 3], "r")
    stats = handle.wait(5)
    wall = time.perf_counter() - started
    assert stats.claim_seconds > 0 and stats.seconds > 0
    assert stats.total_seconds >= stats.setup_seconds + stats.seconds - 1e-9
    assert stats.total_seconds >= stats.claim_seconds and stats.total_seconds <= wall
    assert stats.gb_per_s == pytest.approx(stats.num_bytes / stats.total_seconds / 1e9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stats.gbps == stats.gb_per_s
    assert caught and issubclass(caught[0].category, DeprecationWarning)


# ---- 12. abort and keepalive say whom they told -------------------------------------------------
def test_abort_without_a_claim_or_remote_says_nobody_was_told(harness):
    prod, _ = harness.agent(spec(), seed=1)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("r", [1])
    assert cons.abort("r") is AbortOutcome.NOT_TOLD         # no claim here, no remote given
    assert prod.holding("r")
    assert cons.abort("r", remote=prod.address) is AbortOutcome.RELEASED
    assert cons.abort("r", remote=prod.address) is AbortOutcome.NOT_HELD   # told; already ended


def test_keepalive_reports_gone_and_never_raises_for_a_dead_rank(harness):
    prod, _ = harness.agent(spec(), seed=1)
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    prod.hold("kept", [1])
    beat = cons.keepalive(prod.address, ["kept", "gone"])
    assert beat.gone == ("gone",) and beat.unreachable == () and not beat.ok
    assert cons.keepalive(prod.address, ["kept"]).ok
    address = prod.address
    prod.close()
    beat = cons.keepalive(address, ["kept"])
    assert beat.unreachable == (tuple(address),) and beat.gone == ()


# ---- 10. one Agent shared between threads -------------------------------------------------------
def test_one_agent_shared_by_threads_reads_exact_and_reports_each_request_once(harness):
    s = spec(num_blocks=64)
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    threads, rounds = 4, 6
    errors, seen = [], []

    def worker(t: int) -> None:
        try:
            for i in range(rounds):
                rid, src, dst = f"t{t}-{i}", [t * 8 + i % 8], [t * 8 + (i + 1) % 8]
                prod.hold(rid, src)
                cons.read(prod.address, dst, src, rid).wait(5)
                for layer in range(s.num_layers):
                    np.testing.assert_array_equal(ccache[layer][:, dst], pcache[layer][:, src])
                assert cons.status(rid) is RequestState.RECEIVED
                seen.append(cons.finished().received)   # several readers drain: each id once overall
                cons.stats()
        except Exception as exc:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(30)
    assert errors == []
    seen.append(cons.finished().received)
    ids = [rid for batch in seen for rid in batch]
    assert sorted(ids) == sorted(f"t{t}-{i}" for t in range(threads) for i in range(rounds))
    assert wait_for(lambda: prod.stats().held_requests == 0)


# ---- sequences an engine makes: an abort racing the completion, reuse on finished() -----------
def test_an_abort_racing_the_completion_ends_one_way_and_the_hold_is_freed_once(harness):
    s = spec(num_blocks=32)
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    rng = np.random.default_rng(7)
    for trial in range(20):
        rid, src, dst = f"race-{trial}", [trial % 16, 16 + trial % 16], [trial % 16, 16 + trial % 16]
        prod.hold(rid, src)
        handle = cons.read(prod.address, dst, src, rid, timeout=5)
        time.sleep(float(rng.uniform(0, 0.002)))       # the abort lands before, during or after the copy
        outcome = cons.abort(rid)
        try:
            handle.wait()
        except KvxferError:
            assert cons.status(rid) in (RequestState.FAILED, RequestState.QUARANTINED)
        else:
            assert cons.status(rid) is RequestState.RECEIVED
            for layer in range(s.num_layers):
                np.testing.assert_array_equal(ccache[layer][:, dst], pcache[layer][:, src])
        assert outcome in (AbortOutcome.RELEASED, AbortOutcome.NOT_HELD, AbortOutcome.NOT_TOLD)
        assert wait_for(lambda: not prod.holding(rid))
        fin = prod.finished()
        assert fin.freed == {rid} and fin.reason(rid) in (ReleaseReason.SENT, ReleaseReason.ABORTED)
    assert prod.finished().freed == set() and cons.stats().in_flight == 0
