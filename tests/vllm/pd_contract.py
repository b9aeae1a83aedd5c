"""The P/D behaviour every connector must show against real vLLM, as a test mix-in (needs a ``pair`` fixture).

A module subclasses ``PDContract`` as ``Test...`` and provides a module-scoped ``pair``
fixture yielding ``(prefill_client, decode_client)``. The prefill server, asked without
``kv_transfer_params``, is the single-instance reference: it is a plain vLLM engine.
"""

from __future__ import annotations

from conftest import BLOCK_SIZE
from vllm_harness import Client, prefill, prompt_of, route_pd, run_concurrently

MAX_TOKENS = 12
#: Prompt lengths of the concurrent batch: within one block, across a boundary, many blocks.
CONCURRENT_PROMPTS = (5, 33, 64, 97, 150, 260)
#: vLLM's counter of prompt tokens a KV connector supplied.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
#: vLLM's counter of prompt tokens found in the local prefix cache.
LOCAL_HITS = "vllm:prefix_cache_hits_total"


def reference(p: Client, prompt: list[int]) -> list[int]:
    """The single-instance answer (no kv_transfer_params)."""
    return p.complete(prompt, MAX_TOKENS).token_ids


class PDContract:
    """Token-for-token P/D tests; each also shows that it could fail."""

    def test_answers_depend_on_the_whole_context(self, pair):
        # Without this, a decoder that ignored the transferred KV could still "match".
        p, _ = pair
        answers = [tuple(reference(p, prompt_of(100, seed, last=7))) for seed in range(4)]
        assert len(set(answers)) == 4, answers

    def test_short_prompt_within_one_block(self, pair):
        p, d = pair
        prompt = prompt_of(BLOCK_SIZE // 4, seed=11)
        got = route_pd(p, d, prompt, MAX_TOKENS)
        assert got.token_ids == reference(p, prompt)

    def test_prompt_spanning_many_blocks(self, pair):
        p, d = pair
        prompt = prompt_of(10 * BLOCK_SIZE + 5, seed=12)
        before = d.metric(EXTERNAL_HITS)
        got = route_pd(p, d, prompt, MAX_TOKENS)
        assert got.token_ids == reference(p, prompt)
        # the decoder took the prompt's KV from the connector rather than computing it
        assert d.metric(EXTERNAL_HITS) - before >= 10 * BLOCK_SIZE

    def test_decoder_uses_the_transferred_kv(self, pair):
        # Feed D the KV of prompt A under prompt B (same length and last token): D must
        # answer as for A, which shows it decodes from the transferred blocks.
        p, d = pair
        a = prompt_of(3 * BLOCK_SIZE + 3, seed=21, last=5)
        b = prompt_of(3 * BLOCK_SIZE + 3, seed=22, last=5)
        ref_a, ref_b = reference(p, a), reference(p, b)
        assert ref_a != ref_b
        params_a = prefill(p, a).kv_transfer_params
        got = d.complete(b, MAX_TOKENS, kv_transfer_params=params_a)
        assert got.token_ids == ref_a
        assert got.token_ids != ref_b

    def test_prefix_cache_hit_on_decoder(self, pair):
        # D already holds the first blocks of the prompt; it pulls only the rest.
        p, d = pair
        head = prompt_of(4 * BLOCK_SIZE, seed=31)
        d.complete(head + [3], 1)  # warms D's prefix cache with head's 4 full blocks
        prompt = head + prompt_of(3 * BLOCK_SIZE + 7, seed=32)
        hits = d.metric(LOCAL_HITS)
        got = route_pd(p, d, prompt, MAX_TOKENS)
        assert got.token_ids == reference(p, prompt)
        assert d.metric(LOCAL_HITS) - hits >= 4 * BLOCK_SIZE

    def test_concurrent_requests(self, pair):
        p, d = pair
        prompts = [prompt_of(n, seed=40 + i) for i, n in enumerate(CONCURRENT_PROMPTS)]
        refs = [reference(p, x) for x in prompts]
        got = run_concurrently(lambda x: route_pd(p, d, x, MAX_TOKENS).token_ids, prompts)
        assert got == refs
