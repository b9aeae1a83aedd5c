"""transformers -> transformers through kvxfer between two ``kvxfer-hf`` processes (real NIXL, real ZMQ).

Prefill on ``hf32`` (block size 32), decode on ``hf16`` (block size 16): the translator turns
one producer block into two consumer blocks. The answers must equal ``hf32`` alone. Also: the
params use vLLM's field names, a load failure follows ``kv_load_failure_policy`` on each side,
and bad requests get 4xx answers naming the field.
"""

from __future__ import annotations

import time

import pytest

from cross_contract import MAX_TOKENS, CrossContract, Route, reference
from hf_harness import HF16_LEASE_S, ProxyServer, RequestFailed, port_run, post_json, prefill, prompt_of, route_pd

pytestmark = pytest.mark.timeout(300)


def wait_for(condition, within: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not seen within {within} s: {what}")
        time.sleep(0.2)


def settled_free_blocks(server) -> float:
    """``server``'s free blocks once it holds nothing for an earlier test's request.

    A producer frees a request's blocks when its reaper hears the decoder is done, a little after
    the decoder answered; a count taken before that would move under the test's own request."""
    wait_for(lambda: server.metric("kvxfer_hf_held_requests") == 0
             and server.metric("kvxfer_hf_quarantined_blocks") == 0,
             within=30, what="earlier requests' blocks back in the pool")
    return server.metric("kvxfer_hf_kv_blocks_free")


@pytest.fixture(scope="module")
def route(hf_servers, hf_logs):
    p, d = hf_servers["hf32"], hf_servers["hf16"]
    proxy = ProxyServer([p], [d], hf_logs, name="hf-hf-proxy", port=port_run(1)).start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield Route(p.client(), d.client(), p.client(), proxy.client(), decoder_reports_loaded=True)
    finally:
        proxy.stop()


@pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                    layout="NHD split, block 32 -> NHD split, block 16", path="direct", device="CPU")
class TestTransformersToTransformers(CrossContract):
    """kvxfer-hf (block 32) prefill -> kvxfer-hf (block 16) decode."""

    def test_plain_request_equals_transformers_generate(self, route, hf_model):
        # the server's greedy loop is transformers' own generate, token for token
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).eval()
        for n in (3, 70):
            prompt = prompt_of(n, seed=n)
            want = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                  do_sample=False)[0, n:].tolist()
            assert reference(route, prompt) == want

    def test_decoder_loads_all_but_the_last_prompt_token(self, route):
        prompt = prompt_of(3 * 32 + 5, seed=13)
        got = route_pd(route.prefill, route.decode, prompt, MAX_TOKENS)
        assert got.cached_tokens == len(prompt) - 1  # the last one is computed for its logits, as vLLM does
        assert got.token_ids == reference(route, prompt)

    def test_prefill_answer_uses_vllm_field_names(self, route):
        answer = prefill(route.prefill, prompt_of(50, seed=50))
        params = answer.kv_transfer_params
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
            assert params[key], key
        assert params["remote_block_ids"] == [[*params["remote_block_ids"][0]]]
        assert len(params["remote_block_ids"][0]) == 2  # 50 tokens in blocks of 32
        assert params["remote_num_tokens"] == 50
        assert len(answer.token_ids) == 1
        route.decode.complete(prompt_of(50, seed=50), 1, kv_transfer_params=params)  # frees P's blocks

    def test_prefill_answers_its_hold_token_and_the_decode_reads_by_it(self, route):
        # issue 35: 70 tokens in blocks of 32 -> 3 held blocks, all read (69 tokens rounded up to 32s)
        prompt = prompt_of(70, seed=71)
        params = prefill(route.prefill, prompt).kv_transfer_params
        token = params["remote_hold_token"]
        assert isinstance(token, list) and len(token) == 3 and all(isinstance(v, int) for v in token) and token[1] >= 1
        assert route.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids == reference(route, prompt)

    def test_failed_load_under_fail_is_an_error(self, route):
        # hf16 (policy fail) is given params whose blocks were already read and released
        a = prompt_of(70, seed=61)
        params = prefill(route.prefill, a).kv_transfer_params
        assert route.decode.complete(a, MAX_TOKENS, kv_transfer_params=params).token_ids == reference(route, a)
        with pytest.raises(RequestFailed) as err:
            route.decode.complete(a, MAX_TOKENS, kv_transfer_params=params)
        assert err.value.status == 500 and "kv_load_failure_policy=fail" in err.value.body
        q = prompt_of(40, seed=62)  # and the pair keeps serving
        assert route_pd(route.prefill, route.decode, q, MAX_TOKENS).token_ids == reference(route, q)

    @pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                        layout="NHD split, block 16 -> NHD split, block 32", path="direct", device="CPU")
    def test_failed_load_under_recompute_prefills_locally(self, route):
        # the reverse pair: hf16 prefills, hf32 (policy recompute) decodes; a stale read recomputes
        hf16, hf32 = route.decode, route.prefill
        a = prompt_of(70, seed=63, last=9)
        b = prompt_of(70, seed=64, last=9)
        params = prefill(hf16, a).kv_transfer_params
        got_a = hf32.complete(a, MAX_TOKENS, kv_transfer_params=params)
        # every prompt token but the last: the partial last blocks move too (70 tokens: 16 -> 32)
        assert got_a.token_ids == reference(route, a) and got_a.cached_tokens == 69
        got = hf32.complete(b, MAX_TOKENS, kv_transfer_params=dict(params))
        assert got.token_ids == reference(route, b) and got.cached_tokens == 0

    def test_blocks_return_to_the_pool_when_the_decoder_is_done(self, route):
        p = route.prefill
        free = settled_free_blocks(p)
        params = prefill(p, prompt_of(3 * 32 + 2, seed=66)).kv_transfer_params
        assert p.metric("kvxfer_hf_held_requests") >= 1
        assert p.metric("kvxfer_hf_kv_blocks_free") <= free - 4  # 98 tokens in blocks of 32
        route.decode.complete(prompt_of(3 * 32 + 2, seed=66), 1, kv_transfer_params=params)
        wait_for(lambda: p.metric("kvxfer_hf_held_requests") == 0 and p.metric("kvxfer_hf_kv_blocks_free") >= free,
                 within=10, what="the producer's blocks back in its pool")
        assert route.decode.metric("kvxfer_hf_quarantined_blocks") == 0

    def test_unclaimed_blocks_expire_with_the_lease_and_a_late_read_recomputes(self, route):
        # hf16 prefills (lease 6 s) and nobody reads: it frees the blocks when the lease ends;
        # hf32 (policy recompute) then asks for them: refused, so it computes the prompt itself
        hf16, hf32 = route.decode, route.prefill
        free = settled_free_blocks(hf16)
        prompt = prompt_of(50, seed=67)
        params = prefill(hf16, prompt).kv_transfer_params
        assert hf16.metric("kvxfer_hf_held_requests") == 1
        time.sleep(HF16_LEASE_S / 2)
        assert hf16.metric("kvxfer_hf_held_requests") == 1  # still held before the lease ends
        wait_for(lambda: hf16.metric("kvxfer_hf_kv_blocks_free") >= free, within=HF16_LEASE_S + 20,
                 what="hf16's blocks freed by the lease")
        got = hf32.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
        assert got.token_ids == reference(route, prompt) and got.cached_tokens == 0

    def test_unreachable_producer_under_fail(self, route):
        params = prefill(route.prefill, prompt_of(40, seed=65)).kv_transfer_params
        route.decode.complete(prompt_of(40, seed=65), 1, kv_transfer_params=params)
        dead = {**params, "remote_port": 1}  # nobody listens there
        with pytest.raises(RequestFailed) as err:
            route.decode.complete(prompt_of(40, seed=65), MAX_TOKENS, kv_transfer_params=dead)
        assert err.value.status == 500

    @pytest.mark.parametrize("body, status, words", [
        ({"prompt": "hello", "max_tokens": 2}, 400, "token ids"),
        ({"prompt": [1, 2, 5000], "max_tokens": 2}, 400, "[0, 1024)"),
        ({"prompt": [], "max_tokens": 2}, 400, "non-empty"),
        ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": 2, "temperature": 0.7}, 400, "temperature"),
        ({"prompt": [1, 2], "max_tokens": 2, "stream": True}, 400, "stream"),
        ({"prompt": [1, 2], "max_tokens": 2, "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"prompt": [1, 2], "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}}, 400,
         "remote_block_ids"),
        ({"prompt": [1, 2], "max_tokens": 5000}, 400, "exceeds"),
        ({"model": "other", "prompt": [1, 2]}, 404, "does not exist"),
    ])
    def test_bad_requests_get_4xx(self, route, body, status, words):
        url = route.decode.url + "/v1/completions"
        with pytest.raises(RequestFailed) as err:
            post_json(url, {"model": "tiny", **body}, 30)
        assert err.value.status == status and words in err.value.body, err.value.body
