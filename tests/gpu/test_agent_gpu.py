"""``Agent.read`` over each GPU path (ipc, staged, direct) between two processes on real GPUs (marked gpu).

The producer runs in a spawned process on GPU 0 (the one-GPU host) or GPU 1 (when two are
visible); the consumer is this process on GPU 0. Every read is compared with a numpy oracle
of the logical KV, and the producer's hold must end after the read.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from .agent_peers import GpuProducer, HostProducer, device_cache, expect_read, free_port_block, host_cache, logical

pytestmark = pytest.mark.gpu

COMMON = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=96, dtype="bfloat16",
              model="gpu-itest")
P_IDS = [71, 3, 40, 41, 42, 9, 88, 17, 60, 5, 33, 34]   # fragmented on both sides
C_IDS = [2, 90, 91, 15, 16, 50, 7, 8, 80, 44, 45, 1]
SMALL = dict(pipeline_slot_bytes=1 << 20, pipeline_slots=4)


def _poll(fn, want, timeout=20.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = fn()
    return got


@pytest.fixture(params=[0, 1], ids=["producer-gpu0", "producer-gpu1"])
def producer_gpu(request, cuda):
    if request.param >= cuda:
        pytest.skip(f"GPU test skipped: producer on GPU {request.param} needs {request.param + 1} GPUs; "
                    f"{cuda} visible")
    return request.param


@pytest.fixture
def producers():
    started: list = []
    yield started
    for p in started:
        p.stop()


def _consumer(spec, path: str):
    import torch

    from kvxfer import Agent, AgentConfig

    torch.cuda.set_device(0)
    agent = Agent("gpu-consumer", spec, AgentConfig(side_channel_host="127.0.0.1",
                                                    side_channel_port=free_port_block(1),
                                                    transfer_path=path, **SMALL))
    cache = device_cache(spec, 99, 0)
    torch.cuda.synchronize()
    agent.register(cache)
    return agent, cache


def _host(cache) -> list[np.ndarray]:
    return [t.cpu().numpy() for t in cache]


CASES = {
    "same-fragmented": (dict(), [dict()]),
    "tp1-2": (dict(tp_size=2, tp_rank=1), [dict()]),
    "hnd-nhd": (dict(layout="NHD"), [dict(layout="HND")]),
}


@pytest.mark.parametrize("path", ["ipc", "staged", "direct"])
@pytest.mark.parametrize("case", list(CASES))
def test_agent_read_gpu_paths_are_byte_exact_and_release_the_hold(producers, producer_gpu, path, case):
    from kvxfer import ConfigError, KVSpec

    c_over, p_overs = CASES[case]
    cspec = KVSpec(**COMMON, **c_over)
    pspecs = [KVSpec(**COMMON, **o) for o in p_overs]
    port = free_port_block()
    for rank, pspec in enumerate(pspecs):
        producers.append(GpuProducer(pspec, 10 + rank, port, producer_gpu, {"r": P_IDS}, transfer_path="auto",
                                     **SMALL))
    cons, cache = _consumer(cspec, path)
    with cons:
        if path == "direct" and case in ("hnd-nhd", "tp1-2"):
            # a layout change, or half of each NHD token's heads, is not byte ranges between two GPU caches
            with pytest.raises(ConfigError, match="transfer_path='direct' cannot move this request"):
                cons.read(producers[0].address, C_IDS, P_IDS, "r").wait()
            return
        stats = cons.read(producers[0].address, C_IDS, P_IDS, "r").wait(120)
        assert stats.mode == path
        got = _host(cache)
    sources = [(pspec, host_cache(pspec, 10 + r)) for r, pspec in enumerate(pspecs)]
    np.testing.assert_array_equal(logical(cspec, got, C_IDS), expect_read(cspec, host_cache(cspec, 99), C_IDS,
                                                                         sources, P_IDS))
    others = [b for b in range(cspec.num_blocks) if b not in set(C_IDS)]
    np.testing.assert_array_equal(logical(cspec, got, others), logical(cspec, host_cache(cspec, 99), others))
    # TP 1->2: the producer's one rank serves both consumer ranks and this test runs one of
    # them, so the hold must stay for the other; every other case is done after this read.
    still_held = ["r"] if case == "tp1-2" else []
    for p in producers:
        assert _poll(lambda: p.ask("holding"), still_held) == still_held


def test_auto_picks_ipc_on_one_host(producers, producer_gpu):
    from kvxfer import KVSpec

    spec = KVSpec(**COMMON)
    producers.append(GpuProducer(spec, 10, free_port_block(), producer_gpu, {"r": P_IDS}, **SMALL))
    cons, cache = _consumer(spec, "auto")
    with cons:
        assert cons.read(producers[0].address, C_IDS, P_IDS, "r").wait(120).mode == "ipc"
        got = _host(cache)
    np.testing.assert_array_equal(logical(spec, got, C_IDS), logical(spec, host_cache(spec, 10), P_IDS))


@pytest.mark.parametrize("path,layout,want", [("auto", "NHD", "direct"), ("staged", "NHD", "staged"),
                                               ("direct", "NHD", "direct"), ("auto", "HND", "staged")])
def test_a_gpu_consumer_reads_a_host_memory_producer_exactly(producers, path, layout, want):
    """A producer whose cache is host memory (a CPU offload tier) offers host staging under its
    default ``auto``. A GPU consumer's ``auto`` reads it directly (host -> GPU descriptors), and
    through the staging (host slots -> GPU slots -> GPU unpack) when forced or when only staging
    can express the move (the producer's layout is HND, the consumer's NHD)."""
    from kvxfer import KVSpec

    pspec, cspec = KVSpec(**COMMON, layout=layout), KVSpec(**COMMON)
    producers.append(HostProducer(pspec, 10, free_port_block(), {"r": P_IDS}, **SMALL))
    cons, cache = _consumer(cspec, path)
    with cons:
        stats = cons.read(producers[0].address, C_IDS, P_IDS, "r").wait(120)
        got = _host(cache)
    assert stats.mode == want
    want_bytes = expect_read(cspec, host_cache(cspec, 99), C_IDS, [(pspec, host_cache(pspec, 10))], P_IDS)
    np.testing.assert_array_equal(logical(cspec, got, C_IDS), want_bytes)
    others = [b for b in range(cspec.num_blocks) if b not in set(C_IDS)]
    np.testing.assert_array_equal(logical(cspec, got, others), logical(cspec, host_cache(cspec, 99), others))
    assert _poll(lambda: producers[0].ask("holding"), []) == []


def test_ipc_read_of_a_request_not_held_is_refused_and_the_next_read_works(producers, producer_gpu):
    # The IPC kernel starts before the claim's answer: a refused claim must fail the read at
    # once, leave the producer's holds and every block outside the destination untouched,
    # and leave the agent able to read the next request.
    from kvxfer import KVSpec, LeaseExpiredError

    spec = KVSpec(**COMMON)
    producers.append(GpuProducer(spec, 10, free_port_block(), producer_gpu, {"r": P_IDS}, **SMALL))
    cons, cache = _consumer(spec, "ipc")
    with cons:
        with pytest.raises(LeaseExpiredError, match="not held"):
            cons.read(producers[0].address, C_IDS, P_IDS, "never-held").wait()
        assert producers[0].ask("holding") == ["r"]
        others = [b for b in range(spec.num_blocks) if b not in set(C_IDS)]
        np.testing.assert_array_equal(logical(spec, _host(cache), others),
                                      logical(spec, host_cache(spec, 99), others))
        assert cons.read(producers[0].address, C_IDS, P_IDS, "r").wait(120).mode == "ipc"
        got = _host(cache)
    np.testing.assert_array_equal(logical(spec, got, C_IDS), logical(spec, host_cache(spec, 10), P_IDS))
    assert _poll(lambda: producers[0].ask("holding"), []) == []


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_read_many_gpu_batch_is_exact_per_request_and_a_refused_claim_fails_alone(producers, producer_gpu, path):
    """One step of six reads from one producer (on the IPC path: one kernel launch for all of
    them): each lands exactly in its own blocks; the one the producer does not hold fails typed
    and no byte lands in its blocks after its handle ended; untouched blocks stay untouched."""
    from kvxfer import KVSpec, LeaseExpiredError, ReadRequest

    spec = KVSpec(**COMMON)
    p_ids = [P_IDS[2 * i:2 * i + 2] for i in range(6)]
    c_ids = [C_IDS[2 * i:2 * i + 2] for i in range(6)]
    holds = {f"b{i}": p_ids[i] for i in range(6) if i != 3}
    producers.append(GpuProducer(spec, 10, free_port_block(), producer_gpu, holds, transfer_path="auto", **SMALL))
    cons, cache = _consumer(spec, path)
    with cons:
        handles = cons.read_many([ReadRequest(producers[0].address, c_ids[i], p_ids[i], f"b{i}", timeout=60)
                                  for i in range(6)])
        for i, handle in enumerate(handles):
            if i == 3:
                with pytest.raises(LeaseExpiredError, match="not held"):
                    handle.wait(90)
            else:
                assert handle.wait(90).mode == path
        ended = logical(spec, _host(cache), c_ids[3])
        time.sleep(0.3)
        got = _host(cache)
    np.testing.assert_array_equal(logical(spec, got, c_ids[3]), ended)
    source = [(spec, host_cache(spec, 10))]
    for i in range(6):
        if i != 3:
            np.testing.assert_array_equal(logical(spec, got, c_ids[i]),
                                          expect_read(spec, host_cache(spec, 99), c_ids[i], source, p_ids[i]))
    others = [b for b in range(spec.num_blocks) if b not in set(C_IDS)]
    np.testing.assert_array_equal(logical(spec, got, others), logical(spec, host_cache(spec, 99), others))
    assert _poll(lambda: producers[0].ask("holding"), []) == []


def test_completed_ipc_reads_leave_nothing_to_the_cycle_collector(producers, cuda):
    """The kernel path's reads, alone and as a step (one launch, its requests grouped), leave no
    kvxfer object that only the cycle collector would free (tests/integration/test_no_cycles_nixl.py
    shows the same over NIXL)."""
    import gc

    from kvxfer import KVSpec, ReadRequest
    from kvxfer.testing import collector_off, cycle_garbage

    spec = KVSpec(**COMMON)
    src = {f"r{i}": P_IDS[2 * i:2 * i + 2] for i in range(6)}
    dst = {f"r{i}": C_IDS[2 * i:2 * i + 2] for i in range(6)}
    producers.append(GpuProducer(spec, 10, free_port_block(), 0, src, **SMALL))
    cons, cache = _consumer(spec, "ipc")
    with cons:
        assert cons.read(producers[0].address, dst["r0"], src["r0"], "r0").wait(120).mode == "ipc"
        collector_off()
        try:
            for step in (["r1"], ["r2", "r3", "r4", "r5"]):
                for handle in cons.read_many([ReadRequest(producers[0].address, dst[r], src[r], r, timeout=60)
                                              for r in step]):
                    handle.wait(120)
            del handle
            cons.finished()  # as an engine drains it each step
            garbage = cycle_garbage()
        finally:
            gc.enable()
        got = _host(cache)
    np.testing.assert_array_equal(logical(spec, got, C_IDS), logical(spec, host_cache(spec, 10), P_IDS))
    assert garbage == {}, f"completed IPC reads left cycles: {garbage}"
