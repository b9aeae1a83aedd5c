"""Units of the transformers adapter, in one process: params against the vLLM adapter's, settings, pool formats, read extents."""

from __future__ import annotations

import pytest
import torch

from kvxfer import ConfigError, KVSpec, LayoutError
from kvxfer_transformers.params import BadParams, RemotePrefill, producer_answer
from kvxfer_transformers.pool import KVPool, ModelShape, PoolExhausted
from kvxfer_transformers.settings import ServeSettings
from kvxfer_transformers.transfer import read_extent

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=8)


def test_both_adapters_answer_in_vllms_field_names_and_read_them_back():
    from kvxfer_vllm import params as vllm_params

    args = dict(request_id="r1", block_ids=[4, 5], engine_id="e", host="10.0.0.1", port=5600, tp_size=1,
                num_tokens=40)
    # the fields vLLM's proxy forwards untouched (NixlConnector's names; transfer_mode is ours)
    wire = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5]],
            "remote_engine_id": "e", "remote_request_id": "r1", "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40, "transfer_mode": "kvxfer-pull"}
    assert producer_answer(**args) == wire == vllm_params.producer_answer(**args)
    got = vllm_params.RemotePrefill.parse(wire)
    assert (got.request_id, got.host, got.port, got.block_ids, got.num_tokens, got.engine_id) == \
        ("r1", "10.0.0.1", 5600, (4, 5), 40, "e")
    assert RemotePrefill.parse({**wire, "remote_block_ids": [4, 5]}).block_ids == (4, 5)  # flat, as older peers


@pytest.mark.parametrize("change, words", [
    ({"remote_port": None}, "lack"), ({"remote_port": 70000}, "remote_port"),
    ({"remote_block_ids": [[1], [2]]}, "groups"), ({"remote_block_ids": [-1]}, "remote_block_ids"),
    ({"remote_host": 5}, "remote_host"), ({"remote_num_tokens": True}, "remote_num_tokens"),
])
def test_bad_params_name_the_field(change, words):
    params = {**producer_answer(request_id="r", block_ids=[1], engine_id="e", host="h", port=1, tp_size=1,
                                num_tokens=3), **change}
    with pytest.raises(BadParams, match=words):
        RemotePrefill.parse(params)


def test_settings_read_vllm_keys_and_the_environment():
    s = ServeSettings.parse('{"kv_connector":"KvxferConnector","kv_role":"kv_consumer",'
                            '"kv_load_failure_policy":"recompute","kv_connector_extra_config":'
                            '{"backends":"UCX","transfer_timeout":5}}',
                            environ={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "7"})
    assert (s.role, s.failure_policy, s.backends, s.transfer_timeout, s.lease) == \
        ("kv_consumer", "recompute", ("UCX",), 5.0, 7.0)
    assert s.consumes and not s.produces
    assert not ServeSettings.parse(None).enabled


@pytest.mark.parametrize("raw, words", [
    ("[1]", "JSON object"), ("{", "not valid JSON"), ('{"kv_rol":"kv_both"}', "unknown keys"),
    ('{"kv_load_failure_policy":"retry"}', "kv_load_failure_policy"),
    ('{"kv_buffer_device":"cuda"}', "kv_buffer_device"), ('{"enable_permute_local_kv":"maybe"}', "boolean"),
])
def test_settings_refuse_bad_configs(raw, words):
    with pytest.raises(ConfigError, match=words):
        ServeSettings.parse(raw, device="cpu", environ={})


def _layers(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(1, SHAPE.num_kv_heads, tokens, SHAPE.head_dim, generator=g) for _ in "kv")
            for _ in range(SHAPE.num_layers)]


@pytest.mark.parametrize("fmt", ["nhd", "vllm-cpu"])
def test_pool_round_trip(fmt):
    pool = KVPool(SHAPE, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu", model="m", fmt=fmt)
    layers = _layers(10)
    blocks = pool.allocate(3)
    pool.store(layers, [5, 1, 6], 10)
    for (k, v), (k2, v2) in zip(layers, pool.load([5, 1, 6], 10)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert [t.shape for t in pool.tensors] == [torch.Size(s) for s in pool.spec.tensor_shapes()]
    pool.free(blocks)
    assert pool.free_blocks == 8


def test_vllm_cpu_format_is_vllms_cpu_cache_bytes():
    # per layer [blocks, heads, 2, block_size, head_dim] memory; a head's K block is K transposed
    pool = KVPool(SHAPE, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu", model="m", fmt="vllm-cpu")
    layers = _layers(4)
    pool.store(layers, [2], 4)
    raw = pool.tensors[0][2]                          # block 2 of layer 0: [heads, 2, 4, 8]
    k, v = layers[0]
    for h in range(SHAPE.num_kv_heads):
        assert torch.equal(raw[h, 0].reshape(-1), k[0, h].t().reshape(-1))   # dim-major K
        assert torch.equal(raw[h, 1], v[0, h])                               # token-major V
    assert (pool.spec.layout.value, pool.spec.storage.value, pool.spec.k_dim_chunk) == ("HND", "head_packed", 1)


def test_which_peers_a_pool_can_exchange_with():
    """kvxfer converts vLLM CPU's transposed K, so both formats take every peer that states its K
    order; a head_packed peer that does not (vLLM CPU on an AMX kernel) is refused by both."""
    nhd = KVPool(SHAPE, num_blocks=2, block_size=32, dtype=torch.float32, device="cpu", model="m")
    cpu = KVPool(SHAPE, num_blocks=2, block_size=32, dtype=torch.float32, device="cpu", model="m", fmt="vllm-cpu")
    vllm_cpu = KVSpec(2, 2, 8, 32, 100, dtype="float32", layout="HND", storage="head_packed", k_dim_chunk=1)
    vllm_gpu = KVSpec(2, 2, 8, 16, 100, dtype="float32", layout="HND", storage="split")
    unknown_k = KVSpec(2, 2, 8, 32, 100, dtype="float32", layout="HND", storage="head_packed")
    for pool in (nhd, cpu):
        assert pool.exchangeable_with(vllm_gpu) and pool.exchangeable_with(vllm_cpu)
        assert pool.exchangeable_with(KVSpec(2, 2, 8, 64, 100, dtype="float32", layout="HND",
                                             storage="head_packed", k_dim_chunk=1))
        assert not pool.exchangeable_with(unknown_k)


def test_pool_refuses_what_does_not_fit():
    pool = KVPool(SHAPE, num_blocks=2, block_size=4, dtype=torch.float32, device="cpu", model="m")
    with pytest.raises(PoolExhausted, match="wanted 3 KV blocks; 2 of 2 free"):
        pool.allocate(3, timeout=0.05)
    with pytest.raises(LayoutError, match="do not fit"):
        pool.store(_layers(9), [0, 1], 9)
    with pytest.raises(LayoutError, match="needs a full_attention layer"):
        ModelShape.from_config(type("C", (), {"layer_types": ["sliding_attention"], "num_attention_heads": 2})())


def _remote(blocks: int, tokens: int | None) -> RemotePrefill:
    return RemotePrefill("r", "h", 1, tuple(range(10, 10 + blocks)), tokens)


@pytest.mark.parametrize("blocks, held, prompt, peer, local, want", [
    (2, 40, 40, 32, 32, (39, [10, 11], 2)),        # all but the last token, same block size
    (2, 40, 40, 32, 16, (39, [10, 11], 3)),        # one producer block lands in two; partial last blocks
    (3, 40, 40, 16, 32, (39, [10, 11, 12], 2)),    # a larger local block: partial last blocks both sides
    (1, 9, 9, 16, 32, (8, [10], 1)),               # less than one unit: still every token but the last
    (4, 64, 64, 16, 16, (63, [10, 11, 12, 13], 4)),
    (4, None, 50, 16, 16, (49, [10, 11, 12, 13], 4)),
    (4, 20, 64, 16, 16, (20, [10, 11], 2)),        # the producer computed fewer tokens than the prompt
])
def test_read_extent(blocks, held, prompt, peer, local, want):
    assert read_extent(_remote(blocks, held), prompt, peer, local) == want


@pytest.mark.parametrize("blocks, held, prompt, peer, local, want", [
    (2, 40, 40, 32, 16, (39, [10, 11], 4)),        # one producer block lands in two: whole units
    (3, 40, 40, 16, 32, (32, [10, 11], 1)),        # a larger local block: whole units only
    (1, 9, 9, 16, 32, (0, [], 0)),                 # less than one unit: nothing to read
    (4, 64, 64, 16, 16, (63, [10, 11, 12, 13], 4)),
])
def test_read_extent_of_a_gpu_pool_moves_whole_units(blocks, held, prompt, peer, local, want):
    """A pool on a GPU reads whole units (partial reads move by descriptors, see read_extent)."""
    assert read_extent(_remote(blocks, held), prompt, peer, local, partial=False) == want
