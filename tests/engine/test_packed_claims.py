"""Claims name their block ids packed (``Claim.packed_ids``, little-endian uint32) to a producer
that announces ``PeerInfo.packed_ids``, and as a list to one that does not (an older release
would ignore the packed field and see a claim of no blocks). Either way the producer checks
every id against the hold; malformed packed ids are refused with the reason, nothing changed."""

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvxfer.engine.leases import LeaseTable
from kvxfer.errors import ProtocolError
from kvxfer.protocol import Claim, Grant, Refuse, claim_blocks, pack_id_lists, pack_ids

from agent_helpers import spec


def _record_claims(prod) -> list:
    seen: list = []
    handle = prod._service.handle

    def recording(message, peer):
        if isinstance(message, Claim):
            seen.append(message)
        return handle(message, peer)

    prod._service.handle = recording
    return seen


@pytest.mark.parametrize("packed_peer", [True, False], ids=["current-producer", "older-producer"])
def test_claims_are_packed_only_for_a_producer_that_reads_them(harness, packed_peer):
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    if not packed_peer:  # the previous release announces no packed_ids
        current = prod._peer_info
        prod._peer_info = lambda: msgspec.structs.replace(current(), packed_ids=False)
    seen = _record_claims(prod)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r", [5, 1, 7])
    cons.read(prod.address, [0, 3, 9], [5, 1, 7], "r").wait(5)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0, 3, 9]], pcache[layer][:, [5, 1, 7]])
    (claim,) = seen
    if packed_peer:
        assert claim.block_ids == [] and np.frombuffer(claim.packed_ids, "<u4").tolist() == [5, 1, 7]
    else:
        assert claim.block_ids == [5, 1, 7] and claim.packed_ids == b""


def test_a_packed_claim_naming_a_block_not_held_is_refused_with_the_id(harness):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    prod.hold("r", [5, 1, 7])
    peer = None
    for ids, want in (([5, 1, 8], "block 8 is not held for request 'r'"), ([7, 5, 1], None), ([1], None)):
        reply = prod._service.handle(Claim("r", [], "eng", 1.0, pack_ids(np.array(ids))), peer)
        if want is None:
            assert isinstance(reply, Grant), reply
        else:
            assert isinstance(reply, Refuse) and want in reply.reason


@pytest.mark.parametrize("claim,why", [
    (Claim("r", [5], "eng", 1.0, pack_ids(np.array([1]))), "expected one form"),
    (Claim("r", [], "eng", 1.0, b"\x05\x00\x00"), "3 bytes: expected a multiple of 4"),
])
def test_malformed_packed_ids_are_refused_and_change_nothing(harness, claim, why):
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    prod.hold("r", [5, 1, 7])
    before = prod._leases.counts()
    reply = prod._service.handle(claim, None)
    assert isinstance(reply, Refuse) and why in reply.reason
    assert prod._leases.counts() == before and prod.holding("r")
    with pytest.raises(ProtocolError, match=why):
        claim_blocks(claim)


def test_lease_table_checks_packed_ids_like_listed_ones():
    table = LeaseTable(60)
    ids = np.random.default_rng(0).permutation(4096)[:512]
    table.hold("r", ids, 4096)
    hold = table._holds["r"]
    assert hold.missing(pack_ids(ids)) is None                      # the held ids, in order
    assert hold.missing(pack_ids(ids[::-1].copy())) is None         # another order
    outside = int(np.setdiff1d(np.arange(4096), ids)[3])
    assert hold.missing(pack_ids(np.append(ids[:10], outside))) == outside
    assert pack_ids(np.array([1 << 32])) is None                    # does not fit: sent as a list


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, (1 << 33)), max_size=40), max_size=12))
def test_a_steps_ids_packed_together_equal_each_packed_alone(lists):
    """``pack_id_lists`` (one pass over a step's claims) gives exactly ``pack_ids`` of each list,
    None for a list with an id past 32 bits."""
    arrays = [np.array(ids, dtype=np.int64) for ids in lists]
    assert pack_id_lists(arrays) == [pack_ids(a) for a in arrays]
