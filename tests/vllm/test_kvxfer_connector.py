"""KvxferConnector in a real vLLM P/D pair: the shared contract, plus failure, lease and abort behaviour.

Both servers run ``kv_role: kv_both``, so either can prefill for the other. The first
("P") uses ``kv_load_failure_policy: fail`` and, as a decoder, ignores hold tokens
(``use_hold_tokens: false``, a decoder from before them); the second ("D") uses ``recompute``, reads by
hold token, and has a short producer lease (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), which the lease
test uses by letting D prefill and P decode.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import BLOCK_SIZE, pd_servers
from pd_contract import EXTERNAL_HITS, MAX_TOKENS, PDContract, reference
from vllm_harness import (
    Client, ProxyServer, RequestFailed, prefill, prompt_of, route_pd, run_concurrently,
)

KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_connector_extra_config": {"transfer_timeout": 60}}
D_LEASE_S = 6
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def servers(tiny_model, vllm_logs):
    with pd_servers("kvxfer", tiny_model, vllm_logs,
                    {**KVX, "kv_load_failure_policy": "fail",   # P decodes as a decoder from before hold tokens
                     "kv_connector_extra_config": {**KVX["kv_connector_extra_config"], "use_hold_tokens": False}},
                    {**KVX, "kv_load_failure_policy": "recompute"},
                    d_env={"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(D_LEASE_S)}) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def proxy(servers, vllm_logs):
    """kvxfer's proxy with P as prefiller and D as decoder."""
    p, d = servers
    proxy = ProxyServer([p], [d], vllm_logs, name="kvxfer-proxy").start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield proxy.client()
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def pair(servers):
    p, d = servers
    return p.client(), d.client()


def wait_for_no_blocks_in_use(*clients: Client, within: float) -> None:
    """Poll until every server's KV-cache usage is 0; fail (naming the values) after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        usage = [c.metric(USAGE) for c in clients]
        if not any(usage):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still in use after {within} s: {usage}")
        time.sleep(0.25)


class TestKvxferConnector(PDContract):
    """KvxferConnector, TP 1 -> TP 1, CPU caches (LBHNC)."""

    def test_through_kvxfer_proxy(self, pair, proxy):
        p, d = pair
        prompts = [prompt_of(n, seed=90 + i) for i, n in enumerate((9, 40, 130, 257))]
        refs = [reference(p, x) for x in prompts]
        before = d.metric(EXTERNAL_HITS)
        got = run_concurrently(lambda x: proxy.complete(x, MAX_TOKENS).token_ids, prompts)
        assert got == refs
        assert d.metric(EXTERNAL_HITS) - before >= sum(map(len, prompts)) - len(prompts)

    def test_prefill_answer_uses_vllm_field_names(self, pair):
        p, d = pair
        params = prefill(p, prompt_of(50, seed=50)).kv_transfer_params
        for key in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                    "remote_request_id", "remote_host", "remote_port", "tp_size"):
            assert key in params, key
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_block_ids"] == [[*params["remote_block_ids"][0]]]
        assert len(params["remote_block_ids"][0]) == 2  # 50 tokens in blocks of 32
        d.complete(prompt_of(50, seed=50), 1, kv_transfer_params=params)  # consume it: frees P

    def test_read_of_released_blocks_recomputes_under_recompute(self, pair):
        # A's blocks were read and released; feeding A's params with prompt B must not serve
        # B from A's freed blocks: the claim is refused and D (recompute) computes B itself.
        p, d = pair
        a = prompt_of(2 * BLOCK_SIZE + 9, seed=61, last=4)
        b = prompt_of(2 * BLOCK_SIZE + 9, seed=62, last=4)
        params_a = prefill(p, a).kv_transfer_params
        assert d.complete(a, MAX_TOKENS, kv_transfer_params=params_a).token_ids == reference(p, a)
        ref_b = reference(p, b)
        assert ref_b != reference(p, a)
        got = d.complete(b, MAX_TOKENS, kv_transfer_params=dict(params_a))
        assert got.token_ids == ref_b
        route_ok = route_pd(p, d, prompt_of(40, seed=63), MAX_TOKENS)
        assert route_ok.token_ids == reference(p, prompt_of(40, seed=63))

    def test_expired_lease_frees_blocks_and_late_read_fails_under_fail(self, servers, pair):
        # D prefills (short lease), nobody reads: D frees the blocks when the lease ends.
        # P then tries the late read: refused, and P's policy (fail) ends the request with an error.
        p, d = pair
        wait_for_no_blocks_in_use(p, d, within=30)
        prompt = prompt_of(3 * BLOCK_SIZE, seed=71)
        params = prefill(d, prompt).kv_transfer_params
        assert d.metric(USAGE) > 0  # held for the decoder
        time.sleep(D_LEASE_S / 2)
        assert d.metric(USAGE) > 0  # still held before the lease ends
        wait_for_no_blocks_in_use(d, within=D_LEASE_S + 30)
        with pytest.raises(RequestFailed):
            got = p.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
            if got.finish_reason == "error" or not got.token_ids:  # an error reported in-band
                raise RequestFailed(200, str(got.raw))
        # P keeps serving, in both directions
        q = prompt_of(70, seed=72)
        assert route_pd(d, p, q, MAX_TOKENS).token_ids == reference(d, q)
        assert route_pd(p, d, q[::-1], MAX_TOKENS).token_ids == reference(p, q[::-1])

    def test_a_frozen_prefill_instance_does_not_hold_up_another_instances_loads(self, pair):
        """Two prefill instances feed D in the same steps; one is frozen (its side channel accepts
        connections and never answers, as a SIGSTOPped process's does). The healthy instance's
        loads finish as fast as with no frozen instance around; the frozen one's load fails after
        the handshake timeout and D (recompute) computes that prompt itself."""
        p, d = pair
        frozen = socket.socket()
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(64)  # never accepted
        try:
            healthy = [prompt_of(3 * BLOCK_SIZE + 5, seed=90 + i) for i in range(3)]
            stuck = prompt_of(2 * BLOCK_SIZE + 3, seed=99)
            refs = [reference(p, q) for q in healthy]
            ref_stuck = reference(p, stuck)

            def timed(q):
                started = time.monotonic()
                got = route_pd(p, d, q, MAX_TOKENS)
                return got.token_ids, time.monotonic() - started

            alone = [timed(q)[1] for q in healthy]  # the same work, no frozen instance
            real_params = prefill(p, stuck).kv_transfer_params
            stuck_params = {**real_params, "remote_host": "127.0.0.1", "remote_port": frozen.getsockname()[1]}
            started = time.monotonic()
            with ThreadPoolExecutor(max_workers=1) as pool:
                late = pool.submit(d.complete, stuck, MAX_TOKENS, kv_transfer_params=stuck_params)
                time.sleep(0.5)  # the frozen load is scheduled first: its handshake is already waiting
                beside = run_concurrently(timed, healthy, workers=3)
                healthy_done = time.monotonic() - started
                assert [tokens for tokens, _ in beside] == refs
                assert max(t for _, t in beside) < max(alone) + 3.0, (alone, beside)
                assert not late.done(), "the frozen instance's load ended before the healthy ones"
                assert late.result(timeout=120).token_ids == ref_stuck  # recomputed by D
            assert healthy_done < 8.0, f"healthy loads took {healthy_done:.1f} s beside a frozen instance"
            d.complete(stuck, 1, kv_transfer_params=real_params)  # consume P's hold: frees its blocks
            wait_for_no_blocks_in_use(p, d, within=30)
        finally:
            frozen.close()

    def test_abort_on_decoder_frees_blocks_on_both_sides(self, servers, pair):
        p, d = pair
        p_server, d_server = servers
        wait_for_no_blocks_in_use(p, d, within=30)
        prompt = prompt_of(5 * BLOCK_SIZE, seed=81)
        params = prefill(p, prompt).kv_transfer_params
        assert p.metric(USAGE) > 0
        abort_soon(d_server.url, prompt, params)
        # P's lease is 480 s: only the decoder's abort (or its completed read) frees P in time
        wait_for_no_blocks_in_use(p, d, within=30)
        q = prompt_of(90, seed=82)
        assert route_pd(p, d, q, MAX_TOKENS).token_ids == reference(p, q)


    def test_loads_read_by_the_hold_token_and_older_peers_still_claim(self, servers, pair):
        # issue 35: P answers its hold's token (remote_hold_token) and D's load reads by it, with no
        # claim; an older producer's answer (no token) and an older decoder (P) go through the claim.
        p, d = pair
        p_server, d_server = servers
        by_token = lambda server: server.log_text().count(", by hold token)")  # noqa: E731 (the worker's log)
        failed = lambda server: server.log_text().count("kvxfer: load of")  # noqa: E731 (a failed load's warning)
        failures = failed(d_server)  # D recomputes a failed load: its answer alone would not show one
        route_pd(p, d, prompt_of(40, seed=96), MAX_TOKENS)  # D has handshaken P: its loads may skip the claim
        prompt = prompt_of(3 * BLOCK_SIZE + 5, seed=195, last=6)
        ref = reference(p, prompt)
        params = prefill(p, prompt).kv_transfer_params
        token = params["remote_hold_token"]
        assert len(token) == 3 and all(isinstance(v, int) for v in token) and token[1] >= 1
        before, hits = by_token(d_server), d.metric(EXTERNAL_HITS)
        assert d.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids == ref
        assert by_token(d_server) == before + 1 and d.metric(EXTERNAL_HITS) - hits >= len(prompt) - 1
        # a producer from before hold tokens: its answer has no token, and D claims
        older = prompt_of(2 * BLOCK_SIZE + 9, seed=197, last=6)
        ref_older = reference(p, older)
        params = prefill(p, older).kv_transfer_params
        del params["remote_hold_token"]
        hits = d.metric(EXTERNAL_HITS)
        assert d.complete(older, MAX_TOKENS, kv_transfer_params=params).token_ids == ref_older
        assert by_token(d_server) == before + 1 and d.metric(EXTERNAL_HITS) - hits >= len(older) - 1
        assert failed(d_server) == failures
        # a decoder from before hold tokens (P ignores them) reads D's answer, token and all, by the claim
        route_pd(d, p, prompt_of(40, seed=98), MAX_TOKENS)
        back = prompt_of(2 * BLOCK_SIZE + 3, seed=199, last=6)
        ref_back = reference(d, back)
        params = prefill(d, back).kv_transfer_params
        assert "remote_hold_token" in params
        before_p, hits = by_token(p_server), p.metric(EXTERNAL_HITS)
        assert p.complete(back, MAX_TOKENS, kv_transfer_params=params).token_ids == ref_back
        assert by_token(p_server) == before_p and p.metric(EXTERNAL_HITS) - hits >= len(back) - 1


def abort_soon(url: str, prompt: list[int], params: dict) -> None:
    """Send a streaming request and hang up at once: vLLM aborts it (client disconnect)."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 500, "temperature": 0,
                       "ignore_eos": True, "stream": True, "kv_transfer_params": params})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    conn.sock.close()
    conn.close()
