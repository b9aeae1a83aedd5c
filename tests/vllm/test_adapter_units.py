"""The vLLM adapter's pieces without servers: params, settings, cache description, registration by name."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvxfer import Agent, AgentConfig, ConfigError, LayoutError
from kvxfer.testing import FakeBackend, FakeWorld
from kvxfer_vllm.cache import cpu_attention_isa, describe_cache
from kvxfer_vllm.params import BadParams, RemotePrefill, producer_answer
from kvxfer_vllm.settings import Settings
from vllm_harness import free_port

# ---- kv_transfer_params ---------------------------------------------------------------

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5, 9]],
        "remote_engine_id": "e", "remote_request_id": "cmpl-1-0-ab", "remote_host": "10.0.0.1",
        "remote_port": 5600, "tp_size": 2, "remote_num_tokens": 70}


def test_params_from_vllms_proxy_parse():
    r = RemotePrefill.parse(GOOD)
    assert (r.request_id, r.host, r.port, r.block_ids, r.tp_size) == ("cmpl-1-0-ab", "10.0.0.1", 5600, (4, 5, 9), 2)
    assert r.tokens_available(100) == 70 and r.tokens_available(50) == 50
    assert RemotePrefill.parse({**GOOD, "remote_block_ids": [4, 5]}).block_ids == (4, 5)  # flat form


def test_producer_answer_is_what_the_consumer_parses():
    answer = producer_answer(request_id="r", block_ids=(1, 2), engine_id="e", host="h", port=7,
                             tp_size=1, num_tokens=40)
    assert answer["do_remote_prefill"] is True and answer["remote_block_ids"] == [[1, 2]]
    assert RemotePrefill.parse(answer) == RemotePrefill("r", "h", 7, (1, 2), 40, "e", 1)


@pytest.mark.parametrize("bad", [
    {"remote_port": "5600"}, {"remote_port": 0}, {"remote_port": True}, {"remote_host": None},
    {"remote_request_id": 12}, {"remote_block_ids": [[1], [2]]}, {"remote_block_ids": [-1]},
    {"remote_block_ids": ["1"]}, {"remote_block_ids": "1,2"}, {"tp_size": 0}, {"remote_num_tokens": -3},
])
def test_malformed_params_are_refused_with_a_reason(bad):
    with pytest.raises(BadParams):
        RemotePrefill.parse({**GOOD, **bad})


# ---- settings -------------------------------------------------------------------------

def fake_vllm_config(**ktc):
    base = dict(kv_role="kv_both", kv_load_failure_policy="fail", kv_connector_extra_config={},
                enable_permute_local_kv=False, kv_buffer_device="cpu")
    base.update(ktc)
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(**base),
                           parallel_config=SimpleNamespace(data_parallel_rank=1))


def test_settings_read_the_seed_guides_knobs():
    cfg = fake_vllm_config(kv_role="kv_consumer", kv_load_failure_policy="recompute",
                           enable_permute_local_kv="True",
                           kv_connector_extra_config={"backends": ["LIBFABRIC"],
                                                      "enable_cross_layers_blocks": "True"})
    s = Settings.from_vllm(cfg, environ={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "30"})
    assert (s.role, s.failure_policy, s.backends, s.allow_conversion, s.cross_layers, s.lease, s.dp_rank) == \
        ("kv_consumer", "recompute", ("LIBFABRIC",), True, True, 30.0, 1)
    assert s.consumes and not s.produces
    ac = s.agent_config()
    assert (ac.backends, ac.allow_conversion, ac.lease_timeout, ac.dp_rank) == (("LIBFABRIC",), True, 30.0, 1)


@pytest.mark.parametrize("change, env", [
    ({"kv_load_failure_policy": "retry"}, {}),
    ({"enable_permute_local_kv": "maybe"}, {}),
    ({}, {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "soon"}),
    ({}, {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "-1"}),
])
def test_bad_settings_name_the_value(change, env):
    with pytest.raises(ConfigError):
        Settings.from_vllm(fake_vllm_config(**change), environ=env)


# ---- cache description ----------------------------------------------------------------

N, BS, H, D, L = 8, 32, 2, 64, 3


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_backend_cache_is_described_head_major_with_a_transposed_k(isa):
    caches = [torch.zeros(N, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    desc = describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D,
                          tp_rank=0, tp_size=1, model="m", cpu_isa=isa)
    assert (desc.spec.layout.value, desc.spec.storage.value, desc.spec.num_layers) == ("HND", "head_packed", L)
    assert desc.spec.k_dim_chunk == 1
    assert desc.head_slices_exact and not desc.same_format_only


def test_cpu_cache_bytes_are_what_the_spec_says():
    """vLLM's own CPU kernel writes K and V into a cache; kvxfer's byte oracle reads them back
    through the described spec (so the K order is vLLM's, not a guess)."""
    ops = pytest.importorskip("vllm._custom_ops")
    from kvxfer.layout import CacheGeometry, CacheView
    from kvxfer.layout.oracle import Arena, logical_kv
    n, bs, heads, d = 2, 32, 2, 64
    cache = torch.zeros(n, heads, bs, 2 * d, dtype=torch.float32)
    desc = describe_cache([cache], num_blocks=n, block_size=bs, num_kv_heads=heads, head_size=d,
                          tp_rank=0, tp_size=1, model="m")
    if desc.same_format_only:
        pytest.skip(f"this host's CPU kernel keeps another K order ({desc.note})")
    k, v = torch.randn(2, n * bs, heads, d)
    view = cache.view(n, heads, bs * 2, d)
    isa = cpu_attention_isa(torch.float32, bs, d)   # the kernel vLLM runs for this cache here
    ops.cpu_attn_reshape_and_cache(k, v, view[:, :, :bs], view[:, :, bs:], torch.arange(n * bs), isa)
    arena = Arena.wrap(cache.numpy())
    got = logical_kv(CacheView(desc.spec, CacheGeometry.contiguous(desc.spec, arena.base)), arena, [0, 1])
    got = torch.from_numpy(got.view("<f4")[0])   # [kv, tokens, heads, head_dim]
    assert torch.equal(got[0], k) and torch.equal(got[1], v)


def test_cpu_cache_of_another_kernel_moves_only_whole_blocks_of_its_format():
    caches = [torch.zeros(N, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    desc = describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D,
                          tp_rank=0, tp_size=1, model="m", cpu_isa="amx")
    assert desc.same_format_only and desc.spec.k_dim_chunk == 0 and "amx" in desc.note


@pytest.mark.parametrize("physical, logical_perm, storage, layout", [
    ((2, N, BS, H, D), (0, 1, 2, 3, 4), "split", "NHD"),        # flash-attn, LBNHC
    ((2, N, H, BS, D), (0, 1, 3, 2, 4), "split", "HND"),        # flash-attn, LBHNC
    ((N, 2, H, BS, D), (1, 0, 3, 2, 4), "packed", "HND"),       # block-outer K/V within a layer
])
def test_five_dim_caches_follow_their_strides(physical, logical_perm, storage, layout):
    caches = [torch.zeros(physical, dtype=torch.float16).permute(*logical_perm) for _ in range(L)]
    assert tuple(caches[0].shape) == (2, N, BS, H, D)
    desc = describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D,
                          tp_rank=0, tp_size=1, model="m")
    assert (desc.spec.storage.value, desc.spec.layout.value) == (storage, layout)
    assert all(t.is_contiguous() and t.numel() == 2 * N * H * BS * D for t in desc.tensors)


def test_cross_layer_cache_is_one_tensor():
    base = torch.zeros(N, L, 2, H, BS, D, dtype=torch.bfloat16)   # BLHNC: a block row holds every layer
    caches = [base[:, i].permute(1, 0, 3, 2, 4) for i in range(L)]  # logical (2, N, BS, H, D) views
    desc = describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D,
                          tp_rank=0, tp_size=1, model="m")
    assert (desc.spec.storage.value, desc.spec.layout.value) == ("cross_layer", "HND")
    assert len(desc.tensors) == 1 and desc.tensors[0].data_ptr() == base.data_ptr()


def test_unknown_shape_is_a_layout_error():
    with pytest.raises(LayoutError):
        describe_cache([torch.zeros(N, BS, 3 * D)], num_blocks=N, block_size=BS, num_kv_heads=H,
                       head_size=D, tp_rank=0, tp_size=1, model="m")


def test_cpu_caches_tp2_to_tp1_read_lands_every_head_in_place():
    # Two producer ranks (one head each) and a TP1 consumer, all in vLLM's CPU layout,
    # described by the adapter and moved by real Agents over the byte-copying FakeBackend.
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(L, N, H, 2, BS, D, generator=g).to(torch.bfloat16)  # [layer, block, head, kv, tok, dim]
    world, port = FakeWorld(), free_port(2)
    cfg = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, handshake_timeout=5.0)

    def agent(name, tensors, tp_rank, tp_size, config):
        desc = describe_cache(tensors, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D,
                              tp_rank=tp_rank, tp_size=tp_size, model="m")
        a = Agent(name, desc.spec, config, backend=FakeBackend(name, world))
        a.register(desc.tensors)
        a.listen()
        return a

    prod_t = [[truth[l, :, r:r + 1].reshape(N, 1, BS, 2 * D).clone() for l in range(L)] for r in range(2)]
    cons_t = [torch.zeros(N, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    producers = [agent(f"p{r}", prod_t[r], r, 2, cfg) for r in range(2)]
    consumer = agent("d0", cons_t, 0, 1, cfg.replace(side_channel_port=free_port()))
    try:
        src, dst = [1, 2, 6], [0, 5, 3]
        for p in producers:
            p.hold("req", src)
        consumer.read(("127.0.0.1", port), dst, src, "req").wait(10)
        for l in range(L):
            want = truth[l, src].reshape(len(src), H, BS, 2 * D)
            assert torch.equal(cons_t[l][dst], want), f"layer {l}"
            untouched = [b for b in range(N) if b not in dst]
            assert not cons_t[l][untouched].any()
    finally:
        for a in (*producers, consumer):
            a.close()


# ---- loading by name and by module path -----------------------------------------------

def test_connector_resolves_by_bare_name_and_by_module_path():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from kvxfer_vllm.connector import KvxferConnector
    from kvxfer_vllm.plugin import register

    register()
    register()  # vLLM loads plugins in several places; twice must be harmless
    by_name = SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path=None)
    by_path = SimpleNamespace(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer_vllm")
    assert KVConnectorFactory.get_connector_class(by_name) is KvxferConnector
    assert KVConnectorFactory.get_connector_class(by_path) is KvxferConnector
