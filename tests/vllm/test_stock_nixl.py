"""Baseline: vLLM's own NixlConnector in a P/D pair passes the same contract (proves the harness)."""

from __future__ import annotations

import logging

import pytest

from conftest import BLOCK_SIZE, pd_servers
from pd_contract import MAX_TOKENS, PDContract, reference
from vllm_harness import prompt_of, route_pd

STOCK = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

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
def pair(tiny_model, vllm_logs):
    with pd_servers("stock", tiny_model, vllm_logs, STOCK, STOCK) as (p, d):
        p_client, d_client = p.client(), d.client()
        first_contact(p_client, d_client)
        yield p_client, d_client


class TestStockNixlConnector(PDContract):
    """Stock NixlConnector, CPU buffers, TP 1 -> TP 1."""
