"""The staged path with producer-side pack, between real processes over real NIXL (UCX), in DRAM.

``transfer_path="staged"`` runs the GPU pipeline's protocol on host memory (the host twin of
the pair-copy kernel), so everything but the CUDA kernel is exercised here: PackRequest
validation, pipeline notifications routed by tag, staging slots, leases, abort, peer death.
"""

import numpy as np
import pytest

from kvxfer import (AgentConfig, KVSpec, LeaseExpiredError, PeerLostError, ProtocolError,
                    TransferTimeoutError)
from kvxfer.protocol.messages import PackRequest

from nixl_peers import cache_for, free_port_block
from staged_peers import StagedProducer, expect_read, logical
from test_agent_nixl import COMMON, consumer, poll

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


def _check(cspec, cache, cache0, c_ids, sources, p_ids):
    """Read blocks equal the oracle; every other block kept its bytes."""
    np.testing.assert_array_equal(logical(cspec, cache, c_ids), expect_read(cspec, cache0, c_ids, sources, p_ids))
    others = [b for b in range(cspec.num_blocks) if b not in set(c_ids)]
    np.testing.assert_array_equal(logical(cspec, cache, others), logical(cspec, cache0, others))


@pytest.mark.parametrize("p_layout,c_layout", [("NHD", "NHD"), ("HND", "NHD")])
def test_staged_read_fragmented_ids_is_byte_exact_and_releases(producers, p_layout, c_layout):
    pspec, cspec = KVSpec(**COMMON, layout=p_layout), KVSpec(**COMMON, layout=c_layout)
    p_ids, c_ids = [31, 2, 17, 18, 19, 40, 5], [3, 4, 5, 6, 20, 21, 47]
    prod = StagedProducer(pspec, seed=1, port=free_port_block(), holds={"r1": p_ids})
    producers.append(prod)
    cons, cache = consumer(cspec, **STAGED)
    cache0 = cache_for(cspec, 99)
    with cons:
        stats = cons.read(prod.address, c_ids, p_ids, "r1").wait(60)
        assert stats.mode == "staged" and stats.peers == 1
        assert stats.num_bytes == len(p_ids) * pspec.block_bytes * pspec.num_layers * 2
        _check(cspec, cache, cache0, c_ids, [(pspec, cache_for(pspec, 1))], p_ids)
        assert poll(lambda: prod.ask("finished")[0], ["r1"]) == ["r1"]   # the lease ended as "sent"
        assert poll(lambda: prod.ask("serving"), (0, 0)) == (0, 0)       # no job, no slot left
        assert cons._paths.kit.slots_in_use == 0 and cons._paths.kit.router.active() == 0
        assert cons.finished().received == {"r1"}


def test_staged_tp1_to_tp2_each_consumer_rank_packs_its_heads(producers):
    pspec = KVSpec(**COMMON)
    p_ids = [11, 12, 30]
    prod = StagedProducer(pspec, seed=3, port=free_port_block(), holds={"r": p_ids})
    producers.append(prod)
    for rank in range(2):
        cspec = KVSpec(**COMMON, tp_size=2, tp_rank=rank)
        cons, cache = consumer(cspec, seed=50 + rank, **STAGED)
        with cons:
            assert cons.read(prod.address, [1, 2, 9], p_ids, "r").wait(60).mode == "staged"
            _check(cspec, cache, cache_for(cspec, 50 + rank), [1, 2, 9], [(pspec, cache_for(pspec, 3))], p_ids)
        if rank == 0:  # the hold waits for both consumer ranks
            assert prod.ask("holding") == ["r"]
    assert poll(lambda: prod.ask("finished")[0], ["r"]) == ["r"]


def test_staged_tp2_hnd_to_tp1_nhd_reads_both_ranks_at_once(producers):
    port = free_port_block()
    p_ids = [7, 8, 9, 30]
    specs = [KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=r) for r in range(2)]
    for rank, spec in enumerate(specs):
        producers.append(StagedProducer(spec, seed=10 + rank, port=port, holds={"r": p_ids}))
    cspec = KVSpec(**COMMON, layout="NHD")
    cons, cache = consumer(cspec, **STAGED)
    with cons:
        stats = cons.read(producers[0].address, [0, 1, 2, 3], p_ids, "r").wait(60)
        assert stats.mode == "staged" and stats.peers == 2
        sources = [(spec, cache_for(spec, 10 + r)) for r, spec in enumerate(specs)]
        _check(cspec, cache, cache_for(cspec, 99), [0, 1, 2, 3], sources, p_ids)
    for p in producers:
        assert poll(lambda: p.ask("finished")[0], ["r"]) == ["r"]
        assert poll(lambda: p.ask("serving"), (0, 0)) == (0, 0)


def _stalled_read(producers, timeout: float):
    """A staged read whose producer packs piece 0 and then stalls: returns (producer, consumer, handle)."""
    spec = KVSpec(**COMMON)
    p_ids = [1, 2, 3, 4, 5, 6]
    prod = StagedProducer(spec, seed=1, port=free_port_block(), holds={"r": p_ids}, stall_after=1)
    producers.append(prod)
    cons, _ = consumer(spec, **STAGED)
    handle = cons.read(prod.address, [10, 11, 12, 13, 14, 15], p_ids, "r", timeout=timeout)
    assert poll(lambda: prod.ask("serving")[0], 1) == 1      # accepted, and stuck after piece 0
    return prod, cons, handle


def test_consumer_abort_mid_transfer_releases_hold_and_slots(producers):
    prod, cons, handle = _stalled_read(producers, timeout=120)
    with cons:
        assert not handle.done()
        cons.abort("r")
        with pytest.raises(LeaseExpiredError, match="aborted by the consumer"):
            handle.wait(30)
        assert prod.ask("holding") == []
        assert poll(lambda: prod.ask("serving"), (0, 0)) == (0, 0)   # serving job stopped, slots freed
        assert poll(lambda: prod.ask("finished")[2], ["r"]) == ["r"]   # aborted
        assert cons._paths.kit.slots_in_use == 0 and cons._paths.kit.router.active() == 0


def test_producer_killed_mid_transfer_fails_the_read_within_its_deadline(producers):
    prod, cons, handle = _stalled_read(producers, timeout=4)
    with cons:
        prod.kill()
        with pytest.raises((PeerLostError, TransferTimeoutError)) as info:
            handle.wait(60)   # generous: the transfer's own 4 s deadline must end it first
        assert "deadline passed" in str(info.value) or isinstance(info.value, PeerLostError)
        assert poll(lambda: cons._paths.kit.slots_in_use, 0) == 0
        assert cons.finished().failed.keys() == {"r"}


@pytest.mark.parametrize("change,match", [
    (dict(block_ids=[1, 2, 999]), r"producer block id 999 is outside \[0, 48\)"),
    (dict(consumer_ids=[0, 1, 4800]), r"consumer block id 4800 is outside \[0, 48\)"),
    (dict(head_start=0, head_stop=2), r"heads \[0, 2\): expected \[0, 4\)"),
    (dict(piece_bytes=1 << 30), r"piece_bytes 1073741824 outside \[8192, 16384\]"),
])
def test_hostile_pack_request_is_refused_and_changes_nothing(producers, change, match):
    spec = KVSpec(**COMMON)
    p_ids = [1, 2, 3]
    prod = StagedProducer(spec, seed=1, port=free_port_block(), holds={"r": p_ids})
    producers.append(prod)
    cons, cache = consumer(spec, **STAGED)
    with cons:
        link = cons.connect(*prod.address)
        fields = dict(request_id="r", block_ids=p_ids, head_start=0, head_stop=4, consumer_ids=[0, 1, 2],
                      tag=77, piece_bytes=16 << 10, timeout=10.0)
        fields.update(change)
        with pytest.raises(ProtocolError, match=match):
            link.ask(PackRequest(**fields), 10)
        assert prod.ask("serving") == (0, 0)
        assert prod.ask("holding") == ["r"]
        assert prod.ask("finished") == ([], [], [])
        # the producer is intact: the real read still works
        cons.read(prod.address, [0, 1, 2], p_ids, "r").wait(60)
        _check(spec, cache, cache_for(spec, 99), [0, 1, 2], [(spec, cache_for(spec, 1))], p_ids)


def test_pack_request_for_an_unclaimed_request_is_refused(producers):
    spec = KVSpec(**COMMON)
    prod = StagedProducer(spec, seed=1, port=free_port_block(), holds={"r": [1, 2]})
    producers.append(prod)
    cons, _ = consumer(spec, **STAGED)
    with cons:
        link = cons.connect(*prod.address)
        reply = link.ask(PackRequest("r", [1, 2], 0, 4, [0, 1], 5, 16 << 10, 10.0), 10)
        assert type(reply).__name__ == "Refuse" and "not claimed" in reply.reason
        assert prod.ask("serving") == (0, 0) and prod.ask("holding") == ["r"]


def test_pack_request_travels_with_the_claim_in_one_round_trip(producers, monkeypatch):
    """The consumer sends the PackRequest right behind the claim, before the claim's answer is
    taken: one round trip, not two (the producer still checks the claim first)."""
    from kvxfer.agent import peers

    events = []
    send, try_send, answer = peers.PeerLink.send, peers.PeerLink.try_send, peers.PendingAnswer.answer

    def recording_send(self, message, timeout):
        events.append(("send", type(message).__name__))
        return send(self, message, timeout)

    def recording_try_send(self, message, timeout):  # the claim sent from read()'s own thread
        pending = try_send(self, message, timeout)
        if pending is not None:
            events.append(("send", type(message).__name__))
        return pending

    def recording_answer(self):
        events.append(("answer", type(self._message).__name__))
        return answer(self)

    monkeypatch.setattr(peers.PeerLink, "send", recording_send)
    monkeypatch.setattr(peers.PeerLink, "try_send", recording_try_send)
    monkeypatch.setattr(peers.PendingAnswer, "answer", recording_answer)
    spec = KVSpec(**COMMON)
    p_ids, c_ids = [7, 3, 22], [1, 9, 4]
    prod = StagedProducer(spec, seed=4, port=free_port_block(), holds={"r": p_ids})
    producers.append(prod)
    cons, cache = consumer(spec, **STAGED)
    with cons:
        cons.connect(*prod.address)
        events.clear()
        assert cons.read(prod.address, c_ids, p_ids, "r").wait(60).mode == "staged"
        _check(spec, cache, cache_for(spec, 99), c_ids, [(spec, cache_for(spec, 4))], p_ids)
    ours = [e for e in events if e[1] in ("Claim", "PackRequest")]
    assert ours == [("send", "Claim"), ("send", "PackRequest"), ("answer", "Claim"), ("answer", "PackRequest")], ours


def test_a_refused_claim_leaves_no_pack_behind(producers):
    spec = KVSpec(**COMMON)
    prod = StagedProducer(spec, seed=1, port=free_port_block(), holds={"r": [1, 2]})
    producers.append(prod)
    cons, _ = consumer(spec, **STAGED)
    with cons:
        with pytest.raises(LeaseExpiredError):
            cons.read(prod.address, [0, 1], [1, 2], "not-held").wait(30)
        assert prod.ask("serving") == (0, 0) and prod.ask("holding") == ["r"]
        assert cons._paths.kit.slots_in_use == 0 and cons._paths.kit.router.active() == 0


def test_forcing_staged_against_a_producer_without_staging_names_why(producers):
    from kvxfer import ConfigError
    from nixl_peers import Producer

    spec = KVSpec(**COMMON)
    # a host-memory producer offers staging under "auto" and "staged"; "direct" offers none
    prod = Producer(spec, seed=1, port=free_port_block(), holds={"r": [1]}, transfer_path="direct")
    producers.append(prod)
    cons, _ = consumer(spec, **STAGED)
    with cons:
        with pytest.raises(ConfigError, match="transfer_path='staged' cannot move this request: .*no staging"):
            cons.read(prod.address, [0], [1], "r").wait()
        assert prod.ask("holding") == ["r"]   # nothing was claimed


def test_transfer_path_config_is_validated(monkeypatch):
    from kvxfer import ConfigError
    with pytest.raises(ConfigError, match="transfer_path must be one of auto, ipc, staged, direct; got 'fast'"):
        AgentConfig(transfer_path="fast")
    monkeypatch.setenv("KVXFER_TRANSFER_PATH", "bogus")
    with pytest.raises(ConfigError, match="KVXFER_TRANSFER_PATH must be one of"):
        AgentConfig.from_env()
    monkeypatch.setenv("KVXFER_TRANSFER_PATH", "Staged")
    assert AgentConfig.from_env().transfer_path == "staged"
