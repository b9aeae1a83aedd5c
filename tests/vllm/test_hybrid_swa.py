"""KvxferConnector with vLLM's hybrid KV-cache manager: a tiny Gemma 3 (sliding-window and full attention).

The model alternates sliding-window layers (window 32) with full-attention layers; its weights
are random but wide (``initializer_range=0.3``, untied embeddings), so its answers depend on the
context (checked below: the contract's first test). vLLM keeps two KV-cache groups (full and
sliding); KvxferConnector implements ``SupportsHMA``, so the prefill answers one block list per
group, the sliding group's cut to its window, and the decode reads every group in one read.
Prompts are longer than the window (up to 300 tokens, ten blocks of 32).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import BLOCK_SIZE, pd_servers
from pd_contract import EXTERNAL_HITS, MAX_TOKENS, reference
from test_stock_nixl import STOCK, first_contact
from kvxfer_transformers.testing import GEMMA3_WINDOW
from shared_servers import shared_model
from vllm_harness import ProxyServer, prefill, prompt_of, route_pd, run_concurrently

WINDOW = GEMMA3_WINDOW


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return shared_model("gemma3", tmp_path_factory)


@pytest.fixture(scope="module")
def servers(gemma3_pd):
    """The session's Gemma 3 pair (shared_servers.KVX; its prefill instance, with ``enable_permute_local_kv`` on
    and prefix caching off, is also tests/transformers/test_hybrid_hf.py's vLLM peer:
    shared_servers.py). Only the decode instance reads KV here."""
    return gemma3_pd.prefill, gemma3_pd.decode


@pytest.fixture(scope="module")
def pair(servers):
    p, d = servers
    return p.client(), d.client()


@pytest.fixture(scope="module")
def proxy(servers, vllm_logs):
    p, d = servers
    proxy = ProxyServer([p], [d], vllm_logs, name="hybrid-swa-proxy").start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield proxy.client()
    finally:
        proxy.stop()


def test_hybrid_manager_stays_on(servers):
    p, d = servers
    for s in (p, d):
        text = s.log_text()
        assert "Turning off hybrid kv cache manager" not in text
        assert "hybrid cache of 2 groups" in text, s.log_tail()


def test_answers_depend_on_the_whole_context(pair):
    p, _ = pair
    answers = [tuple(reference(p, prompt_of(100, seed, last=7))) for seed in range(4)]
    assert len(set(answers)) == 4, answers


def test_prefill_answers_one_list_per_group_sliding_cut_to_its_window(pair):
    p, _ = pair
    prompt = prompt_of(300, seed=5)
    params = prefill(p, prompt).kv_transfer_params
    groups = params["remote_block_ids"]
    assert len(groups) == 2, groups
    lengths = sorted(len(g) for g in groups)
    # full attention: every block of the prompt; sliding: the window's blocks plus one
    assert lengths == [-(-WINDOW // BLOCK_SIZE) + 1, -(-300 // BLOCK_SIZE)], groups
    assert params["remote_num_tokens"] == 300
    # let the producer go: decode it (also a P/D case of its own)
    d = pair[1]
    assert d.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids == reference(p, prompt)


@pytest.mark.compat(producer="vLLM", consumer="vLLM", tp="1 -> 1",
                    layout="vLLM hybrid manager: full + sliding window 32 (Gemma 3, shared tensors), vLLM CPU "
                           "(HND head-packed, K transposed), block 32 -> same",
                    path="direct (one read for both groups, window only)", device="CPU")
@pytest.mark.parametrize("length", [40, 100, 130, 257])
def test_tokens_equal_a_single_instance(pair, length):
    p, d = pair
    prompt = prompt_of(length, seed=300 + length)
    before = d.metric(EXTERNAL_HITS)
    got = route_pd(p, d, prompt, MAX_TOKENS)
    assert got.token_ids == reference(p, prompt)
    assert d.metric(EXTERNAL_HITS) - before >= length - 1   # the decode loaded the prompt, did not compute it


def test_through_kvxfer_proxy(pair, proxy):
    p, _ = pair
    prompts = [prompt_of(n, seed=700 + n) for n in (70, 150, 222)]
    refs = [reference(p, x) for x in prompts]
    assert run_concurrently(lambda x: proxy.complete(x, MAX_TOKENS).token_ids, prompts) == refs


def test_a_wrong_window_changes_the_answer(pair):
    """The same P/D route with the sliding group's blocks swapped: the decode reads another
    order of the window and answers differently (so the tests above would catch it)."""
    p, d = pair
    prompt = prompt_of(130, seed=42)
    first = prefill(p, prompt).kv_transfer_params
    groups = first["remote_block_ids"]
    sliding = min(range(2), key=lambda i: len(groups[i]))
    swapped = [list(g) for g in groups]
    swapped[sliding] = swapped[sliding][::-1]
    got = d.complete(prompt, MAX_TOKENS, kv_transfer_params={**first, "remote_block_ids": swapped})
    assert got.token_ids != reference(p, prompt)


def _bytes_moved(client, metric: str, count_before: float, requests: int) -> float:
    """The ``metric`` histogram's sum once its count has grown by ``requests`` (connector stats
    reach the API server's /metrics a step or a logging interval after the load)."""
    deadline = time.monotonic() + 60
    while client.metric(metric + "_count") - count_before < requests:
        if time.monotonic() > deadline:
            pytest.fail(f"{metric}: fewer than {requests} loads counted after 60 s")
        time.sleep(0.5)
    return client.metric(metric + "_sum")


@pytest.mark.slow  # a measurement: starts vLLM's stock NixlConnector pair too (~3 min); `make test-slow`
def test_bytes_per_request_against_stock_nixl(pair, gemma3, vllm_logs):
    """The same prompts through vLLM's own NixlConnector (HMA on, its sliding group clipped to its
    window too) and through KvxferConnector: kvxfer moves equal or fewer bytes, and both answer as
    a single instance does."""
    prompts = [prompt_of(n, seed=900 + n) for n in (100, 130, 257)]
    p, d = pair
    refs = [reference(p, x) for x in prompts]
    with pd_servers("hybrid-swa-stock", gemma3, vllm_logs, STOCK, STOCK) as (sp, sd):
        sp, sd = sp.client(), sd.client()
        first_contact(sp, sd)
        metric = "vllm:nixl_bytes_transferred"
        count, total = sd.metric(metric + "_count"), sd.metric(metric + "_sum")
        assert [route_pd(sp, sd, x, MAX_TOKENS).token_ids for x in prompts] == refs
        stock = _bytes_moved(sd, metric, count, len(prompts)) - total
    metric = "vllm:kvxfer_bytes_transferred"
    count, total = d.metric(metric + "_count"), d.metric(metric + "_sum")
    assert [route_pd(p, d, x, MAX_TOKENS).token_ids for x in prompts] == refs
    ours = _bytes_moved(d, metric, count, len(prompts)) - total
    print(f"bytes for prompts of 100, 130 and 257 tokens: kvxfer {ours:.0f}, stock NixlConnector {stock:.0f}")
    assert 0 < ours <= stock, (ours, stock)
