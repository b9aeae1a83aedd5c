"""KvxferConnector's hybrid pieces without servers: vLLM's groups read, windows cut, the scheduler's per-group orders."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kvxfer import ConfigError
from kvxfer_vllm.connector import KvxferConnector
from kvxfer_vllm.groups import GroupInfo, groups_of, hybrid_load, kept
from kvxfer_vllm.scheduler import KvxferScheduler
from kvxfer_vllm.settings import Settings

BS = 32


def _attn(cls, **kw):
    return cls(block_size=kw.pop("block_size", BS), num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


def gemma_like(block_size=BS):
    """vLLM's groups for Gemma 3 with 2 sliding and 2 full layers: sliding first, as vLLM orders them."""
    return SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec(["l0", "l2"], _attn(SlidingWindowSpec, sliding_window=32, block_size=block_size)),
        KVCacheGroupSpec(["l1", "l3"], _attn(FullAttentionSpec)),
    ])


def test_kvxfer_connector_declares_hma_support():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    assert supports_hma(KvxferConnector)


def test_groups_of_reads_vllms_groups():
    assert groups_of(SimpleNamespace(kv_cache_groups=[gemma_like().kv_cache_groups[1]]), BS) is None  # one group
    g = groups_of(gemma_like(), BS)
    assert [(x.index, x.kind, x.sliding_window, x.layer_names) for x in g] == [
        (0, "sliding", 32, ("l0", "l2")), (1, "full", 0, ("l1", "l3"))]
    assert g[0].kept_blocks() == 2 and g[1].kept_blocks() == 0


def test_groups_of_refuses_what_it_cannot_move_naming_the_group():
    state = SimpleNamespace(kv_cache_groups=[gemma_like().kv_cache_groups[1],
                                             KVCacheGroupSpec(["m0"], SimpleNamespace(block_size=BS))])
    with pytest.raises(ConfigError, match="group 1 is SimpleNamespace"):
        groups_of(state, BS)
    with pytest.raises(ConfigError, match="group 0 .*sliding.* 64 tokens.*block size 32"):
        groups_of(gemma_like(block_size=64), BS)
    only_sliding = SimpleNamespace(kv_cache_groups=[gemma_like().kv_cache_groups[0]] * 2)
    with pytest.raises(ConfigError, match="full-attention"):
        groups_of(only_sliding, BS)


GROUPS = (GroupInfo(0, "sliding", 32, BS, ("l0",)), GroupInfo(1, "full", 0, BS, ("l1",)))


def test_kept_cuts_sliding_groups_to_their_window():
    # vLLM has already marked the blocks before the window null (0) at the end of a request
    assert kept(GROUPS, ([0, 0, 0, 13, 14], [1, 2, 3, 4, 5])) == ((13, 14), (1, 2, 3, 4, 5))
    assert kept(GROUPS, ([9], [1])) == ((9,), (1,))


def test_hybrid_load_lines_the_sliding_lists_up_on_the_last_token():
    # 130-token prompt, all of it loaded: the producer's kept tail ends at block 4 (token 129)
    load = hybrid_load(GROUPS, computed=0, count=130, fresh=([0, 0, 0, 23, 24], [31, 32, 33, 34, 35]),
                       remote=((13, 14), (1, 2, 3, 4, 5)), remote_tokens=130, block_size=BS)
    assert load == type(load)(((0, 0, 0, 23, 24), (31, 32, 33, 34, 35)), ((13, 14), (1, 2, 3, 4, 5)), 130)
    # 129 tokens loaded of 129 (block-aligned prompt end one short): the producer's extra last block drops
    load = hybrid_load(GROUPS, computed=0, count=128, fresh=([20, 21, 22, 23], [30, 31, 32, 33]),
                       remote=((13, 14), (1, 2, 3, 4, 5)), remote_tokens=129, block_size=BS)
    assert load.local == ((20, 21, 22, 23), (30, 31, 32, 33)) and load.remote == ((13,), (1, 2, 3, 4))
    assert load.num_tokens == 128


def _settings(role="kv_both"):
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role=role, kv_load_failure_policy="fail", kv_connector_extra_config={}, enable_permute_local_kv=False,
        kv_buffer_device="cpu"), parallel_config=SimpleNamespace(data_parallel_rank=0))
    return Settings.from_vllm(cfg, environ={})


def test_scheduler_holds_and_answers_one_list_per_group():
    from vllm.v1.request import RequestStatus

    sched = KvxferScheduler(_settings(), engine_id="p", tp_size=1, block_size=BS, groups=GROUPS)
    sched.set_addresses({0: __import__("kvxfer_vllm.metadata", fromlist=["x"]).WorkerAddress("h", 5600, "e")})
    blocks = ([10, 11, 12, 13, 14], [1, 2, 3, 4, 5])
    sched.bind(SimpleNamespace(get_block_ids=lambda rid: blocks))
    req = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=130,
                          num_computed_tokens=0, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    sched.after_alloc(req, None, 0)
    orders = sched.build_orders(SimpleNamespace(num_scheduled_tokens={"r": 130}))
    assert orders.holds == {"r": ((13, 14), (1, 2, 3, 4, 5))}   # the window's blocks only
    req.num_computed_tokens = 130
    keep, answer = sched.finished(req, ([0, 0, 0, 13, 14], [1, 2, 3, 4, 5]))
    assert keep and answer["remote_block_ids"] == [[13, 14], [1, 2, 3, 4, 5]]
    assert answer["remote_num_tokens"] == 130
    assert sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).kept == {"r"}


def test_scheduler_loads_with_one_list_per_group():
    sched = KvxferScheduler(_settings(), engine_id="d", tp_size=1, block_size=BS, groups=GROUPS)
    params = {"do_remote_prefill": True, "remote_block_ids": [[13, 14], [1, 2, 3, 4, 5]], "remote_request_id": "r",
              "remote_host": "h", "remote_port": 5600, "remote_engine_id": "p", "tp_size": 1,
              "remote_num_tokens": 130, "remote_block_size": BS}
    req = SimpleNamespace(request_id="d1", kv_transfer_params=params, num_prompt_tokens=130)
    assert sched.matched_tokens(req, 0) == (130, True)
    fresh = ([0, 0, 0, 23, 24], [31, 32, 33, 34, 35])
    blocks = SimpleNamespace(get_block_ids=lambda: fresh, get_unhashed_block_ids_all_groups=lambda: fresh)
    sched.after_alloc(req, blocks, 130)
    (load,) = sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).loads
    assert (load.local_blocks, load.remote_blocks, load.num_tokens) == (tuple(map(tuple, fresh)), ((13, 14), (1, 2, 3, 4, 5)), 130)
    # one list for a two-group cache is refused (nothing loaded, computed here)
    bad = SimpleNamespace(request_id="d2", kv_transfer_params={**params, "remote_block_ids": [[1, 2]]},
                          num_prompt_tokens=130)
    assert sched.matched_tokens(bad, 0) == (0, False)
    # other block sizes: computed here (a sliding window moves between equal blocks only)
    other = SimpleNamespace(request_id="d3", kv_transfer_params={**params, "remote_block_size": 16},
                            num_prompt_tokens=130)
    assert sched.matched_tokens(other, 0) == (0, False)


# ---- the worker: a HybridSpec from vLLM's shared tensors, one read for every group ----------------

def _hybrid_worker(monkeypatch, world, network, name, port):
    """A worker whose Agent runs over the byte-copying FakeBackend and the in-memory side channel."""
    from kvxfer import Agent
    from kvxfer.testing import FakeBackend, MemoryTransport
    from kvxfer_vllm import worker as worker_module

    def agent(agent_name, spec, config):
        config = replace(config, side_channel_host="127.0.0.1", side_channel_port=port)
        return Agent(name, spec, config, backend=FakeBackend(name, world), transport=MemoryTransport(network))

    monkeypatch.setattr(worker_module, "Agent", agent)
    return worker_module.KvxferWorker(Settings(), tp_rank=0, tp_size=1, model="gemma", block_size=BS,
                                      num_kv_heads=2, head_size=64, mla=False, single_group=False,
                                      groups=(GroupInfo(0, "sliding", 32, BS, ("l0", "l2")),
                                              GroupInfo(1, "full", 0, BS, ("l1", "l3"))))


def _vllm_cpu_caches(seed, num_blocks=40):
    """vLLM's CPU tensors as the hybrid manager hands them: layer i of each group in one tensor."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(num_blocks, 2, BS, 128, generator=g) for _ in range(2)]
    return {"l0": shared[0], "l1": shared[0], "l2": shared[1], "l3": shared[1]}, shared


def test_worker_reads_every_group_and_only_the_sliding_window(monkeypatch):
    from kvxfer.testing import FakeWorld, MemoryNetwork, wait_for
    from kvxfer_vllm.metadata import LoadOrder, StepOrders

    world, network = FakeWorld(), MemoryNetwork()
    p_caches, p_shared = _vllm_cpu_caches(1)
    d_caches, d_shared = _vllm_cpu_caches(2)
    before = [t.clone() for t in d_shared]
    prod = _hybrid_worker(monkeypatch, world, network, "p", 7300)
    prod.register(p_caches, 40)   # each worker's Agent is built here, with the patch of its own name
    cons = _hybrid_worker(monkeypatch, world, network, "d", 7301)
    try:
        cons.register(d_caches, 40)
        prod.apply(StepOrders(holds={"r": ((13, 14), (1, 2, 3, 4, 5))}))
        # 130 tokens: the window of 32 ends at token 129, in the sliding list's last 2 blocks
        cons.apply(StepOrders(loads=[LoadOrder("d1", "r", "127.0.0.1", 7300, ((20, 21, 22, 23, 24),
                                                                             (31, 32, 33, 34, 35)),
                                               ((13, 14), (1, 2, 3, 4, 5)), 1, 130)]))
        assert wait_for(lambda: "d1" in cons.collect().recving or False, 10)
        for p, d, old in zip(p_shared, d_shared, before):
            assert torch.equal(d[[31, 32, 33, 34, 35]], p[[1, 2, 3, 4, 5]])     # full group: every block
            assert torch.equal(d[[23, 24]], p[[13, 14]])                        # sliding group: its window
            untouched = [b for b in range(40) if b not in (31, 32, 33, 34, 35, 23, 24)]
            assert torch.equal(d[untouched], old[untouched])                    # nothing else written
    finally:
        prod.close()
        cons.close()
