"""Consumer-first push (issue 26): announce, chunked write streams with one completion, aux payload.

Public ``Agent`` calls over ``FakeBackend`` (real bytes) and the in-memory side channel; every
test checks the bytes that landed and the state an engine acts on.
"""

import time

import numpy as np
import pytest

from kvxfer import (BlockIdError, ConfigError, LeaseExpiredError, RequestState, TransferFailedError,
                    TransferTimeoutError)
from kvxfer.protocol import MAX_PAYLOAD

from agent_helpers import spec, wait_for


def _announced(prod, rid):
    assert wait_for(lambda: len(prod.announced(rid)) > 0)
    return prod.announced(rid)[0]


def test_announce_then_chunked_push_is_received_once_with_its_aux(harness):
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    prod, pcache = harness.agent(s, seed=1)
    cons.announce(prod.address, "r", [7, 0, 9, 4], payload=b"row=3")
    ann = _announced(prod, "r")
    assert ann.remote == cons.address and ann.payload == b"row=3" and ann.engine_id == cons.engine_id
    assert ann.block_ids.tolist() == [7, 0, 9, 4]
    assert cons.status("r") is RequestState.IN_FLIGHT
    stream = prod.open_writes(ann.remote, "r")
    first = stream.write([1, 2], ann.block_ids[:2])       # two chunks in flight together
    second = stream.write([3, 5], ann.block_ids[2:])
    first.wait(5), second.wait(5)
    time.sleep(0.05)                                     # every notification had time to arrive
    assert cons.status("r") is RequestState.IN_FLIGHT and "r" not in cons.finished().received
    assert stream.finish(aux=b"first-token=42") is stream.handle
    stats = stream.handle.wait(5)
    assert stats.num_bytes > 0 and stream.writes == 2
    assert wait_for(lambda: cons.status("r") is RequestState.RECEIVED)
    assert "r" in cons.finished().received
    assert cons.take_aux("r") == {prod.engine_id: b"first-token=42"}
    assert cons.take_aux("r") == {}                      # taken once
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [7, 0, 9, 4]], pcache[layer][:, [1, 2, 3, 5]])


def test_a_stream_with_no_chunk_still_ends_and_delivers_its_aux(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    cons.announce(prod.address, "r", [1])
    ann = _announced(prod, "r")
    prod.open_writes(ann.remote, "r").finish(aux=b"x").wait(5)
    assert wait_for(lambda: cons.status("r") is RequestState.RECEIVED)
    assert cons.take_aux("r") == {prod.engine_id: b"x"}


def test_two_producers_each_finish_before_the_request_is_received(harness):
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    p1, c1 = harness.agent(s, seed=1)
    p2, c2 = harness.agent(s, seed=3)
    cons.announce(p1.address, "r", [0, 1], producers=2)
    cons.announce(p2.address, "r", [2, 3], producers=2)
    a1, a2 = _announced(p1, "r"), _announced(p2, "r")
    s1 = p1.open_writes(a1.remote, "r")
    s1.write([4, 5], a1.block_ids)
    s1.finish(b"one").wait(5)
    time.sleep(0.05)
    assert cons.status("r") is RequestState.IN_FLIGHT
    s2 = p2.open_writes(a2.remote, "r")
    s2.write([6, 7], a2.block_ids)
    s2.finish(b"two").wait(5)
    assert wait_for(lambda: cons.status("r") is RequestState.RECEIVED)
    assert cons.take_aux("r") == {p1.engine_id: b"one", p2.engine_id: b"two"}
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 1]], c1[layer][:, [4, 5]])
        np.testing.assert_array_equal(ccache[layer][:, [2, 3]], c2[layer][:, [6, 7]])


def test_a_push_not_finished_before_the_announce_deadline_fails_typed(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    cons.announce(prod.address, "r", [1], timeout=0.2)
    _announced(prod, "r")                                  # the producer never writes
    assert wait_for(lambda: cons.status("r") is RequestState.FAILED)
    error = cons.finished().failed["r"]
    assert isinstance(error, TransferTimeoutError) and "did not all arrive before the deadline" in str(error)


def test_an_announce_to_nobody_fails_the_request_peer_lost(harness):
    cons, _ = harness.agent(spec(), seed=2, handshake_timeout=0.3)
    cons.announce(("127.0.0.1", 1), "r", [1], timeout=5)
    assert wait_for(lambda: cons.status("r") is RequestState.FAILED)
    assert "announce of 'r' to 127.0.0.1:1" in str(cons.finished().failed["r"])


def test_a_consumer_abort_ends_the_announcement_and_refuses_the_producers_end(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    cons.announce(prod.address, "r", [1])
    ann = _announced(prod, "r")
    cons.abort("r", remote=prod.address)
    assert prod.announced("r") == () and prod.status("r") is RequestState.ABORTED
    assert "r" in prod.finished().aborted
    stream = prod.open_writes(ann.remote, "r")
    with pytest.raises(TransferFailedError, match="'r' was aborted by this consumer"):
        stream.finish().wait(5)
    assert cons.status("r") is not RequestState.RECEIVED


def test_an_end_for_a_request_the_consumer_never_announced_is_refused_naming_it(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    with pytest.raises(TransferFailedError, match="request 'ghost' is not expected here"):
        prod.open_writes(cons.address, "ghost").finish().wait(5)


def test_bad_announce_and_stream_arguments_raise_at_once_naming_the_value(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    quiet, _ = harness.agent(spec(), seed=3, listen=False)
    with pytest.raises(ConfigError, match="call listen"):
        quiet.announce(prod.address, "r", [1])
    with pytest.raises(BlockIdError):
        cons.announce(prod.address, "r", [1, 1])
    with pytest.raises(ConfigError, match="producers must be an integer >= 1; got 0"):
        cons.announce(prod.address, "r", [1], producers=0)
    with pytest.raises(ConfigError, match=f"at most {MAX_PAYLOAD} bytes; got {MAX_PAYLOAD + 1}"):
        cons.announce(prod.address, "r", [1], payload=bytes(MAX_PAYLOAD + 1))
    with pytest.raises(ConfigError, match="remote must be a"):
        cons.announce("nowhere", "r", [1])
    stream = prod.open_writes(cons.address, "r")
    stream.finish()
    with pytest.raises(ConfigError, match="is finished: no chunk may follow"):
        stream.write([1], [2])
    with pytest.raises(ConfigError, match="already finished"):
        stream.finish()


def test_a_producer_that_gives_up_fails_the_consumers_request_at_once_with_its_reason(harness):
    cons, _ = harness.agent(spec(), seed=2)
    prod, _ = harness.agent(spec(), seed=1)
    cons.announce(prod.address, "r", [1], timeout=30)
    ann = _announced(prod, "r")
    stream = prod.open_writes(ann.remote, "r")
    stream.abort(TransferFailedError("prefill aborted the request"))
    assert wait_for(lambda: cons.status("r") is RequestState.FAILED)
    error = cons.finished().failed["r"]
    assert isinstance(error, TransferFailedError) and "prefill aborted the request" in str(error)
    assert isinstance(stream.exception(), TransferFailedError)


def test_many_chunks_completing_inside_one_another_s_poll_end_the_stream_once(harness):
    """Regression: a chunk completing inside the poll of another chunk's completion (done-callbacks
    on the same thread) must not deadlock the stream's end (it did with SGLang's chunked prefill)."""
    s = spec(num_blocks=40)
    cons, ccache = harness.agent(s, seed=2)
    prod, pcache = harness.agent(s, seed=1)
    cons.announce(prod.address, "r", list(range(32)))
    ann = _announced(prod, "r")
    stream = prod.open_writes(ann.remote, "r")
    for i in range(16):
        stream.write([2 * i, 2 * i + 1], ann.block_ids[2 * i:2 * i + 2])
    stream.finish(b"aux").wait(10)
    assert wait_for(lambda: cons.status("r") is RequestState.RECEIVED)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, :32], pcache[layer][:, :32])


def test_a_consumer_abort_stops_the_producers_open_stream(harness):
    """The consumer aborts a push while the producer's stream is open: the stream fails with the
    abort and posts no further chunk (a later ``write`` raises, and nothing of it lands in the
    consumer's blocks). Before, the producer only forgot the announcement and kept pushing into
    those blocks. (A chunk already posted may still land: docs/api.md, "Consumer-first push".)"""
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    prod, _ = harness.agent(s, seed=1)
    cons.announce(prod.address, "r", [7, 0, 9, 4])
    ann = _announced(prod, "r")
    stream = prod.open_writes(ann.remote, "r")
    stream.write([1, 2], ann.block_ids[:2]).wait(5)  # the first chunk landed
    before = [layer[:, [9, 4]].copy() for layer in ccache]
    cons.abort("r", remote=prod.address)
    with pytest.raises(LeaseExpiredError, match="aborted by the consumer"):
        stream.handle.wait(5)
    with pytest.raises(LeaseExpiredError, match="aborted by the consumer"):
        stream.write([3, 5], ann.block_ids[2:])
    time.sleep(0.1)
    assert prod.status("r") is RequestState.ABORTED
    for layer, old in zip(ccache, before):          # nothing of the refused chunk landed
        np.testing.assert_array_equal(layer[:, [9, 4]], old)
