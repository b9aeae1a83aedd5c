"""Hold tokens: what an audit found (each test failed before its fix).

* The word changed only after the hold had left the lease table: in between, ``holding()`` said
  the blocks were free while the word still proved the hold, so an engine reusing them then let a
  token read succeed with the new bytes. The word now changes, and the end is reported, inside the
  table's lock as the hold leaves it.
* A ``replace`` racing the old hold's end made a fresh hold whose word the old end then retired,
  and the old end's report told the engine the request's blocks were free while the new hold
  stood. The replace now stands for the ended hold: its end is not reported.
* A caller's token with the top epoch made every later hold raise OverflowError, after the hold
  had been recorded (it was held, though ``hold`` raised). Such tokens are refused (ConfigError),
  and a hold whose word cannot be written is not made.
* A hand-built token with fields out of range raised untyped errors after the reads were booked;
  ``read_many`` now refuses it at once (ConfigError).
* Every table counted epochs from 1: a restarted producer holding the same request over the same
  blocks wrote exactly the word of a token of its previous incarnation, which then passed its look.
  Tables count from a random 62-bit base.
"""

import threading
import time

import numpy as np
import pytest

from kvxfer import ConfigError, HoldToken, LeaseExpiredError, ReadRequest
from kvxfer.engine.holdwords import hold_tag
from kvxfer.engine.leases import LeaseTable

from agent_helpers import spec, wait_for


def _overwrite(cache, blocks, value):
    for layer in cache:
        for kv in range(2):
            layer[kv][blocks] = value


def _paused_retire(prod):
    """Hold the producer's word change (``HoldWords.retire``) until ``gate`` is set."""
    gate, entered = threading.Event(), threading.Event()
    real = prod._words.retire

    def retire(rid):
        entered.set()
        gate.wait(10)
        real(rid)

    prod._words.retire = retire
    return gate, entered


def _in_thread(fn, *args):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_nothing_says_a_hold_ended_before_its_word_changed(harness):
    prod, _ = harness.agent(spec(), seed=1)
    prod.hold("r", [5, 1, 7])
    token = prod.hold_token("r")
    gate, entered = _paused_retire(prod)
    releasing, _ = _in_thread(prod.release, "r")
    try:
        assert entered.wait(5)                    # the word still equals the token here
        asking, said = _in_thread(prod.holding, "r")
        asking.join(0.3)
        assert said in ([], [True])               # never False while the word proves the hold
        assert "r" not in prod.finished().freed
        assert prod._words.token("r") == token
    finally:
        gate.set()
        releasing.join(5)
    asking.join(5)
    assert not prod.holding("r") and prod._words.token("r") is None
    assert prod.finished().aborted == {"r"}


def _replace_racing_release(prod) -> None:
    """Hold r over [5, 1, 7], release it and, while the release is inside (its word not changed
    yet), hold r over [2, 4] with ``replace=True`` on another thread; returns once both ended."""
    prod.hold("r", [5, 1, 7])
    gate, entered = _paused_retire(prod)
    releasing, _ = _in_thread(prod.release, "r")
    try:
        assert entered.wait(5)                    # the old hold is leaving the table
        replacing, _ = _in_thread(lambda: prod.hold("r", [2, 4], replace=True))
        time.sleep(0.1)
    finally:
        gate.set()
        releasing.join(5)
    replacing.join(5)


def test_a_replace_racing_the_old_holds_end_stands_for_it(harness):
    prod, _ = harness.agent(spec(), seed=1)
    _replace_racing_release(prod)
    assert prod.holding("r")
    assert "r" not in prod.finished().freed       # before: reported aborted while the new hold stood
    new = prod.hold_token("r")
    assert new is not None and new.tag == hold_tag("r", [2, 4])


def test_a_token_read_after_the_replace_reads_the_new_hold(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    _replace_racing_release(prod)
    cons.read_many([ReadRequest(prod.address, [0, 3], [2, 4], "r", token=prod.hold_token("r"))])[0].wait(5)
    for got, want in zip(ccache, pcache):
        assert np.array_equal(got[:, [0, 3]], want[:, [2, 4]])


def test_a_top_epoch_token_is_refused_and_holds_stay_whole(harness):
    prod, _ = harness.agent(spec(), seed=1, hold_words=8)
    with pytest.raises(ConfigError, match="2\\*\\*63"):
        prod.hold("a", [1], token=HoldToken(0, (1 << 64) - 1, hold_tag("a", [1])))
    assert not prod.holding("a")
    prod.hold("b", [2])                            # later holds get their words as before
    assert prod.hold_token("b") is not None


def test_a_hold_whose_word_cannot_be_written_is_not_made():
    def broken(request_id, ids, named, fresh):
        raise RuntimeError("the word's table failed")

    table = LeaseTable(30.0, on_hold=broken)
    with pytest.raises(RuntimeError):
        table.hold("r", [1], 8)
    assert not table.held("r")

    calls = []
    table = LeaseTable(30.0, on_hold=lambda *a: calls.append(a) if len(calls) == 0 else broken(*a))
    table.hold("r", [1], 8)
    with pytest.raises(RuntimeError):
        table.hold("r", [2, 3], 8, replace=True)
    assert table.held("r") and table.check_claimed("r", "c", [1]).startswith("request 'r' was not claimed")


@pytest.mark.parametrize("bad", [lambda t: HoldToken(t.slot, -1, t.tag), lambda t: HoldToken(t.slot, t.epoch, str(t.tag)),
                                 lambda t: HoldToken(t.slot, 0, t.tag), lambda t: HoldToken(t.slot, t.epoch, 1 << 64)],
                         ids=["negative-epoch", "str-tag", "zero-epoch", "tag-past-64-bits"])
def test_a_hand_built_token_out_of_range_is_refused_at_once(harness, bad):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r0", [5])
    prod.hold("r1", [7])
    reads = [ReadRequest(prod.address, [0], [5], "r0", token=prod.hold_token("r0")),
             ReadRequest(prod.address, [3], [7], "r1", token=bad(prod.hold_token("r1")))]
    with pytest.raises(ConfigError, match="r1"):
        cons.read_many(reads)
    assert cons._parts.engine.in_flight() == 0     # nothing booked


def test_a_token_of_a_previous_incarnation_never_matches_a_later_hold(harness, monkeypatch):
    from kvxfer.agent.tokens import TokenReads, Verifier

    s = spec()
    p1, _ = harness.agent(s, seed=1)
    p1.hold("r", [5, 1, 7])
    old = p1.hold_token("r")
    p1.close()                                     # the producer restarts
    p2, pcache = harness.agent(s, seed=3)
    cons, _ = harness.agent(s, seed=2, listen=False)
    cons.connect(*p2.address)

    def restarted_engine_holds_r():                # between the read's move and its look
        _overwrite(pcache, [5, 1, 7], 0x1234)
        p2.hold("r", [5, 1, 7])

    class Hooked(Verifier):
        def __call__(self, _done=[]):
            if not _done:
                _done.append(1)
                restarted_engine_holds_r()
            return super().__call__()

    monkeypatch.setattr(TokenReads, "verifier", staticmethod(Hooked))
    handle = cons.read_many([ReadRequest(p2.address, [0, 3, 9], [5, 1, 7], "r", token=old)])[0]
    assert p2.hold_token("r") != old
    with pytest.raises(LeaseExpiredError):
        handle.wait(5)


def test_a_token_reads_late_done_leaves_the_replacement_hold_alone(harness):
    """A token read opens no claim window, so ``hold(replace=True)`` may come between its success
    and the arrival of its done notice (queued, sent on its own lane). Before, that notice, naming
    only the request, ended the replacement hold ("sent") though nobody had read it; it now names
    the token's epoch, and the producer ends only the hold of that epoch."""
    from kvxfer import AlreadyHeldError

    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    leases = prod._leases
    real_done = leases.done
    in_flight: list = []
    leases.done = lambda *args: in_flight.append(args) or False      # the notice still travelling
    try:
        prod.hold("c", [5, 1])                     # a claimed read: its window stays open until its done
        cons.read(prod.address, [0, 3], [5, 1], "c").wait(5)
        assert wait_for(lambda: in_flight, 5)
        with pytest.raises(AlreadyHeldError):
            prod.hold("c", [2, 4], replace=True)
        in_flight.clear()
        prod.hold("r", [5, 1, 7])                  # a token read: nothing open, the replace is taken
        token = prod.hold_token("r")
        cons.read_many([ReadRequest(prod.address, [0, 3, 9], [5, 1, 7], "r", token=token)])[0].wait(5)
        assert wait_for(lambda: in_flight, 5)
        prod.hold("r", [2, 6], replace=True)
        new = prod.hold_token("r")
    finally:
        leases.done = real_done
    for args in in_flight:
        leases.done(*args)                         # the old read's notice arrives
    assert prod.holding("r") and "r" not in prod.finished().freed
    cons.read_many([ReadRequest(prod.address, [4, 8], [2, 6], "r", token=new)])[0].wait(5)
    assert wait_for(lambda: not prod.holding("r"))  # its own read's notice ends it


def test_the_free_slot_list_never_grows_past_the_table(tmp_path):
    """Holds made under a caller's token (``reserve``: every hold of vLLM's workers) put their slot
    on the free list again when they ended, though it was still listed: the list grew by one entry
    per hold for the life of the process."""
    from kvxfer.engine.holdwords import HoldWords

    words = HoldWords("e", slots=4, directory=str(tmp_path))
    try:
        epoch = 1 << 40
        for i in range(100):
            rid, ids = f"r{i}", [i % 7]
            epoch += 1
            words.reserve(rid, HoldToken(i % 4, epoch, hold_tag(rid, ids)), ids)
            if i % 3:
                words.issue(rid, ids)
                words.retire(rid)
            else:
                words.unreserve(rid)         # a hold refused after its reserve
        assert len(words._free) <= 4
        assert sorted(words.issue(f"x{i}", [i]).slot for i in range(4)) == [0, 1, 2, 3]
    finally:
        words.close()
