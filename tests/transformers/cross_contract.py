"""The P/D behaviour every engine pair must show, as a test mix-in (needs a module-scoped ``route`` fixture).

``route`` yields a ``Route``: the prefill and decode clients, the single-instance reference
(the engine the answers must equal, asked without ``kv_transfer_params``) and a ``kvxfer
proxy`` in front of the pair. Every comparison is token for token; the first test of the
class shows the reference can tell contexts apart, and ``test_decoder_uses_the_transferred_kv``
shows the decoder's answer comes from the moved KV (prompt A's KV under prompt B answers A).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_harness import Client, Completion, prefill, prompt_of, route_pd, run_concurrently

MAX_TOKENS = 12


@dataclass(frozen=True)
class Route:
    prefill: Client
    decode: Client
    reference: Client
    proxy: Client
    #: prompt tokens the decoder must report as loaded (None: the decoder does not report them)
    decoder_reports_loaded: bool = False


def reference(r: Route, prompt: list[int]) -> list[int]:
    return r.reference.complete(prompt, MAX_TOKENS).token_ids


def first_difference(got: list[int], want: list[int]) -> str:
    """Where two answers part (the report the issue asks for when a pair disagrees)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first difference at generated position {i}: {a} vs {b} (got {got}, want {want})"
    return f"lengths differ: {len(got)} vs {len(want)}" if len(got) != len(want) else "equal"


class CrossContract:
    """Token-for-token P/D across two engines; short, block-boundary, long and concurrent prompts."""

    def check(self, r: Route, prompt: list[int], got: Completion) -> None:
        want = reference(r, prompt)
        assert got.token_ids == want, first_difference(got.token_ids, want)
        if r.decoder_reports_loaded and len(prompt) > 1:
            # the decoder took KV from the producer rather than computing the prompt itself
            assert got.cached_tokens and got.cached_tokens > 0, got.raw

    def test_answers_depend_on_the_whole_context(self, route):
        answers = {tuple(reference(route, prompt_of(100, seed, last=7))) for seed in range(4)}
        assert len(answers) == 4, answers

    def test_decoder_uses_the_transferred_kv(self, route):
        # A and B share length and last token: a decoder that used B's own prompt would answer B
        a = prompt_of(2 * 32 + 7, seed=21, last=5)
        b = prompt_of(2 * 32 + 7, seed=22, last=5)
        ref_a, ref_b = reference(route, a), reference(route, b)
        assert ref_a != ref_b
        params_a = prefill(route.prefill, a).kv_transfer_params
        got = route.decode.complete(b, MAX_TOKENS, kv_transfer_params=params_a).token_ids
        assert got == ref_a, first_difference(got, ref_a)

    def test_short_prompt_within_one_block(self, route):
        prompt = prompt_of(9, seed=11)
        self.check(route, prompt, route_pd(route.prefill, route.decode, prompt, MAX_TOKENS))

    def test_block_boundary_prompts(self, route):
        for n in (16, 32, 33, 64, 65):
            prompt = prompt_of(n, seed=100 + n)
            self.check(route, prompt, route_pd(route.prefill, route.decode, prompt, MAX_TOKENS))

    def test_long_prompt(self, route):
        prompt = prompt_of(600, seed=12)
        self.check(route, prompt, route_pd(route.prefill, route.decode, prompt, MAX_TOKENS))

    def test_eight_concurrent_requests(self, route):
        prompts = [prompt_of(n, seed=40 + i) for i, n in enumerate((5, 31, 33, 64, 97, 150, 260, 600))]
        refs = [reference(route, x) for x in prompts]
        got = run_concurrently(lambda x: route_pd(route.prefill, route.decode, x, MAX_TOKENS).token_ids,
                               prompts, workers=8)
        for g, want in zip(got, refs):
            assert g == want, first_difference(g, want)

    def test_through_kvxfer_proxy(self, route):
        # Short, block-boundary and long prompts, eight at once, as a user's client sends them.
        prompts = [prompt_of(n, seed=90 + i) for i, n in enumerate((9, 16, 32, 33, 64, 65, 257, 600))]
        refs = [reference(route, x) for x in prompts]
        got = run_concurrently(lambda x: route.proxy.complete(x, MAX_TOKENS).token_ids, prompts, workers=8)
        for g, want in zip(got, refs):
            assert g == want, first_difference(g, want)
