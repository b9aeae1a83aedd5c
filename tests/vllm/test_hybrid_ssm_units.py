"""KvxferConnector's SSM (Mamba) state groups without servers: vLLM's MambaSpec read, the prefill's
one-token back-off, the state block's lists, and one read of state pages and attention blocks
over the byte-copying FakeBackend (vLLM's shared tensors: a Mamba layer's pages are an
attention layer's memory too)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvxfer import LayoutError
from kvxfer_vllm.groups import GroupInfo, StateInfo, groups_of, has_state, hybrid_load, kept
from kvxfer_vllm.metadata import LoadOrder, StepOrders, WorkerAddress
from kvxfer_vllm.scheduler import KvxferScheduler
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.state import describe_state

BS = 32
SHAPES = ((3, 160), (8, 16, 16))          # the tiny GraniteMoeHybrid's conv and SSM state
CONTENT = (3 * 160 + 8 * 16 * 16) * 4     # 10,112 bytes of state in a page
PAGE = 16384                              # an attention block's page: 32 tokens x 2 heads x 32 x 2 x 4 bytes
INFO = StateInfo(SHAPES, (torch.float32, torch.float32), PAGE)
GROUPS = (GroupInfo(0, "state", 0, BS, ("m0", "m2"), INFO), GroupInfo(1, "full", 0, BS, ("a1", "a3")))


def _mamba(**kw):
    return MambaSpec(block_size=BS, shapes=SHAPES, dtypes=(torch.float32, torch.float32), page_size_padded=PAGE,
                     mamba_cache_mode="align", **kw)


def test_groups_of_reads_a_mamba_group_as_state():
    cfg = SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec(["m0", "m2"], _mamba(num_speculative_blocks=1)),
        KVCacheGroupSpec(["a1", "a3"], FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                                                         dtype=torch.float32))])
    g = groups_of(cfg, BS)
    assert [(x.index, x.kind, x.layer_names) for x in g] == [(0, "state", ("m0", "m2")), (1, "full", ("a1", "a3"))]
    assert g[0].state.shapes == SHAPES and g[0].state.page_bytes == PAGE and g[0].state.speculative_blocks == 1
    assert has_state(g) and not has_state(g[1:]) and not has_state(None)


def test_kept_cuts_a_state_group_to_the_running_states_block():
    # align mode: null (0) blocks before the running state's
    assert kept(GROUPS, ([0, 0, 7], [1, 2, 3])) == ((7,), (1, 2, 3))
    spec = (replace(GROUPS[0], state=replace(INFO, speculative_blocks=2)), GROUPS[1])
    assert kept(spec, ([0, 7, 8, 9], [1])) == ((7,), (1,))      # the scratch blocks after it dropped
    assert kept(spec, ([7], [1])) == ((7,), (1,))                # at least one stays
    assert kept(GROUPS, ([], [1])) == ((), (1,))


def test_hybrid_load_moves_the_state_block_beside_the_attention_blocks():
    # 99 tokens of a 100-token prompt loaded: the decode's running-state block against the producer's
    load = hybrid_load(GROUPS, computed=0, count=99, fresh=([40, 41, 42, 43], [20, 21, 22, 23]),
                       remote=((7,), (1, 2, 3, 4)), remote_tokens=99, block_size=BS)
    assert load.local == ((43,), (20, 21, 22, 23)) and load.remote == ((7,), (1, 2, 3, 4))
    assert load.num_tokens == 99
    # a producer answering two state blocks passes as it is: kvxfer refuses the whole read (below)
    load = hybrid_load(GROUPS, computed=0, count=99, fresh=([43], [20, 21, 22, 23]),
                       remote=((7, 8), (1, 2, 3, 4)), remote_tokens=99, block_size=BS)
    assert load.remote[0] == (7, 8)


def _settings(role="kv_both"):
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role=role, kv_load_failure_policy="fail", kv_connector_extra_config={}, enable_permute_local_kv=False,
        kv_buffer_device="cpu"), parallel_config=SimpleNamespace(data_parallel_rank=0))
    return Settings.from_vllm(cfg, environ={})


def _request(rid, params, n):
    prompt = list(range(100, 100 + n))
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=prompt,
                           _all_token_ids=list(prompt), num_prompt_tokens=n, max_tokens=16, prompt_embeds=None,
                           num_computed_tokens=0, get_skip_reading_prefix_cache=lambda: False)


def test_prefill_backs_off_one_token_once():
    sched = KvxferScheduler(_settings(), engine_id="p", tp_size=1, block_size=BS, groups=GROUPS)
    req = _request("r", {"do_remote_decode": True}, 100)
    sched.on_new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids)) == (99, 99, 99)
    assert req.prompt_token_ids[-1] == 198 and req.max_tokens == 1
    sched.on_new_request(req)          # seen again (preempted): not cut twice
    assert req.num_prompt_tokens == 99
    one = _request("one", {"do_remote_decode": True}, 1)
    sched.on_new_request(one)          # nothing to back off from
    assert one.num_prompt_tokens == 1
    plain = KvxferScheduler(_settings(), engine_id="p", tp_size=1, block_size=BS, groups=GROUPS[1:] * 2)
    other = _request("s", {"do_remote_decode": True}, 100)
    plain.on_new_request(other)        # attention only: the whole prompt
    assert other.num_prompt_tokens == 100


def test_prefill_holds_and_answers_the_state_block():
    from vllm.v1.request import RequestStatus

    sched = KvxferScheduler(_settings(), engine_id="p", tp_size=1, block_size=BS, groups=GROUPS)
    sched.set_addresses({0: WorkerAddress("h", 5600, "e")})
    blocks = ([0, 0, 7], [1, 2, 3, 4])
    sched.bind(SimpleNamespace(get_block_ids=lambda rid: blocks))
    req = _request("r", {"do_remote_decode": True}, 100)
    sched.on_new_request(req)
    sched.after_alloc(req, None, 0)
    assert sched.build_orders(SimpleNamespace(num_scheduled_tokens={"r": 99})).holds == {"r": ((7,), (1, 2, 3, 4))}
    req.num_computed_tokens, req.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    keep, answer = sched.finished(req, blocks)
    assert keep and answer["remote_block_ids"] == [[7], [1, 2, 3, 4]] and answer["remote_num_tokens"] == 99


def test_decode_loads_all_but_the_last_token():
    sched = KvxferScheduler(_settings(), engine_id="d", tp_size=1, block_size=BS, groups=GROUPS)
    params = {"do_remote_prefill": True, "remote_block_ids": [[7], [1, 2, 3, 4]], "remote_request_id": "r",
              "remote_host": "h", "remote_port": 5600, "remote_engine_id": "p", "tp_size": 1,
              "remote_num_tokens": 99, "remote_block_size": BS}
    req = _request("d1", params, 100)
    assert sched.matched_tokens(req, 0) == (99, True)
    # the producer's state must be the one before the last prompt token, else the decode computes the prompt:
    # a producer that computed the whole prompt (no back-off), or fewer tokens, or no count at all
    for n in (100, 50, None):
        assert sched.matched_tokens(_request("d2", {**params, "remote_num_tokens": n}, 100), 0) == (0, False)
    assert sched.matched_tokens(_request("d3", {**params, "remote_num_tokens": 1}, 1), 0) == (0, False)
    fresh = ([0, 0, 43], [20, 21, 22, 23])
    blocks = SimpleNamespace(get_block_ids=lambda: fresh, get_unhashed_block_ids_all_groups=lambda: ([43], fresh[1]))
    sched.after_alloc(req, blocks, 99)
    (load,) = sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).loads
    assert (load.local_blocks, load.remote_blocks, load.num_tokens) == (((43,), (20, 21, 22, 23)),
                                                                        ((7,), (1, 2, 3, 4)), 99)


# ---- the worker: vLLM's shared tensors, state pages registered once, one read ---------------------

def _caches(seed, num_blocks=24, content=CONTENT):
    """As vLLM 0.32's CPU worker hands them: layer pair i (Mamba m, attention a) shares one tensor
    of ``num_blocks`` pages; the attention layer sees ``[blocks, heads, tokens, 2 * head]`` float32,
    the Mamba layer one byte view ``[blocks, 1, 1, state bytes]`` of the same pages."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(num_blocks, 2, BS, 64, generator=g) for _ in range(2)]
    caches = {}
    for i, t in enumerate(shared):
        raw = t.view(torch.int8).view(-1)
        caches[f"m{2 * i}"] = torch.as_strided(raw, (num_blocks, 1, 1, content), (PAGE, content, content, 1))
        caches[f"a{2 * i + 1}"] = t
    return caches, shared


def _worker(monkeypatch, world, network, name, port, groups=GROUPS, tp_size=1):
    from kvxfer import Agent
    from kvxfer.testing import FakeBackend, MemoryTransport
    from kvxfer_vllm import worker as worker_module

    def agent(agent_name, spec, config):
        config = replace(config, side_channel_host="127.0.0.1", side_channel_port=port)
        return Agent(name, spec, config, backend=FakeBackend(name, world), transport=MemoryTransport(network))

    monkeypatch.setattr(worker_module, "Agent", agent)
    return worker_module.KvxferWorker(Settings(), tp_rank=0, tp_size=tp_size, model="granite", block_size=BS,
                                      num_kv_heads=2, head_size=32, mla=False, single_group=False, groups=groups)


def test_describe_state_reads_vllms_page_view():
    caches, shared = _caches(1)
    spec, pages = describe_state(GROUPS[0], [caches["m0"], caches["m2"]], num_blocks=24, tp_rank=0, tp_size=1,
                                 model="granite")
    assert spec.slot_stride == PAGE and spec.num_slots == 24 and [t.name for t in spec.tensors] == ["conv[3,160]", "ssm[8,16,16]"]
    assert [t.opaque_elements for t in spec.tensors] == [480, 2048]
    assert pages[1].data_ptr() == shared[1].data_ptr() and pages[1].numel() == 24 * PAGE
    bad = torch.as_strided(shared[0].view(torch.int8).view(-1), (24, 1, 1, CONTENT - 4), (PAGE, 1, 1, 1))
    with pytest.raises(LayoutError, match=r"state layer m0: expected a view \[24, \.\.\., 10112 bytes\]"):
        describe_state(GROUPS[0], [bad, caches["m2"]], num_blocks=24, tp_rank=0, tp_size=1, model="granite")


def test_worker_reads_the_state_page_and_the_attention_blocks_in_one_read(monkeypatch):
    from kvxfer.testing import FakeWorld, MemoryNetwork, wait_for

    world, network = FakeWorld(), MemoryNetwork()
    p_caches, p_shared = _caches(1)
    d_caches, d_shared = _caches(2)
    before = [t.clone() for t in d_shared]
    prod = _worker(monkeypatch, world, network, "p", 7310)
    prod.register(p_caches, 24)
    cons = _worker(monkeypatch, world, network, "d", 7311)
    try:
        cons.register(d_caches, 24)
        # the state pages are the attention layers' memory: registered once (plus the hold words)
        regions = [r for r in prod._agent._backend.registered() if r.length == 24 * PAGE]
        assert sorted(r.addr for r in regions) == sorted(t.data_ptr() for t in p_shared)
        prod.apply(StepOrders(holds={"r": ((7,), (1, 2, 3, 4))}))
        cons.apply(StepOrders(loads=[LoadOrder("d1", "r", "127.0.0.1", 7310, ((13,), (20, 21, 22, 23)),
                                               ((7,), (1, 2, 3, 4)), 1, 99)]))
        assert wait_for(lambda: "d1" in cons.collect().recving or False, 10)
        for p, d, old in zip(p_shared, d_shared, before):
            pb, db, ob = (x.view(torch.int8).view(24, PAGE) for x in (p, d, old))
            assert torch.equal(db[13, :CONTENT], pb[7, :CONTENT])            # the state: conv and SSM
            assert torch.equal(db[13, CONTENT:], ob[13, CONTENT:])           # the page's padding is not moved
            assert torch.equal(d[[20, 21, 22]], p[[1, 2, 3]])                # attention: whole blocks
            assert torch.equal(d[23, :, :3], p[4, :, :3])                    # 99 tokens: 3 of the last block
            untouched = [b for b in range(24) if b not in (13, 20, 21, 22, 23)]
            assert torch.equal(d[untouched], old[untouched])                 # nothing else written
    finally:
        prod.close()
        cons.close()


def _failed_load(monkeypatch, producer_groups, load, tp_size=1, port=7320):
    """A load from a producer described by ``producer_groups``: its error, and whether the decode's
    cache stayed as it was."""
    from kvxfer.testing import FakeWorld, MemoryNetwork, wait_for

    world, network = FakeWorld(), MemoryNetwork()
    info = producer_groups[0].state
    p_caches, _ = _caches(1, content=sum(torch.Size(x).numel() * 4 for x in info.shapes))
    d_caches, d_shared = _caches(2)
    before = [t.clone() for t in d_shared]
    prod = _worker(monkeypatch, world, network, "p", port, groups=producer_groups)
    prod.register(p_caches, 24)
    cons = _worker(monkeypatch, world, network, "d", port + 1, tp_size=tp_size)
    try:
        cons.register(d_caches, 24)
        prod.apply(StepOrders(holds={"r": load.remote_blocks}))
        cons.apply(StepOrders(loads=[replace(load, port=port)]))
        reports = {}
        assert wait_for(lambda: reports.update(failed=cons.collect().failed) or "d1" in reports["failed"], 10)
        error = cons._outcome(cons._loads["d1"]) if "d1" in cons._loads else None
        return error, all(torch.equal(d, o) for d, o in zip(d_shared, before))
    finally:
        prod.close()
        cons.close()


LOAD = LoadOrder("d1", "r", "127.0.0.1", 0, ((13,), (20, 21, 22, 23)), ((7,), (1, 2, 3, 4)), 1, 99)


def test_a_producer_with_another_state_shape_fails_the_load_typed_and_writes_nothing(monkeypatch, caplog):
    other = (replace(GROUPS[0], state=replace(INFO, shapes=((3, 160), (8, 16, 8)))), GROUPS[1])
    _, untouched = _failed_load(monkeypatch, other, LOAD)
    assert untouched
    # the shapes are in the tensors' names: the error names both
    assert any("state tensors differ" in r.getMessage() and "'ssm[8,16,16]'" in r.getMessage()
               and "'ssm[8,16,8]'" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_two_state_blocks_fail_the_load_typed_and_write_nothing(monkeypatch, caplog):
    load = replace(LOAD, remote_blocks=((7, 8), (1, 2, 3, 4)))
    _, untouched = _failed_load(monkeypatch, GROUPS, load, port=7330)
    assert untouched
    assert any("state slot lists must be as long" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_another_tp_size_is_refused_naming_both(monkeypatch, caplog):
    load = replace(LOAD, remote_tp_size=2)
    _, untouched = _failed_load(monkeypatch, GROUPS, load, port=7340)
    assert untouched
    assert any("equal TP sizes only: the producer has TP 2, this decode TP 1" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
