"""Hold tokens (issue 35) over FakeBackend: the producer's words, and reads that claim nothing.

Real bytes move through the fake backend; the words live in a real file under /dev/shm that the
consumer maps, as across processes on one host. tests/chaos/test_tokens_chaos.py does the same
over real NIXL between real processes, with an engine that reuses blocks the moment they free."""

import numpy as np
import pytest

from kvxfer import ConfigError, HoldToken, LeaseExpiredError, ReadRequest
from kvxfer.engine.holdwords import HoldWords, WordView, hold_tag

from agent_helpers import spec, wait_for


def _same(ccache, pcache, local, remote, s):
    for layer in range(s.num_layers):
        for kv in range(2):
            np.testing.assert_array_equal(ccache[layer][kv][local], pcache[layer][kv][remote])


def _claims(agent) -> int:
    """How many claims the producer's lease table answered (a token read sends none)."""
    return agent._claims_seen


@pytest.fixture
def counted(monkeypatch):
    """Count the claims a producer answers."""
    from kvxfer.agent.service import ProducerService

    seen = {"n": 0}
    real = ProducerService._claim

    def claim(self, message, peer):
        seen["n"] += 1
        return real(self, message, peer)

    monkeypatch.setattr(ProducerService, "_claim", claim)
    return seen


# ---- the producer's table ------------------------------------------------------------------
def test_words_issue_retire_and_replace(tmp_path):
    words = HoldWords("p-1", slots=4, directory="/dev/shm")
    try:
        view = WordView(words.path, 4)
        t = words.issue("r1", [3, 1])
        assert t.epoch >= 1 and t.tag == hold_tag("r1", [3, 1])
        assert view.check(t) == ""
        again = words.issue("r1", [3, 1])          # a replace: same slot, new epoch
        assert again.slot == t.slot and again.epoch > t.epoch
        assert "epoch" in view.check(t) and view.check(again) == ""
        words.retire("r1")
        assert "no hold" in view.check(again)
        assert words.token("r1") is None
        for i in range(4):
            assert words.issue(f"x{i}", [i]) is not None
        assert words.issue("full", [0]) is None     # no slot free: no token (the read claims)
        assert "past the producer's table" in view.check(HoldToken(9, 1, 0))
    finally:
        words.close()


def test_a_steps_looks_taken_together_say_what_each_look_says():
    """``check_many`` (one gather for a step's looks) answers each token as ``check`` does."""
    words = HoldWords("p-2", slots=8, directory="/dev/shm")
    try:
        view = WordView(words.path, 8)
        live = words.issue("a", [3, 1])
        old = words.issue("b", [2])
        new = words.issue("b", [2])                       # replaced: ``old`` names an earlier epoch
        gone = words.issue("c", [5])
        words.retire("c")
        other = HoldToken(live.slot, live.epoch, hold_tag("a", [3, 2]))  # the right word, other ids
        tokens = [live, old, new, gone, other, live]
        assert view.check_many(tokens) == [view.check(t) for t in tokens]
        assert [bool(why) for why in view.check_many(tokens)] == [False, True, False, True, True, False]
        past = [live, HoldToken(9, 1, 0)]                 # a slot past the table: named, one by one
        assert view.check_many(past) == [view.check(t) for t in past] and "past" in view.check_many(past)[1]
    finally:
        words.close()


def test_a_view_refuses_a_path_outside_the_tables():
    with pytest.raises(ConfigError, match="kvxfer-holds"):
        WordView("/etc/passwd", 1)


def test_token_from_wire_is_checked():
    assert HoldToken.from_wire([1, 2, 3]) == HoldToken(1, 2, 3)
    for bad in ([1, 0, 3], [1, 2], [-1, 2, 3], "x", [1, 2, 1 << 64], [True, 2, 3]):
        with pytest.raises(ValueError):
            HoldToken.from_wire(bad)


def test_hold_gives_a_token_and_every_end_changes_the_word(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    view = WordView(prod._words.path, prod._words.slots)
    for end in ("release", "expire", "replace"):
        prod.hold("r", [5, 1, 7], lease=0.2 if end == "expire" else None)
        token = prod.hold_token("r")
        assert token is not None and token.tag == hold_tag("r", [5, 1, 7])
        assert view.check(token) == ""
        seen = {}
        real = prod._reports.released   # what finished() lists: the word must have changed before

        def released(rid, why, real=real, token=token):
            seen.setdefault(rid, view.check(token))
            real(rid, why)

        prod._reports.released = released
        try:
            if end == "release":
                prod.release("r")
            elif end == "expire":
                assert wait_for(lambda: not prod.holding("r"), 5)
            else:
                prod.hold("r", [5, 1, 7], replace=True)
                assert view.check(token) and view.check(prod.hold_token("r")) == ""
                prod.release("r")
        finally:
            prod._reports.released = real
        assert "r" in seen and seen["r"], f"{end}: the word had not changed when the blocks were reported free"
        assert prod.hold_token("r") is None
        prod.finished()


def test_a_hold_naming_engines_gets_no_token(harness):
    prod, _ = harness.agent(spec(), seed=1)
    prod.hold("r", [1], consumer_engines=["someone"])
    assert prod.hold_token("r") is None


def test_the_handshake_announces_the_table(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    link = cons.connect(*prod.address)
    assert link.info.hold_words == prod._words.path and link.info.hold_slots == prod._words.slots


def test_no_table_when_turned_off(harness):
    prod, _ = harness.agent(spec(), seed=1, hold_words=0)
    prod.hold("r", [1])
    assert prod.hold_token("r") is None


# ---- the consumer -----------------------------------------------------------------------
def test_a_token_read_is_exact_claims_nothing_and_frees_the_hold(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("r1", [5, 1, 7])
    token = prod.hold_token("r1")
    before = counted["n"]
    cons.read_many([ReadRequest(prod.address, [0, 3, 9], [5, 1, 7], "r1", token=token)])[0].wait(5)
    _same(ccache, pcache, [0, 3, 9], [5, 1, 7], s)
    assert counted["n"] == before, "a token read sent a claim"
    assert wait_for(lambda: not prod.holding("r1"))
    assert "r1" in prod.finished().sent


def test_a_token_read_after_release_fails_typed_and_leaves_the_producer_alone(harness, counted):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("r1", [5, 1, 7])
    token = prod.hold_token("r1")
    prod.release("r1")
    prod.hold("r1", [5, 1, 7])   # held again: an old epoch in the slot's place
    before = counted["n"]
    with pytest.raises(LeaseExpiredError, match="hold ended"):
        cons.read_many([ReadRequest(prod.address, [0, 3, 9], [5, 1, 7], "r1", token=token)])[0].wait(5)
    assert counted["n"] == before
    assert prod.holding("r1") and prod.hold_token("r1") != token  # the new hold is untouched


@pytest.mark.parametrize("wrong", ["other request", "other ids"])
def test_a_wrong_token_fails_before_anything_moves(harness, counted, wrong):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("a", [5, 1, 7])
    prod.hold("b", [2, 4])
    before_bytes = [c.copy() for c in ccache]
    token = prod.hold_token("b" if wrong == "other request" else "a")
    remote = [5, 1, 7] if wrong == "other request" else [5, 1, 8]
    before = counted["n"]
    with pytest.raises(LeaseExpiredError, match="was not given for this request"):
        cons.read_many([ReadRequest(prod.address, [0, 3, 9], remote, "a", token=token)])[0].wait(5)
    assert counted["n"] == before
    for c, b in zip(ccache, before_bytes):
        np.testing.assert_array_equal(c, b)
    assert prod.holding("a") and prod.holding("b")
    assert prod.finished().freed == set()


def test_a_bad_token_type_is_refused_at_once(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    with pytest.raises(ConfigError, match="HoldToken"):
        cons.read_many([ReadRequest(prod.address, [0], [1], "r", token=[1, 2, 3])])


def test_a_token_for_a_producer_without_a_table_claims(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1, hold_words=0)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("r1", [5, 1])
    token = HoldToken(0, 1, hold_tag("r1", [5, 1]))   # as an older producer's client might hand one
    before = counted["n"]
    cons.read_many([ReadRequest(prod.address, [0, 3], [5, 1], "r1", token=token)])[0].wait(5)
    _same(ccache, pcache, [0, 3], [5, 1], s)
    assert counted["n"] == before + 1   # the claim carried it


def test_a_read_without_token_still_claims(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    prod.hold("r1", [5, 1])
    before = counted["n"]
    cons.read(prod.address, [0, 3], [5, 1], "r1").wait(5)
    _same(ccache, pcache, [0, 3], [5, 1], s)
    assert counted["n"] == before + 1


def test_close_ends_every_word_and_removes_the_table(harness):
    prod, _ = harness.agent(spec(), seed=1)
    prod.hold("r", [1, 2])
    token = prod.hold_token("r")
    view = WordView(prod._words.path, prod._words.slots)
    path = prod._words.path
    assert view.check(token) == ""
    prod.close()
    assert "no hold" in view.check(token)   # a read still moving when the producer closed fails
    import os

    assert not os.path.exists(path)


def test_a_step_of_token_reads_is_exact_and_frees_every_hold(harness, counted):
    """Several token reads to one producer go as one post; each one's done notice still reaches it."""
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    reads = []
    for i, (src, dst) in enumerate((([5, 1], [0, 3]), ([7, 2], [4, 6]), ([9], [8]))):
        prod.hold(f"s{i}", src)
        reads.append(ReadRequest(prod.address, dst, src, f"s{i}", token=prod.hold_token(f"s{i}")))
    before = counted["n"]
    for h in cons.read_many(reads):
        h.wait(5)
    for r in reads:
        _same(ccache, pcache, r.local_blocks, r.remote_blocks, s)
    assert counted["n"] == before
    assert wait_for(lambda: all(not prod.holding(f"s{i}") for i in range(3)))
    assert prod.finished().sent == {"s0", "s1", "s2"}


# ---- a token chosen by the caller (an engine whose answer leaves before its hold is made) ------
def test_a_hold_under_the_callers_token_is_read_by_it(harness, counted):
    from kvxfer import TokenBook

    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    book = TokenBook(prod.config.hold_words)
    token = book.issue("r1", [5, 1, 7])
    prod.hold("r1", [5, 1, 7], token=token)
    assert prod.hold_token("r1") == token
    before = counted["n"]
    stats = cons.read_many([ReadRequest(prod.address, [0, 3, 9], [5, 1, 7], "r1", token=token)])[0].wait(5)
    _same(ccache, pcache, [0, 3, 9], [5, 1, 7], s)
    assert stats.by_token and counted["n"] == before
    assert wait_for(lambda: not prod.holding("r1"))
    book.retire("r1")
    again = book.issue("r2", [2])
    prod.hold("r2", [2], token=again)                      # a later token of the book fits the table
    prod.hold("r3", [3])                                    # and the table's own tokens come after it
    assert prod.hold_token("r3").epoch > again.epoch


@pytest.mark.parametrize("bad", ["tag", "slot past the table", "slot of another hold", "old epoch",
                                 "names engines", "not a token"])
def test_a_callers_token_that_does_not_fit_is_refused_and_nothing_is_held(harness, bad):
    s = spec()
    prod, _ = harness.agent(s, seed=1, hold_words=8)
    prod.hold("other", [2])
    taken = prod.hold_token("other")
    good = HoldToken(taken.slot + 1, taken.epoch + 5, hold_tag("r", [5, 1]))
    token, named = {
        "tag": (HoldToken(good.slot, good.epoch, hold_tag("r", [5, 2])), None),
        "slot past the table": (HoldToken(8, good.epoch, good.tag), None),
        "slot of another hold": (HoldToken(taken.slot, good.epoch, good.tag), None),
        "old epoch": (None, None),
        "names engines": (good, ["cons"]),
        "not a token": ((good.slot, good.epoch, good.tag), None),
    }[bad]
    if bad == "old epoch":  # the slot was written with a later epoch already
        prod.hold("x", [3])
        slot = prod.hold_token("x")
        prod.release("x")
        token = HoldToken(slot.slot, slot.epoch, good.tag)
    with pytest.raises(ConfigError, match={"tag": "tag", "slot past the table": "past the table",
                                           "slot of another hold": "another hold's", "old epoch": "above the last",
                                           "names engines": "naming consumer engines",
                                           "not a token": "must be a HoldToken"}[bad]):
        prod.hold("r", [5, 1], token=token, consumer_engines=named)
    assert not prod.holding("r") and prod.hold_token("r") is None
    assert prod.holding("other") and prod.hold_token("other") == taken
    prod.hold("r", [5, 1], token=HoldToken(good.slot, good.epoch + 10, good.tag))  # and the right one fits
    assert prod.hold_token("r").epoch == good.epoch + 10


def test_a_callers_token_needs_a_table(harness):
    prod, _ = harness.agent(spec(), seed=1, hold_words=0)
    with pytest.raises(ConfigError, match="hold_words is 0"):
        prod.hold("r", [1], token=HoldToken(0, 1, hold_tag("r", [1])))
    assert not prod.holding("r")


# ---- the look across hosts: one small READ of the word through the backend ------------------
def test_a_token_read_looks_at_the_word_through_the_backend_where_it_cannot_map_it(harness, counted, monkeypatch):
    from kvxfer.agent.tokens import TokenReads
    from kvxfer.engine.remotewords import RemoteWordView

    monkeypatch.setattr(TokenReads, "map_same_host", False)  # as a consumer on another host
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    link = cons.connect(*prod.address)
    assert link.info.hold_words_addr and isinstance(cons._tokens.view(link), RemoteWordView)
    prod.hold("r1", [5, 1, 7])
    token = prod.hold_token("r1")
    before = counted["n"]
    stats = cons.read_many([ReadRequest(prod.address, [0, 3, 9], [5, 1, 7], "r1", token=token)])[0].wait(5)
    _same(ccache, pcache, [0, 3, 9], [5, 1, 7], s)
    assert stats.by_token and counted["n"] == before
    assert wait_for(lambda: not prod.holding("r1"))
    prod.hold("r2", [2, 4])
    old = prod.hold_token("r2")
    prod.release("r2")
    prod.hold("r2", [2, 4])   # a later hold in the slot: the old token's look sees its epoch
    with pytest.raises(LeaseExpiredError, match="hold ended"):
        cons.read_many([ReadRequest(prod.address, [0, 3], [2, 4], "r2", token=old)])[0].wait(5)
    assert counted["n"] == before and prod.holding("r2") and prod.hold_token("r2") != old


# ---- a step of token reads planned and posted as one (issue 34, rule 4) ------------------------
def _step(prod, pairs, prefix="t"):
    reads = []
    for i, (src, dst) in enumerate(pairs):
        prod.hold(f"{prefix}{i}", src)
        reads.append(ReadRequest(prod.address, dst, src, f"{prefix}{i}", token=prod.hold_token(f"{prefix}{i}")))
    return reads


def test_a_step_of_token_reads_is_planned_and_posted_once(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    reads = _step(prod, (([5, 1], [0, 3]), ([7, 2], [4, 6]), ([9], [8]), ([10, 11, 0], [1, 2, 5])))
    posted = cons._backend.posted
    stats = [h.wait(5) for h in cons.read_many(reads)]
    assert cons._backend.posted == posted + 1, "a step of token reads to one rank took more than one post"
    for r in reads:
        _same(ccache, pcache, r.local_blocks, r.remote_blocks, s)
    assert all(st.by_token for st in stats) and counted["n"] == 0
    # each read owns its share of the one post: the step's bytes split by its blocks
    assert [st.num_bytes for st in stats] == [len(r.local_blocks) * 2 * s.num_layers * s.block_bytes
                                               for r in reads]
    assert wait_for(lambda: prod.finished().sent >= {"t0", "t1", "t2", "t3"} or not any(
        prod.holding(f"t{i}") for i in range(4)))


def test_a_step_with_one_ended_hold_fails_only_that_read(harness):
    """A step's looks at the producer's words are taken together once its one post completed: the
    read whose hold ended (released, then held again: a later epoch) fails typed; the others are
    exact, and the new hold is left alone."""
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    reads = _step(prod, (([5, 1], [0, 3]), ([7, 2], [4, 6]), ([9], [8])), prefix="e")
    prod.release("e1")
    prod.hold("e1", [7, 2])
    handles = cons.read_many(reads)
    for i in (0, 2):  # the first wait completes the step: the others' looks go together
        handles[i].wait(5)
        _same(ccache, pcache, reads[i].local_blocks, reads[i].remote_blocks, s)
    with pytest.raises(LeaseExpiredError, match="hold ended"):
        handles[1].wait(5)
    assert prod.holding("e1") and prod.hold_token("e1") != reads[1].token


def test_a_step_with_one_bad_read_fails_only_that_read(harness):
    """The step's ids checked together fail together: each read is then routed on its own, so
    only the read with a remote id past the producer's cache fails, naming it."""
    from kvxfer import BlockIdError

    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    reads = _step(prod, (([5, 1], [0, 3]), ([7, 2], [4, 6])))
    bad = s.num_blocks + 3
    token = HoldToken(0, 1, hold_tag("bad", [bad]))  # fits its own ids: the step's plan meets the bad id
    reads.insert(1, ReadRequest(prod.address, [9], [bad], "bad", token=token))
    before = [c.copy() for c in ccache]
    handles = cons.read_many(reads)
    with pytest.raises(BlockIdError, match=str(s.num_blocks + 3)):
        handles[1].wait(5)
    for h, r in zip(handles, reads):
        if r.request_id != "bad":
            h.wait(5)
            _same(ccache, pcache, r.local_blocks, r.remote_blocks, s)
    for c, b in zip(ccache, before):  # the bad read's destination untouched
        np.testing.assert_array_equal(c[:, 9], b[:, 9])


def test_a_read_that_ends_before_its_steps_post_leaves_its_blocks_untouched(harness, monkeypatch):
    """One read of a step planned as one is aborted before the step is posted: the one post would
    write into its blocks, so the others are posted read by read; they are exact, and the aborted
    read's destination keeps its bytes."""
    from kvxfer.agent.reads import ReadFlow

    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    reads = _step(prod, (([5, 1], [0, 3]), ([7, 2], [4, 6]), ([9], [8])))
    real = ReadFlow._post_shared

    def abort_first(self, pending, *args):
        cons.abort("t1", wait=False)
        return real(self, pending, *args)

    monkeypatch.setattr(ReadFlow, "_post_shared", abort_first)
    before = [c.copy() for c in ccache]
    posted = cons._backend.posted
    handles = cons.read_many(reads)
    with pytest.raises(Exception):
        handles[1].wait(5)
    for i in (0, 2):
        handles[i].wait(5)
        _same(ccache, pcache, reads[i].local_blocks, reads[i].remote_blocks, s)
    assert cons._backend.posted == posted + 1  # the two live reads, in one post of their own ids
    for c, b in zip(ccache, before):
        np.testing.assert_array_equal(c[:, [4, 6]], b[:, [4, 6]])
