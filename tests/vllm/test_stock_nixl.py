"""Baseline: vLLM's own NixlConnector in a P/D pair passes the same contract (proves the harness)."""

from __future__ import annotations

import pytest

from conftest import pd_servers
from pd_contract import PDContract

STOCK = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def pair(tiny_model, vllm_logs):
    with pd_servers("stock", tiny_model, vllm_logs, STOCK, STOCK) as (p, d):
        yield p.client(), d.client()


class TestStockNixlConnector(PDContract):
    """Stock NixlConnector, CPU buffers, TP 1 -> TP 1."""
