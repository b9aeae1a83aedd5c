"""The Agent end to end over FakeBackend: bytes moved, holds released, every bad input typed."""

import time

import numpy as np
import pytest

from kvxfer import (AbortOutcome, AuthenticationError, BlockIdError, ClosedError, IncompatiblePeerError,
                    LeaseExpiredError, PeerLostError, RequestState, TransferTimeoutError, WaitTimeout)
from kvxfer.clock import ManualClock

from agent_helpers import free_port, spec, wait_for


def blocks_of(cache, s, layer, kv, ids):
    """The bytes of blocks ``ids`` of one region (split storage: tensor [2, blocks, ...])."""
    return cache[layer][kv][ids]


def test_read_moves_exactly_the_requested_blocks_and_releases_the_hold(harness):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    before = [c.copy() for c in ccache]
    prod.hold("r1", [5, 1, 7])
    stats = cons.read(prod.address, [0, 3, 9], [5, 1, 7], "r1").wait(5)
    assert stats.num_bytes == 3 * 2 * 3 * s.block_bytes
    for layer in range(s.num_layers):
        for kv in range(2):
            np.testing.assert_array_equal(ccache[layer][kv][[0, 3, 9]], pcache[layer][kv][[5, 1, 7]])
            untouched = [i for i in range(s.num_blocks) if i not in (0, 3, 9)]
            np.testing.assert_array_equal(ccache[layer][kv][untouched], before[layer][kv][untouched])
    assert wait_for(lambda: not prod.holding("r1"))
    assert "r1" in prod.finished().sent
    assert "r1" in cons.finished().received


def test_read_of_request_not_held_is_refused_and_writes_only_its_own_blocks(harness):
    """The read's move may start while its claim travels: a refused read may have written its own
    destination block, never another, and its handle ends only once that move has ended."""
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    before = [c.copy() for c in ccache]
    with pytest.raises(LeaseExpiredError, match="not held"):
        cons.read(prod.address, [0], [1], "nope").wait()
    assert cons.stats().in_flight == 0 and cons.stats().quarantined_blocks == 0
    for a, b in zip(ccache, before):
        np.testing.assert_array_equal(a[:, 1:], b[:, 1:])


def test_read_of_block_not_held_names_the_block(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1, 2])
    with pytest.raises(LeaseExpiredError, match="block 3"):
        cons.read(prod.address, [0, 1], [2, 3], "r").wait()
    assert prod.holding("r")  # a refused claim changes nothing


@pytest.mark.parametrize("local,remote,match", [
    ([12], [0], r"local block id 12 is outside \[0, 12\)"),
    ([-1], [0], r"local block id -1"),
    ([0], [99], "99"),
])
def test_unknown_block_ids_are_typed_errors(harness, local, remote, match):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [0])
    with pytest.raises(BlockIdError, match=match):
        cons.read(prod.address, local, remote, "r").wait()
    assert prod.holding("r")


def test_hold_of_unknown_block_is_refused(harness):
    prod, _ = harness.agent(spec(), seed=1)
    with pytest.raises(BlockIdError, match=r"block id 40"):
        prod.hold("r", [0, 40])
    assert not prod.holding("r")


def test_other_model_is_incompatible_at_handshake(harness):
    prod, _ = harness.agent(spec(model="llama"), seed=1)
    cons, _ = harness.agent(spec(model="qwen"), seed=2, listen=False)
    with pytest.raises(IncompatiblePeerError):
        cons.connect(*prod.address)


def test_wrong_auth_key_is_an_authentication_error(harness):
    prod, _ = harness.agent(spec(), seed=1, auth_key=b"secret-key-aaaaaaaaaa")
    cons, _ = harness.agent(spec(), seed=2, listen=False, auth_key=b"secret-key-bbbbbbbbbb")
    with pytest.raises(AuthenticationError):
        cons.connect(*prod.address)


def test_wait_past_deadline_times_out_then_engine_deadline_fails_the_handle(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1])
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [0], [1], "r", timeout=0.3)
    with pytest.raises(WaitTimeout):   # only the wait ran out: the read goes on
        handle.wait(0.05)
    assert cons.status("r") is RequestState.IN_FLIGHT and cons.stats().in_flight == 1
    assert wait_for(handle.done, 5)
    assert isinstance(handle.exception(), TransferTimeoutError)
    assert "r" in cons.finished().failed


def test_consumer_abort_releases_the_producer_hold(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1, 2])
    assert cons.abort("r", remote=prod.address) is AbortOutcome.RELEASED
    assert not prod.holding("r")
    fin = prod.finished()
    assert "r" in fin.aborted and "r" not in fin.expired   # an abort is not an expiry
    assert prod.status("r") is RequestState.ABORTED


def test_lease_expiry_refuses_a_late_read(harness):
    s = spec()
    clock = ManualClock()
    prod, _ = harness.agent(s, seed=1, clock=clock, lease_timeout=30.0)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1])
    clock.advance(31)
    assert wait_for(lambda: not prod.holding("r"))
    fin = prod.finished()
    assert "r" in fin.expired and "r" not in fin.aborted
    assert prod.status("r") is RequestState.EXPIRED
    with pytest.raises(LeaseExpiredError):
        cons.read(prod.address, [0], [1], "r").wait()


def test_heterogeneous_tp_two_producers_to_one_consumer(harness):
    base = dict(num_kv_heads=4)
    port = free_port()  # ranks of one instance listen on consecutive ports: base + tp_rank
    p0, pc0 = harness.agent(spec(tp_size=2, tp_rank=0, **base), seed=10, port=port)
    p1, pc1 = harness.agent(spec(tp_size=2, tp_rank=1, **base), seed=11, port=port)
    assert p1.address[1] == port + 1
    cons, cc = harness.agent(spec(**base), seed=12, listen=False)
    for p in (p0, p1):
        p.hold("r", [2, 3])
    cons.read(p0.address, [7, 8], [2, 3], "r").wait(5)
    for layer in range(3):
        for kv in range(2):
            got = cc[layer][kv][[7, 8]]            # NHD [blocks, tokens, 4 heads, dim]
            np.testing.assert_array_equal(got[:, :, 0:2], pc0[layer][kv][[2, 3]])
            np.testing.assert_array_equal(got[:, :, 2:4], pc1[layer][kv][[2, 3]])
    assert wait_for(lambda: not p0.holding("r") and not p1.holding("r"))


def test_restarted_producer_is_rehandshaken(harness):
    s = spec()
    port = free_port()
    prod, _ = harness.agent(s, seed=1, port=port)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    old = cons.connect(*prod.address).engine_id
    harness.agents.remove(prod)
    prod.close()
    prod2, pcache2 = harness.agent(s, seed=3, port=port)
    prod2.hold("r", [4])
    cons.read(prod2.address, [0], [4], "r").wait(5)
    assert cons.connect(*prod2.address).engine_id == prod2.engine_id != old
    np.testing.assert_array_equal(ccache[0][0][0], pcache2[0][0][4])


def test_dead_producer_gives_peer_lost_within_deadline(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False, handshake_timeout=0.3)
    addr = prod.address
    harness.agents.remove(prod)
    prod.close()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        cons.read(addr, [0], [1], "r").wait()
    assert time.monotonic() - t0 < 5


def test_closed_agent_raises_closed_error_and_close_is_idempotent(harness):
    a, _ = harness.agent(spec(), seed=1)
    a.close()
    a.close()
    with pytest.raises(ClosedError):
        a.hold("r", [0])


def test_many_requests_in_flight_at_once(harness):
    s = spec(num_blocks=40)
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    cons._backend.hold_transfers(True)
    handles = []
    for i in range(20):
        prod.hold(f"r{i}", [i, 20 + i])
        handles.append(cons.read(prod.address, [2 * i, 2 * i + 1], [i, 20 + i], f"r{i}"))
    assert not any(h.done() for h in handles)
    cons._backend.hold_transfers(False)
    for h in handles:
        h.wait(5)
    for i in range(20):
        np.testing.assert_array_equal(ccache[1][1][[2 * i, 2 * i + 1]], pcache[1][1][[i, 20 + i]])
    assert wait_for(lambda: all(not prod.holding(f"r{i}") for i in range(20)))


def test_close_deregisters_everything_and_fails_in_flight(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1])
    cons._backend.hold_transfers(True)
    handle = cons.read(prod.address, [0], [1], "r")
    backend = cons._backend
    assert backend.registered()
    cons.close()
    assert isinstance(handle.exception(), ClosedError)
    assert cons._registry.regions == ()


def test_duplicate_request_id_in_flight_is_refused(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [1, 2])
    cons._backend.hold_transfers(True)
    cons.read(prod.address, [0], [1], "r")
    from kvxfer import RequestInFlightError
    with pytest.raises(RequestInFlightError, match="already in flight"):
        cons.read(prod.address, [3], [2], "r")


def test_a_write_contacts_only_the_consumer_ranks_that_need_its_heads(harness):
    """Producer rank 1 of TP 2 pushes into a TP 2 consumer instance: its heads go to consumer rank 1
    only, and consumer rank 0 is never handshaken (it may not even be up)."""
    base = dict(num_kv_heads=4)
    port = free_port()  # the consumer instance's ranks listen on port and port + 1
    c1, cc1 = harness.agent(spec(tp_size=2, tp_rank=1, **base), seed=21, port=port)  # listens on port + 1
    assert c1.address[1] == port + 1
    prod, pc = harness.agent(spec(tp_size=2, tp_rank=1, **base), seed=22, listen=False)
    c1.expect_writes("w")
    # rank 0 of the instance (port) is not up: nothing may need it
    prod.write(("127.0.0.1", port + 1), [3, 5], [6, 1], "w", timeout=5).wait(5)
    assert wait_for(lambda: "w" in c1.finished().received)
    for layer in range(3):
        for kv in range(2):
            np.testing.assert_array_equal(cc1[layer][kv][[6, 1]], pc[layer][kv][[3, 5]])
    assert [link.spec.tp_rank for link in prod._peers.links()] == [1]
