"""An engine's step, with real processes over real NIXL (UCX forced to TCP, as in test_chaos.py).

* A frozen producer delays only its own reads: ``read`` never waits on a peer, the healthy
  producer's reads finish as if the frozen one were not there, the frozen one's fail typed in time.
* A batch (``read_many``) where one request's claim is refused: the others are exact, the refused
  one fails typed and nothing lands in its blocks after its handle ended.
* The producer releases, or lets expire, holds while the batch's claims travel: every read is
  exact or fails typed; none succeeds with bytes of blocks the producer reused.
docs/reliability.md lists them.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvxfer import KvxferError, KVSpec, LeaseExpiredError, ReadRequest
from kvxfer.testing import free_port_block

from chaos_peers import BIG, REUSED, Peer, blocks_of, consumer, fill, freeze, idle, wait_until

SEED = 11


@pytest.fixture(scope="module")
def pair():
    healthy, frozen = Peer(KVSpec(**BIG), SEED, wait=False), Peer(KVSpec(**BIG), SEED + 1, wait=False)
    healthy.ready(), frozen.ready()
    agent, cache = consumer(KVSpec(**BIG), side_channel_port=free_port_block(1))
    yield healthy, frozen, agent, cache
    agent.close()
    for peer in (healthy, frozen):
        peer.stop()


def test_a_frozen_producer_delays_only_its_own_reads(pair):
    healthy, frozen, agent, cache = pair
    rng = np.random.default_rng(1)
    n = 20
    src = rng.permutation(BIG["num_blocks"])[: 2 * n * 4].reshape(2 * n, 4)
    dst = rng.permutation(BIG["num_blocks"])[: 2 * n * 4].reshape(2 * n, 4)
    for i in range(n):
        healthy.ask(("hold", f"h{i}", src[2 * i].tolist(), None, False))
        frozen.ask(("hold", f"f{i}", src[2 * i + 1].tolist(), None, False))
    want = {i: healthy.ask(("blocks", src[2 * i].tolist())) for i in range(n)}
    agent.connect(*healthy.address)
    agent.connect(*frozen.address)  # handshaken: then frozen
    freeze(frozen.pid)
    timeout = 2.0
    try:
        issued, calls = {}, []
        handles = {}
        for i in range(n):  # interleaved, from one thread
            for name, peer, row in ((f"h{i}", healthy, 2 * i), (f"f{i}", frozen, 2 * i + 1)):
                started = time.monotonic()
                handles[name] = agent.read(peer.address, dst[row], src[row], name, timeout=timeout)
                calls.append(time.monotonic() - started)
                issued[name] = started
        finished = {}
        deadline = time.monotonic() + timeout + 1.0
        while len(finished) < 2 * n and time.monotonic() < deadline:
            for name, handle in handles.items():
                if name not in finished and handle.done():
                    finished[name] = time.monotonic()
            time.sleep(0.0005)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # A read() that waited on the frozen producer would block for its whole timeout (2 s). The
    # bounds leave room for a host that deschedules the test for a moment (CI once saw one call of
    # 135 ms among 40 of ~1 ms), and the median catches a wait that every frozen read pays.
    slow = int(np.argmax(calls))
    assert max(calls) < timeout / 4, f"read() call {slow} of {len(calls)} blocked {max(calls) * 1e3:.1f} ms"
    frozen_calls = sorted(calls[1::2])
    assert frozen_calls[n // 2] < 0.01, f"read() calls to the frozen producer took {frozen_calls} s"
    for i in range(n):
        name = f"h{i}"
        handles[name].wait(0)  # exact, below
        # queued behind the frozen producer, it would have waited for that producer's 2 s timeout
        assert finished[name] - issued[name] < timeout / 2, f"{name} took {(finished[name] - issued[name]) * 1e3:.0f} ms"
        for got, exp in zip(blocks_of(cache, dst[2 * i]), want[i]):
            np.testing.assert_array_equal(got, exp)
        name = f"f{i}"
        with pytest.raises(KvxferError):
            handles[name].wait(0)
        assert finished[name] - issued[name] <= timeout + 0.5, f"{name} failed late"
    assert wait_until(lambda: idle(healthy.ask(("stats",))), 10), healthy.ask(("stats",))
    # The frozen producer, awake again, frees its holds once the claims' windows pass.
    assert wait_until(lambda: frozen.ask(("stats",))["claimed_requests"] == 0, 10)


def test_a_refused_claim_in_a_batch_fails_only_its_request(pair):
    healthy, _, agent, cache = pair
    healthy.ask(("reset",))
    rng = np.random.default_rng(2)
    src = rng.permutation(BIG["num_blocks"])[:40].reshape(10, 4)
    dst = rng.permutation(BIG["num_blocks"])[:40].reshape(10, 4)
    for i in range(10):
        if i != 4:  # request 4 is never held: its claim is refused
            healthy.ask(("hold", f"b{i}", src[i].tolist(), None, True))
        fill(cache, dst[i])
    want = [healthy.ask(("blocks", src[i].tolist())) for i in range(10)]
    handles = agent.read_many([ReadRequest(healthy.address, dst[i], src[i], f"b{i}", timeout=10) for i in range(10)])
    for i, handle in enumerate(handles):
        if i == 4:
            with pytest.raises(LeaseExpiredError, match="not held"):
                handle.wait(15)
            continue
        handle.wait(15)
        for got, exp in zip(blocks_of(cache, dst[i]), want[i]):
            np.testing.assert_array_equal(got, exp)
    ended = blocks_of(cache, dst[4])
    time.sleep(0.5)
    for got, exp in zip(blocks_of(cache, dst[4]), ended):
        np.testing.assert_array_equal(got, exp, err_msg="bytes landed in a refused read's blocks after it ended")
    assert wait_until(lambda: all(f"b{i}" in healthy.ask(("reused",)) for i in range(10) if i != 4), 10)
    assert wait_until(lambda: idle(healthy.ask(("stats",))), 10), healthy.ask(("stats",))


@pytest.mark.parametrize("end", ["release", "expire"])
def test_holds_ending_while_the_claims_travel_never_give_reused_bytes(pair, end):
    healthy, _, agent, cache = pair
    healthy.ask(("reset",))
    rng = np.random.default_rng(3)
    outcomes = []
    for trial in range(5):
        src = rng.permutation(BIG["num_blocks"])[:64].reshape(16, 4)
        dst = rng.permutation(BIG["num_blocks"])[:64].reshape(16, 4)
        lease = 0.005 * (1 + trial % 3) if end == "expire" else None
        names = [f"{end}-{trial}-{i}" for i in range(16)]
        want = [healthy.ask(("blocks", src[i].tolist())) for i in range(16)]
        for i, name in enumerate(names):
            healthy.ask(("hold", name, src[i].tolist(), lease, True))  # reused the moment they are freed
            fill(cache, dst[i])
        handles = agent.read_many([ReadRequest(healthy.address, dst[i], src[i], name, timeout=10)
                                   for i, name in enumerate(names)])
        if end == "release":
            for name in names[::2]:
                healthy.ask(("release", name))
        for i, handle in enumerate(handles):
            try:
                handle.wait(15)
            except KvxferError:
                outcomes.append("typed")
                continue
            got = blocks_of(cache, dst[i])
            for g, exp in zip(got, want[i]):
                assert not (g == REUSED).all(axis=tuple(range(1, g.ndim))).any(), "a read gave reused bytes"
                np.testing.assert_array_equal(g, exp)
            outcomes.append("exact")
        assert wait_until(lambda: idle(healthy.ask(("stats",))), 10), healthy.ask(("stats",))
        healthy.ask(("reset",))
    assert "exact" in outcomes, outcomes
