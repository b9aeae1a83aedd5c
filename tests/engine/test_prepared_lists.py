"""Small direct reads posted through prepared per-block lists (``kvxfer.engine.paths.prepared``),
over FakeBackend: exact bytes wherever the lists are used, the plan's rows wherever they do not
apply (a large read, a layout change), and fresh lists for a producer that restarted."""

import numpy as np
import pytest

from kvxfer import ReadRequest
from kvxfer.backend.fake import FakeBackend
from kvxfer.engine.paths import prepared as prepared_mod

from agent_helpers import free_port, spec, wait_for


@pytest.fixture
def counted(monkeypatch):
    """Count the posts each kind of backend call made."""
    seen = {"prepared": 0, "rows": 0}
    real_post, real_prepared = FakeBackend.post, FakeBackend.post_prepared

    def post(self, *a, **k):
        seen["rows"] += 1
        return real_post(self, *a, **k)

    def post_prepared(self, *a, **k):
        seen["prepared"] += 1
        seen["rows"] -= 1  # it posts its rows through post
        return real_prepared(self, *a, **k)

    monkeypatch.setattr(FakeBackend, "post", post)
    monkeypatch.setattr(FakeBackend, "post_prepared", post_prepared)
    return seen


def _warm(cons, prod, counted) -> None:
    """A first small read from ``prod`` (it posts rows: the lists are prepared on a thread of their
    own meanwhile, never on the reading thread); returns once they are ready, counts reset."""
    prod.hold("warm", [10])
    cons.read(prod.address, [11], [10], "warm").wait(5)
    link = cons._parts.peers.cached(*prod.address)
    assert wait_for(lambda: (link.paths.get("prepared") or (None, None))[1] is not None)
    counted["prepared"] = counted["rows"] = 0


def _same(ccache, pcache, local, remote, s):
    for layer in range(s.num_layers):
        for kv in range(2):
            np.testing.assert_array_equal(ccache[layer][kv][local], pcache[layer][kv][remote])


def test_a_small_read_is_posted_through_prepared_lists_and_is_exact(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    _warm(cons, prod, counted)
    prod.hold("r1", [5, 1, 7])
    cons.read(prod.address, [0, 3, 9], [5, 1, 7], "r1").wait(5)
    _same(ccache, pcache, [0, 3, 9], [5, 1, 7], s)
    prod.hold("r2", [2, 11])
    token = prod.hold_token("r2")
    cons.read_many([ReadRequest(prod.address, [4, 10], [2, 11], "r2", token=token)])[0].wait(5)
    _same(ccache, pcache, [4, 10], [2, 11], s)
    assert counted == {"prepared": 2, "rows": 0}


def test_a_step_of_small_token_reads_is_one_prepared_post(harness, counted):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    _warm(cons, prod, counted)
    reads = []
    for i, (src, dst) in enumerate((([5, 1], [0, 3]), ([7, 2], [4, 6]), ([9], [8]))):
        prod.hold(f"s{i}", src)
        reads.append(ReadRequest(prod.address, dst, src, f"s{i}", token=prod.hold_token(f"s{i}")))
    for h in cons.read_many(reads):
        h.wait(5)
    for r in reads:
        _same(ccache, pcache, r.local_blocks, r.remote_blocks, s)
    assert counted == {"prepared": 1, "rows": 0}


def test_a_read_larger_than_the_bound_posts_the_plans_rows(harness, counted, monkeypatch):
    s = spec()
    monkeypatch.setattr(prepared_mod, "PREPARED_DESCRIPTORS", 2 * s.num_layers * 2)  # two blocks' worth
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    _warm(cons, prod, counted)
    prod.hold("small", [5, 1])
    prod.hold("large", [2, 3, 4])
    cons.read(prod.address, [0, 3], [5, 1], "small").wait(5)
    cons.read(prod.address, [6, 7, 8], [2, 3, 4], "large").wait(5)
    _same(ccache, pcache, [0, 3], [5, 1], s)
    _same(ccache, pcache, [6, 7, 8], [2, 3, 4], s)
    assert counted == {"prepared": 1, "rows": 1}


def test_a_layout_change_posts_the_plans_rows(harness, counted):
    """An NHD producer read into an HND cache moves pieces of blocks: no whole-block lists."""
    from kvxfer.layout.spec import Layout

    prod, pcache = harness.agent(spec(layout=Layout.NHD), seed=1)
    cons, ccache = harness.agent(spec(layout=Layout.HND), seed=2, listen=False)
    prod.hold("r", [5, 1])
    cons.read(prod.address, [0, 3], [5, 1], "r").wait(5)
    assert counted["prepared"] == 0 and counted["rows"] >= 1
    # the bytes, token by token: NHD [block, token, head, dim] against HND [block, head, token, dim]
    s = spec()
    for layer in range(s.num_layers):
        for kv in range(2):
            got = ccache[layer][kv][[0, 3]].reshape(2, s.num_kv_heads, s.block_size, -1)
            want = pcache[layer][kv][[5, 1]].reshape(2, s.block_size, s.num_kv_heads, -1).transpose(0, 2, 1, 3)
            np.testing.assert_array_equal(got, want)


def test_a_restarted_producer_gets_fresh_lists(harness, counted):
    s = spec()
    port = free_port()
    prod, _ = harness.agent(s, seed=1, port=port)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    _warm(cons, prod, counted)
    prod.hold("a", [4, 6])
    cons.read(prod.address, [0, 1], [4, 6], "a").wait(5)
    harness.agents.remove(prod)
    prod.close()
    prod2, pcache2 = harness.agent(s, seed=3, port=port)
    cons.connect(*prod2.address)
    _warm(cons, prod2, counted)  # the new link's own lists (the old ones went with its peer)
    prod2.hold("b", [4, 6])
    cons.read(prod2.address, [2, 3], [4, 6], "b").wait(5)
    _same(ccache, pcache2, [2, 3], [4, 6], s)
    assert counted == {"prepared": 1, "rows": 0}


def test_a_run_of_adjacent_blocks_keeps_the_plans_joined_rows(harness, counted):
    """Blocks adjacent on both sides are one descriptor per region in the plan's rows, fewer than
    the prepared lists' one per block: such a read posts the rows."""
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    _warm(cons, prod, counted)
    prod.hold("run", [6, 7, 8])
    stats = cons.read(prod.address, [1, 2, 3], [6, 7, 8], "run").wait(5)
    _same(ccache, pcache, [1, 2, 3], [6, 7, 8], s)
    assert counted == {"prepared": 0, "rows": 1}
    assert stats.descriptors == s.num_layers * 2  # one per region
