"""The Agent over real NIXL (UCX) between real processes, with the real ZMQ side channel."""

import time

import numpy as np
import pytest

from kvxfer import Agent, AgentConfig, KVSpec, LeaseExpiredError, PeerLostError

from nixl_peers import Producer, cache_for, free_port_block

COMMON = dict(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=48,
              dtype="bfloat16", model="itest")


def consumer(spec: KVSpec, seed: int = 99, **cfg) -> tuple[Agent, list[np.ndarray]]:
    cfg.setdefault("side_channel_host", "127.0.0.1")
    cfg.setdefault("side_channel_port", free_port_block(1))
    agent = Agent("consumer", spec, AgentConfig(**cfg))
    cache = cache_for(spec, seed)
    agent.register(cache)
    return agent, cache


def poll(fn, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got == want:
            return got
        time.sleep(0.05)
    return got


def test_read_same_layout_fragmented_ids_is_byte_exact_and_releases(producers):
    spec = KVSpec(**COMMON)
    port = free_port_block()
    src_ids = [31, 2, 17, 18, 19, 40, 5]
    prod = Producer(spec, seed=1, port=port, holds={"r1": src_ids, "r2": src_ids})
    producers.append(prod)
    cons, cache = consumer(spec)
    with cons:
        dst_ids = [3, 4, 5, 6, 20, 21, 47]
        stats = cons.read(prod.address, dst_ids, src_ids, "r1").wait(30)
        src = cache_for(spec, 1)
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cache[layer][:, dst_ids], src[layer][:, src_ids])
        # 17,18,19 -> 5,6,20 breaks on the destination; 3,4,5,6 contiguous but source is not
        assert stats.descriptors < len(src_ids) * spec.num_layers * 2
        assert poll(lambda: prod.ask("finished")[0], ["r1"]) == ["r1"]
        assert prod.ask("holding") == ["r2"]
        cons.abort("r2", remote=prod.address)
        assert prod.ask("holding") == []
        with pytest.raises(LeaseExpiredError):
            cons.read(prod.address, dst_ids, src_ids, "r1").wait()  # released: a late read is refused


def test_read_tp2_hnd_to_tp1_nhd_staged_is_byte_exact(producers):
    port = free_port_block()
    ids = [7, 8, 9, 30]
    for rank in range(2):
        spec = KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=rank)
        producers.append(Producer(spec, seed=10 + rank, port=port, holds={"r": ids}))
    spec = KVSpec(**COMMON, layout="NHD")
    cons, cache = consumer(spec)
    with cons:
        stats = cons.read(producers[0].address, [0, 1, 2, 3], ids, "r").wait(30)
        assert stats.mode == "host-staged" and stats.peers == 2
    for rank in range(2):
        src = cache_for(KVSpec(**COMMON, layout="HND", tp_size=2, tp_rank=rank), 10 + rank)
        for layer in range(spec.num_layers):
            want = src[layer][:, ids].transpose(0, 1, 3, 2, 4)   # HND -> NHD
            np.testing.assert_array_equal(cache[layer][:, [0, 1, 2, 3], :, 2 * rank:2 * rank + 2], want)
    for p in producers:
        assert poll(lambda: p.ask("finished")[0], ["r"]) == ["r"]


def test_read_tp1_to_tp2_each_consumer_rank_reads_its_heads(producers):
    port = free_port_block()
    spec = KVSpec(**COMMON)
    prod = Producer(spec, seed=3, port=port, holds={"r": [11, 12]}, )
    producers.append(prod)
    src = cache_for(spec, 3)
    for rank in range(2):
        cspec = KVSpec(**COMMON, tp_size=2, tp_rank=rank)
        cons, cache = consumer(cspec, seed=50 + rank)
        with cons:
            cons.read(prod.address, [1, 2], [11, 12], "r").wait(30)
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cache[layer][:, [1, 2]], src[layer][:, [11, 12], :, 2 * rank:2 * rank + 2])
    # both consumer ranks depended on the producer: released only after the second one
    assert poll(lambda: prod.ask("finished")[0], ["r"]) == ["r"]


def test_write_producer_pushes_into_consumer(producers):
    spec = KVSpec(**COMMON)
    cport = free_port_block(1)
    cons, cache = consumer(spec, side_channel_port=cport)
    with cons:
        cons.listen()
        wspec = KVSpec(**COMMON)
        with Agent("writer", wspec, AgentConfig(side_channel_host="127.0.0.1",
                                                 side_channel_port=free_port_block(1))) as writer:
            wcache = cache_for(wspec, 5)
            writer.register(wcache)
            # Two agents in one process talk over UCX's TCP fallback: slower, still real NIXL.
            writer.write(cons.address, [8, 9], [1, 2], "w1").wait(60)
            for layer in range(spec.num_layers):
                np.testing.assert_array_equal(cache[layer][:, [1, 2]], wcache[layer][:, [8, 9]])
            assert poll(lambda: "w1" in cons.finished().received, True) is True


def test_dead_producer_is_peer_lost_within_deadline(producers):
    spec = KVSpec(**COMMON)
    prod = Producer(spec, seed=1, port=free_port_block(), holds={"r": [1]})
    address = prod.address
    prod.stop()
    cons, _ = consumer(spec, handshake_timeout=0.5)
    with cons:
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            cons.read(address, [0], [1], "r").wait()
        assert time.monotonic() - t0 < 10


def test_unknown_backend_lists_what_nixl_offers():
    from kvxfer import ConfigError
    with pytest.raises(ConfigError, match="UCX"):
        Agent("x", KVSpec(**COMMON), AgentConfig(backends=("NO_SUCH_PLUGIN",)))


@pytest.mark.parametrize("thread", [False, True], ids=["threads-off", "threads-on"])
def test_read_with_nixl_progress_threads_off_or_on_on_both_sides(producers, thread):
    # Hosts with few cores run without NIXL's busy-polling progress thread (the default decides
    # by the cores, so this CI host runs without it): the agents' own loops then drive UCX. Both
    # settings, forced: a read completes byte for byte and releases the producer's hold.
    spec = KVSpec(**COMMON)
    src_ids, dst_ids = [9, 1, 30, 31, 12], [0, 40, 41, 7, 8]
    prod = Producer(spec, seed=4, port=free_port_block(), holds={"q": src_ids}, nixl_progress_thread=thread)
    producers.append(prod)
    cons, cache = consumer(spec, nixl_progress_thread=thread)
    assert cons._backend.progress_thread is thread
    with cons:
        cons.read(prod.address, dst_ids, src_ids, "q").wait(120)  # a bound, not a speed check
        src = cache_for(spec, 4)
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cache[layer][:, dst_ids], src[layer][:, src_ids])
        assert poll(lambda: prod.ask("holding"), [], timeout=60) == []


def test_claims_go_to_every_rank_and_one_refusal_undoes_the_others(producers):
    # Claims to several producer ranks are asked concurrently: when one rank does not hold the
    # request, the read fails with its reason, the rank that granted is told to release, and
    # nothing outside the read's own destination blocks was written (its move may start while
    # the claims travel); nothing lands in them after the handle ended.
    port = free_port_block()
    ids = [3, 4, 5]
    for rank, holds in ((0, {"r": ids}), (1, {})):
        spec = KVSpec(**COMMON, tp_size=2, tp_rank=rank)
        producers.append(Producer(spec, seed=20 + rank, port=port, holds=holds))
    spec = KVSpec(**COMMON)
    cons, cache = consumer(spec)
    with cons:
        with pytest.raises(LeaseExpiredError, match=r"refused 'r': request 'r' is not held"):
            cons.read(producers[0].address, [0, 1, 2], ids, "r").wait()
        ended = [c[:, :3].copy() for c in cache]
        assert poll(lambda: producers[0].ask("holding"), []) == []
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cache[layer][:, :3], ended[layer])
    untouched = cache_for(spec, 99)
    for layer in range(spec.num_layers):
        np.testing.assert_array_equal(cache[layer][:, 3:], untouched[layer][:, 3:])


def test_a_known_producers_claim_leaves_from_the_callers_thread_or_else_from_the_lane(producers, monkeypatch):
    """For a producer already handshaken, ``read_many`` sends the step's claim itself when the
    express lane takes it at once (no wait for the lane thread to wake); when the lane is busy
    (another thread sending on it) nothing is sent inline and the lane thread claims. Both ways
    the reads are exact and the claim is sent once."""
    import threading

    from kvxfer import ReadRequest
    from kvxfer.agent import peers
    from kvxfer.protocol import Claim, ClaimBatch

    spec = KVSpec(**COMMON)
    holds = {f"a{i}": [2 * i, 2 * i + 1] for i in range(4)} | {f"b{i}": [20 + 2 * i, 21 + 2 * i] for i in range(4)}
    prod = Producer(spec, seed=1, port=free_port_block(), holds=holds)
    producers.append(prod)
    sent: list[tuple[str, str]] = []
    send, try_send = peers.PeerLink.send, peers.PeerLink.try_send

    def recording_send(self, message, timeout):
        if isinstance(message, (Claim, ClaimBatch)):
            sent.append((threading.current_thread().name, "send"))
        return send(self, message, timeout)

    def recording_try_send(self, message, timeout):
        pending = try_send(self, message, timeout)
        if pending is not None and isinstance(message, (Claim, ClaimBatch)):
            sent.append((threading.current_thread().name, "try_send"))
        return pending

    monkeypatch.setattr(peers.PeerLink, "send", recording_send)
    monkeypatch.setattr(peers.PeerLink, "try_send", recording_try_send)
    cons, cache = consumer(spec)
    src = cache_for(spec, 1)
    with cons:
        link = cons.connect(*prod.address)
        assert link.client._lane is not None  # the express lane is up: a claim can go inline

        def step(prefix, dst0):
            reqs = [ReadRequest(prod.address, [dst0 + 2 * i, dst0 + 2 * i + 1], holds[f"{prefix}{i}"], f"{prefix}{i}")
                    for i in range(4)]
            for handle in cons.read_many(reqs):
                handle.wait(30)
            for rr in reqs:
                for layer in range(spec.num_layers):
                    np.testing.assert_array_equal(cache[layer][:, rr.local_blocks], src[layer][:, rr.remote_blocks])

        step("a", 0)
        assert sent == [("MainThread", "try_send")]
        sent.clear()
        lane = link.client._lane
        with lane._send_lock:  # another thread is sending on the lane: the caller must not wait for it
            started = time.perf_counter()
            handles = cons.read_many([ReadRequest(prod.address, [30 + 2 * i, 31 + 2 * i], holds[f"b{i}"], f"b{i}")
                                      for i in range(4)])
            assert time.perf_counter() - started < 0.5
            assert sent == [] and not any(h.done() for h in handles)
        for handle in handles:
            handle.wait(30)
        assert len(sent) == 1 and sent[0][0].startswith("kvxfer-peer") and sent[0][1] == "send"
        for i in range(4):
            for layer in range(spec.num_layers):
                np.testing.assert_array_equal(cache[layer][:, [30 + 2 * i, 31 + 2 * i]], src[layer][:, holds[f"b{i}"]])
