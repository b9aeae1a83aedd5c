"""Chaos with hold tokens (issue 35): reads that claim nothing are exact or typed, never reused bytes.

Real processes, real NIXL (UCX over TCP by default; ``KVXFER_CHAOS_TLS=default`` for UCX's own
choice: shared memory), the producer's real hold words under /dev/shm. The producer's engine
overwrites a hold's blocks with ``REUSED`` the moment ``finished()`` lists it
(``token_faults.ReusingEngine``), so a read that succeeded with bytes of a hold that had ended
shows up as wrong bytes. Every token read here is checked to have sent no claim. Release, expiry,
the consumer's abort, SIGKILL and SIGSTOP of the producer, each before, during and after the move
("after": the move completed, the word not yet looked at; ``token_faults.after_the_move``), three
trials each; docs/reliability.md ("hold tokens", the fault matrix) lists the cases.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from kvxfer import AbortedError, HoldToken, KVSpec, LeaseExpiredError, ReadRequest

from chaos_peers import BIG, Peer, blocks_of, consumer, fill, freeze, idle, wait_until
from token_faults import TYPED, after_the_move, count_claims, outcome, split_ids

TRIALS = 3
SEED = 11
#: blocks per read: 120 x 256 KiB = 30 MiB, long enough over TCP for a signal to land mid-move
SIZE = 120
#: the lease of a hold that must outlive its move and end before the look ("expiry after")
AFTER_LEASE = 1.0


@pytest.fixture(scope="module")
def producer():
    prod = Peer(KVSpec(**BIG), SEED)
    yield prod
    prod.stop()


@pytest.fixture(scope="module")
def cons():
    agent, cache = consumer(KVSpec(**BIG))
    yield agent, cache
    agent.close()


@pytest.fixture
def claims(monkeypatch):
    """Counts the claims this (consumer) process sends: a token read must send none."""
    return count_claims(monkeypatch.setattr)


def _ids(trial: int, salt: int) -> tuple[list[int], list[int]]:
    return split_ids(BIG["num_blocks"], SIZE, trial, salt)


def _hold(prod: Peer, rid: str, src: list[int], lease=None):
    """Hold ``src`` (reused once freed); returns (the bytes held, the token)."""
    want = prod.ask(("blocks", src))
    wire = prod.ask(("hold_token", rid, src, lease, True))
    assert wire is not None, "a plain hold got no token"
    return want, HoldToken.from_wire(wire)


def _read(agent, prod_address, dst, src, rid, token, timeout=20.0):
    return agent.read_many([ReadRequest(prod_address, dst, src, rid, timeout, token=token)])[0]


def _outcome(handle, cache, dst, want, timeout=25.0, by_token=True) -> str:
    """"exact" (the held bytes, checked) or the typed error's name; never reused bytes."""
    def check():
        for got, exp in zip(blocks_of(cache, dst), want):
            np.testing.assert_array_equal(got, exp, err_msg="a read succeeded with bytes other than the held ones")

    return outcome(handle, check, timeout, by_token=by_token)


def _settled(agent) -> None:
    import dataclasses

    assert wait_until(lambda: idle(dataclasses.asdict(agent.stats())), 10), agent.stats()


def _reused(prod: Peer, rid: str, timeout: float = 10.0) -> bool:
    """The hold of ``rid`` ended and the producer's engine overwrote its blocks."""
    return wait_until(lambda: rid in prod.ask(("reused",)), timeout)


def _drop_table(pid: int) -> None:
    """A SIGKILLed producer leaves its table's file behind: remove it (the test made it)."""
    import glob

    for path in glob.glob(f"/dev/shm/kvxfer-holds-*-{pid}"):
        with contextlib.suppress(FileNotFoundError):  # another agent's start swept it first (sweep_stale)
            os.unlink(path)


# ---- release -------------------------------------------------------------------------------
def test_release_before_the_move_fails_the_token_read_typed(producer, cons, claims):
    agent, cache = cons
    agent.connect(*producer.address)
    for trial in range(TRIALS):
        src, dst = _ids(trial, 1)
        rid = f"tok-rel-before-{trial}"
        want, token = _hold(producer, rid, src)
        producer.ask(("release", rid))
        assert _reused(producer, rid)  # the blocks hold other bytes now
        fill(cache, dst)
        assert _outcome(_read(agent, producer.address, dst, src, rid, token), cache, dst, want) == "LeaseExpiredError"
        _settled(agent)
    assert claims["n"] == 0
    producer.ask(("reset",))


def test_release_during_the_move_is_exact_or_typed_never_reused(producer, cons, claims):
    """A release racing the move: exact (it landed after the move completed) or typed, never reused
    bytes; at least one trial is typed (the race was run)."""
    agent, cache = cons
    agent.connect(*producer.address)
    outcomes = []
    for trial in range(TRIALS):
        src, dst = _ids(trial, 2)
        rid = f"tok-rel-during-{trial}"
        want, token = _hold(producer, rid, src)
        fill(cache, dst)
        # The release is on its way before the read starts, so it lands while the move runs even
        # where UCX moves 30 MiB within a few ms (shared memory, KVXFER_CHAOS_TLS=default). It frees
        # at once (no claim window): the engine overwrites the blocks.
        producer.cmd.put(("release", rid))
        handle = _read(agent, producer.address, dst, src, rid, token)
        producer.out.get(timeout=60)
        outcomes.append(_outcome(handle, cache, dst, want))
        _settled(agent)
        producer.ask(("reset",))
    assert set(outcomes) <= {"exact", "LeaseExpiredError"}, outcomes
    assert "LeaseExpiredError" in outcomes, f"no release landed before a move completed: {outcomes}"
    assert claims["n"] == 0


# ---- expiry and abort ------------------------------------------------------------------------
def test_expiry_before_or_during_the_move_is_typed_or_exact(producer, cons, claims):
    agent, cache = cons
    agent.connect(*producer.address)
    outcomes = []
    for trial in range(TRIALS):
        src, dst = _ids(trial, 4)
        rid = f"tok-exp-{trial}"
        want, token = _hold(producer, rid, src, lease=0.3)
        assert _reused(producer, rid)     # expired (and its blocks overwritten) before the read
        fill(cache, dst)
        assert _outcome(_read(agent, producer.address, dst, src, rid, token), cache, dst, want) == "LeaseExpiredError"
        rid = f"tok-exp-during-{trial}"
        want, token = _hold(producer, rid, src, lease=0.02)   # expires before or while the move runs
        fill(cache, dst)
        outcomes.append(_outcome(_read(agent, producer.address, dst, src, rid, token), cache, dst, want))
        _settled(agent)
        producer.ask(("reset",))
    assert set(outcomes) <= {"exact", "LeaseExpiredError"}, outcomes
    assert claims["n"] == 0


def test_consumer_abort_before_the_move_fails_the_token_read_typed(producer, cons, claims):
    """The consumer aborts the request before reading it (``abort(remote=)``): the producer ends
    the hold (its word changes first) and the engine reuses the blocks; the read is typed."""
    agent, cache = cons
    agent.connect(*producer.address)
    for trial in range(TRIALS):
        src, dst = _ids(trial, 11)
        rid = f"tok-abort-before-{trial}"
        want, token = _hold(producer, rid, src)
        agent.abort(rid, remote=producer.address)
        assert _reused(producer, rid), "the abort did not free the hold"
        fill(cache, dst)
        got = _outcome(_read(agent, producer.address, dst, src, rid, token), cache, dst, want)
        assert got in ("LeaseExpiredError", "AbortedError"), got
        _settled(agent)
    assert claims["n"] == 0
    producer.ask(("reset",))


def test_consumer_abort_mid_move_is_typed_and_frees_the_hold(producer, cons, claims):
    agent, cache = cons
    agent.connect(*producer.address)
    for trial in range(TRIALS):
        src, dst = _ids(trial, 5)
        rid = f"tok-abort-{trial}"
        want, token = _hold(producer, rid, src)
        fill(cache, dst)
        handle = _read(agent, producer.address, dst, src, rid, token)
        agent.abort(rid)
        got = _outcome(handle, cache, dst, want)
        assert got in ("AbortedError", "exact"), got   # exact: the move completed before the abort
        assert _reused(producer, rid), "the abort did not free the hold"
        _settled(agent)
        producer.ask(("reset",))
    assert claims["n"] == 0
    assert issubclass(AbortedError, LeaseExpiredError)


# ---- after the move: the bytes moved, the word not yet looked at --------------------------------
@pytest.mark.parametrize("event", ["release", "expiry", "abort", "sigstop"])
def test_an_event_after_the_move_before_the_look(event, producer, cons, claims):
    """The move of a token read has completed and the consumer has not yet looked at the word when
    the hold ends (release, expiry, the consumer's abort: every one is typed, as the word changed
    before the look) or the producer is stopped (exact: on this host the look is a load from the
    mapped table and needs no producer CPU; the read completes while the producer is stopped)."""
    agent, cache = cons
    agent.connect(*producer.address)
    outcomes = []
    for trial in range(TRIALS):
        src, dst = _ids(trial, 12)
        rid = f"tok-after-{event}-{trial}"
        want, token = _hold(producer, rid, src, lease=AFTER_LEASE if event == "expiry" else None)
        held = []

        def act():
            held.append(producer.ask(("status", rid)))   # the hold still stood when the move completed
            if event == "release":
                producer.ask(("release", rid))
            elif event == "abort":
                agent.abort(rid, wait=False)
            elif event == "sigstop":
                freeze(producer.pid)
                return
            assert _reused(producer, rid), f"{rid}: the hold did not end"

        fill(cache, dst)
        with after_the_move(act):
            handle = _read(agent, producer.address, dst, src, rid, token)
        try:
            outcomes.append(_outcome(handle, cache, dst, want))
        finally:
            if event == "sigstop":
                os.kill(producer.pid, signal.SIGCONT)
        assert held == ["held"], f"{rid}: the hold had ended before its move completed ({held})"
        assert _reused(producer, rid)
        # the abort went out on the producer's lane (wait=False: the hook may run on kvxfer's own
        # thread); a lane still busy with it would send the next read through the claim
        assert wait_until(lambda: agent._lanes.idle(producer.address), 10)
        _settled(agent)
        producer.ask(("reset",))
    want_outcomes = {"release": {"LeaseExpiredError"}, "expiry": {"LeaseExpiredError"},
                     "abort": {"LeaseExpiredError", "AbortedError"}, "sigstop": {"exact"}}[event]
    assert set(outcomes) <= want_outcomes, outcomes
    assert claims["n"] == 0


# ---- the producer killed or stopped ------------------------------------------------------------
@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_producer_sigkilled_around_the_move(when, claims):
    """SIGKILL before the read, while it moves, or after the move and before the look: nobody
    reuses a killed producer's blocks, so the held bytes (the word in the mapped table still equals
    the token) or a typed error; "before" is typed (nothing answers the move)."""
    agent, cache = consumer(KVSpec(**BIG), seed=98)
    outcomes = []
    try:
        for trial in range(TRIALS):
            prod = Peer(KVSpec(**BIG), SEED + trial)
            try:
                agent.connect(*prod.address, refresh=True)
                src, dst = _ids(trial, 6)
                rid = f"tok-kill-{when}-{trial}"
                want, token = _hold(prod, rid, src)
                fill(cache, dst)

                def kill(prod=prod):
                    os.kill(prod.pid, signal.SIGKILL)
                    prod.proc.join(10)

                if when == "before":
                    kill()
                with after_the_move(kill if when == "after" else (lambda: None)):
                    handle = _read(agent, prod.address, dst, src, rid, token, timeout=3 if when == "before" else 8)
                if when == "during":
                    os.kill(prod.pid, signal.SIGKILL)
                outcomes.append(_outcome(handle, cache, dst, want, timeout=15))
                if when == "after":
                    assert not prod.proc.is_alive(), "the move never completed"
                prod.proc.join(10)
            finally:
                if prod.proc.is_alive():
                    os.kill(prod.pid, signal.SIGKILL)
                    prod.proc.join(10)
                _drop_table(prod.pid)
    finally:
        agent.close()
    assert set(outcomes) <= TYPED | {"exact"}, outcomes
    if when == "before":
        assert "exact" not in outcomes, outcomes
    assert claims["n"] == 0


@pytest.mark.parametrize("when", ["before", "during"])
def test_producer_sigstopped_around_the_move(when, producer, cons, claims):
    """A stopped producer changes no word: over TCP the move waits for it and completes exactly
    once it runs again (or the read times out, typed); a release once it runs fails the read.
    (After the move: ``test_an_event_after_the_move_before_the_look[sigstop]``.)"""
    agent, cache = cons
    agent.connect(*producer.address)
    outcomes = []
    for trial in range(TRIALS):
        src, dst = _ids(trial, 7)
        rid = f"tok-stop-{when}-{trial}"
        want, token = _hold(producer, rid, src)
        fill(cache, dst)
        if when == "before":
            freeze(producer.pid)
        handle = _read(agent, producer.address, dst, src, rid, token, timeout=10)
        if when == "during":
            freeze(producer.pid)
        time.sleep(1.0)   # the producer stays stopped for a second: the case's own duration, not a wait
        os.kill(producer.pid, signal.SIGCONT)
        outcomes.append(_outcome(handle, cache, dst, want, timeout=15))
        _settled(agent)
        producer.ask(("reset",))
    assert set(outcomes) <= {"exact", "TransferTimeoutError"}, outcomes
    assert claims["n"] == 0


# ---- older peers -------------------------------------------------------------------------------
def test_a_token_aware_consumer_of_a_producer_without_a_table_claims(cons, claims):
    agent, cache = cons
    old = Peer(KVSpec(**BIG), SEED, hold_words=0)   # as a producer from before hold words
    try:
        agent.connect(*old.address)
        src, dst = _ids(0, 8)
        want = old.ask(("blocks", src))
        old.ask(("hold", "tok-old", src, None, True))
        assert old.ask(("token", "tok-old")) is None
        from kvxfer.engine.holdwords import hold_tag

        token = HoldToken(0, 1, hold_tag("tok-old", src))   # a token from elsewhere: the claim decides
        fill(cache, dst)
        assert _outcome(_read(agent, old.address, dst, src, "tok-old", token), cache, dst, want,
                        by_token=False) == "exact"
        assert claims["n"] == 1
    finally:
        old.stop()


def test_a_consumer_without_tokens_reads_a_new_producer_through_the_claim(producer, cons, claims):
    agent, cache = cons
    agent.connect(*producer.address)
    src, dst = _ids(0, 9)
    want, _ = _hold(producer, "tok-none", src)
    fill(cache, dst)
    assert _outcome(agent.read(producer.address, dst, src, "tok-none", timeout=20), cache, dst, want,
                    by_token=False) == "exact"
    assert claims["n"] == 1
    producer.ask(("reset",))


# ---- the lane ------------------------------------------------------------------------------
def test_a_fresh_consumers_first_token_read_claims_nothing(producer, claims):
    """A consumer that never met the producer reads at once (no ``connect()``): the handshake runs
    on the producer's lane, and the read it carries after it goes by its token too, exact."""
    agent, cache = consumer(KVSpec(**BIG), seed=7)
    try:
        src, dst = _ids(0, 9)
        want, token = _hold(producer, "tok-fresh", src)
        fill(cache, dst)
        handle = _read(agent, producer.address, dst, src, "tok-fresh", token)
        assert _outcome(handle, cache, dst, want) == "exact"
        assert claims["n"] == 0
    finally:
        agent.close()
    producer.ask(("reset",))


# ---- a step of token reads: one post, completed together ----------------------------------------
STEP_READS, STEP_SIZE = 4, 30


def _step_ids(trial: int, salt: int) -> tuple[list[list[int]], list[list[int]]]:
    src, dst = split_ids(BIG["num_blocks"], STEP_READS * STEP_SIZE, trial, salt)
    cut = lambda ids: [ids[i * STEP_SIZE:(i + 1) * STEP_SIZE] for i in range(STEP_READS)]  # noqa: E731
    return cut(src), cut(dst)


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_step_of_token_reads_with_one_hold_ended_fails_only_that_read(when, producer, cons, claims):
    """A step's token reads to one producer rank go in one NIXL post and complete together (each
    read's look at its own word). The producer ends one read's hold before or while they move and
    overwrites its blocks: that read is typed (or exact, where the release came after the move),
    never reused bytes; the step's other reads are exact, by token; nothing is claimed."""
    agent, cache = cons
    agent.connect(*producer.address)
    ended_outcomes = []
    for trial in range(TRIALS):
        srcs, dsts = _step_ids(trial, 20 if when == "before" else 21)
        rids = [f"tok-step-{when}-{trial}-{i}" for i in range(STEP_READS)]
        held = [_hold(producer, rid, src) for rid, src in zip(rids, srcs)]
        for dst in dsts:
            fill(cache, dst)
        victim = trial % STEP_READS
        if when == "before":
            producer.ask(("release", rids[victim]))
            assert _reused(producer, rids[victim])
        else:
            producer.cmd.put(("release", rids[victim]))  # lands while the step's post moves the bytes
        handles = agent.read_many([ReadRequest(producer.address, dst, src, rid, 20.0, token=token)
                                   for dst, src, rid, (_, token) in zip(dsts, srcs, rids, held)])
        if when == "during":
            producer.out.get(timeout=60)
        for i, (handle, dst, (want, _)) in enumerate(zip(handles, dsts, held)):
            got = _outcome(handle, cache, dst, want)
            if i == victim:
                ended_outcomes.append(got)
            else:
                assert got == "exact", f"trial {trial}: read {i}, whose hold stood, ended {got}"
        _settled(agent)
        producer.ask(("reset",))
    if when == "before":
        assert ended_outcomes == ["LeaseExpiredError"] * TRIALS, ended_outcomes
    else:
        assert set(ended_outcomes) <= {"exact", "LeaseExpiredError"}, ended_outcomes
    assert claims["n"] == 0
