"""Baseline: vLLM's own NixlConnector in a P/D pair passes the same contract (proves the harness).

Marked ``slow`` (``make test-slow``): it checks the harness against vLLM's own connector, not
kvxfer, and its pair took 2-4 minutes of the default suite on the 2-core CI host, where stock
vLLM's decode instance sometimes leaves a request unstarted for 15-90 s (see
``test_concurrent_requests``)."""

from __future__ import annotations

import logging

import pytest

from conftest import BLOCK_SIZE, pd_servers
from pd_contract import CONCURRENT_PROMPTS, MAX_TOKENS, PDContract, reference
from vllm_harness import prompt_of, route_pd, run_concurrently

pytestmark = pytest.mark.slow

STOCK = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
#: What stock vLLM's prefill worker logs when it frees a request's blocks at the end of their
#: lease (`kv_lease_duration`, 30 s) although no decoder has read them.
EXPIRED = "Releasing expired KV blocks for request"

log = logging.getLogger(__name__)


def first_contact(p, d) -> None:
    """Route one P/D request so stock vLLM handshakes before the contract's tests; once more if
    that first attempt fails.

    Stock vLLM waits a hard-coded 5 s for its first handshake's answer (a ZMQ ``RCVTIMEO``). On
    the loaded 2-core CI host that ran out once in about ten runs, failing whichever contract
    test came first. This harness checks connectors after first contact; kvxfer's own first
    contact is tested in its own modules. Two failed attempts still fail the module."""
    prompt = prompt_of(BLOCK_SIZE + 1, seed=5)
    want = reference(p, prompt)
    for attempt in (1, 2):
        try:
            got = route_pd(p, d, prompt, MAX_TOKENS).token_ids
        except RuntimeError as exc:  # RequestFailed: vLLM answered with an error
            if attempt == 2:
                raise
            log.warning("stock NixlConnector's first P/D request failed (%s); trying once more", exc)
            continue
        if got == want:
            return
        if attempt == 2:
            raise AssertionError(f"stock NixlConnector after first contact: expected {want}; got {got}")
        log.warning("stock NixlConnector's first P/D request answered %s, not %s; trying once more", got, want)


@pytest.fixture(scope="module")
def servers(tiny_model, vllm_logs):
    with pd_servers("stock", tiny_model, vllm_logs, STOCK, STOCK) as (p, d):
        first_contact(p.client(), d.client())
        yield p, d


@pytest.fixture(scope="module")
def pair(servers):
    p, d = servers
    return p.client(), d.client()


class TestStockNixlConnector(PDContract):
    """Stock NixlConnector, CPU buffers, TP 1 -> TP 1."""

    def test_concurrent_requests(self, pair, servers):
        # Stock vLLM's decode instance on this 2-core host sometimes leaves a concurrent
        # request's load unstarted for 30-90 s. Its prefill instance then frees the blocks at
        # the end of their lease and the decoder later reads whatever the engine wrote there:
        # wrong tokens, which vLLM only logs ("Potentially invalid KV blocks ... may have
        # expired"). Seen in 2 of ~10 CI runs and 1 of 8 rounds of this batch (2026-12-06).
        # So here, as the harness's baseline, every wrong answer must be one whose lease
        # expired; any other mismatch still fails. kvxfer's connector runs the strict test.
        p, d = pair
        prefill_log = servers[0].log_path
        prompts = [prompt_of(n, seed=40 + i) for i, n in enumerate(CONCURRENT_PROMPTS)]
        refs = [reference(p, x) for x in prompts]
        expired_before = prefill_log.read_text(errors="replace").count(EXPIRED)
        got = run_concurrently(lambda x: route_pd(p, d, x, MAX_TOKENS).token_ids, prompts)
        expired = prefill_log.read_text(errors="replace").count(EXPIRED) - expired_before
        wrong = [len(x) for x, g, r in zip(prompts, got, refs) if g != r]
        if wrong:
            log.warning("stock NixlConnector: %d wrong answers (prompts of %s tokens), %d leases expired",
                        len(wrong), wrong, expired)
        assert len(wrong) <= expired, (
            f"{len(wrong)} answers differ from a single instance's (prompts of {wrong} tokens) "
            f"but only {expired} of their leases expired at the prefill instance")
