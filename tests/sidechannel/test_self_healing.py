"""Self-healing links (issue 13, Found 1) with real processes: real NIXL, real ZMQ.

A consumer reads from producer P1 (its link is cached), P1 is SIGKILLed and P2 starts on the same
host:port holding other requests. Whichever operation comes first (keepalive, abort, connect),
it heals the link with one fresh handshake, and the next read is byte-exact from P2. On the old
code the first operation left the cached link in state ``idle`` and every later read failed with
``ProtocolError: request(): expected state in ['ready']; got 'idle'``.
"""

import pytest

from kvxfer import AbortOutcome, PeerLostError

from sidechannel_peers import HOLD_BLOCKS, Peer, assert_read, consumer, free_port_block, poll


@pytest.fixture
def peers():
    started = []
    yield started
    for p in started:
        p.stop()


def _restart(peers, port: int) -> tuple:
    """P1 holding r1, read by a new consumer; P1 killed; P2 started on P1's port. Returns (cons, cache, p2)."""
    p1 = Peer(1, port, {"r1": HOLD_BLOCKS})
    peers.append(p1)
    cons, cache = consumer(handshake_timeout=2.0)
    try:
        cons.read(p1.address, [0, 1, 2, 3], HOLD_BLOCKS, "r1").wait(30)
        assert_read(cache, [0, 1, 2, 3], 1, HOLD_BLOCKS)
        old = cons.connect(*p1.address)
        assert old.engine_id == p1.ask("engine_id")
        p1.kill()
        p2 = Peer(2, port, {"r2": HOLD_BLOCKS, "r3": HOLD_BLOCKS})
        peers.append(p2)
    except BaseException:
        cons.close()
        raise
    return cons, cache, p2


@pytest.mark.parametrize("first", ["keepalive", "abort", "connect"])
def test_first_operation_after_a_restart_heals_the_link_and_reads_are_exact(peers, first):
    port = free_port_block(1)
    cons, cache, p2 = _restart(peers, port)
    with cons:
        if first == "keepalive":
            assert cons.keepalive(p2.address, ["r2", "r1"]).gone == ("r1",)   # P2 holds r2, not r1
        elif first == "abort":
            assert cons.abort("r3", remote=p2.address) is AbortOutcome.RELEASED
            assert p2.ask("holding") == ["r2"]                           # honoured, not left to the lease
        else:
            assert cons.connect(*p2.address).engine_id == p2.ask("engine_id")   # never the dead P1's link
        cons.read(p2.address, [4, 5, 6, 7], HOLD_BLOCKS, "r2").wait(30)
        assert_read(cache, [4, 5, 6, 7], 2, HOLD_BLOCKS)
        assert poll(lambda: p2.ask("finished")[0], ["r2"]) == ["r2"]
        assert cons.abort("r2", remote=p2.address) is AbortOutcome.NOT_HELD  # already sent and released


def test_operations_on_a_dead_peer_fail_typed_then_heal_when_it_is_back(peers):
    """Nobody at the address: keepalive reports the rank unreachable and abort UNREACHABLE (neither
    raises), connect raises PeerLostError; none of them leaves state behind: once a producer is
    back, reads work."""
    port = free_port_block(1)
    p1 = Peer(1, port, {"r1": HOLD_BLOCKS})
    peers.append(p1)
    cons, cache = consumer(handshake_timeout=1.0)
    with cons:
        cons.read(p1.address, [0, 1, 2, 3], HOLD_BLOCKS, "r1").wait(30)
        address = p1.address
        p1.kill()
        beat = cons.keepalive(address, ["r1"])
        assert beat.unreachable == ((address[0], address[1]),) and beat.gone == () and not beat.ok
        assert cons.abort("r1", remote=address) is AbortOutcome.UNREACHABLE
        with pytest.raises(PeerLostError):
            cons.connect(*address)
        p2 = Peer(3, port, {"r9": HOLD_BLOCKS})
        peers.append(p2)
        cons.read(address, [8, 9, 10, 11], HOLD_BLOCKS, "r9").wait(30)
        assert_read(cache, [8, 9, 10, 11], 3, HOLD_BLOCKS)
