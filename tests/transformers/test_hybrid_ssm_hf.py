"""kvxfer-hf serving an SSM hybrid: a tiny GraniteMoeHybrid (Mamba2 and attention layers), state moved as a state group.

Two ``kvxfer-hf`` processes (block 16, core 0) prefill and decode through kvxfer (real NIXL, real
ZMQ). The pool keeps a state group (``state0``: each Mamba2 layer's conv and SSM state, one slot
per request) and a full-attention group (``full1``); the prefill computes all prompt tokens but
the last, keeps their K/V and the state after them, then computes the last (a decoder recomputes
it, as vLLM's does), and answers ``[[slot], blocks]``; the decode reads both groups in one read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import (
    RequestFailed, hf_config, hf_pd_clients, port_run, prefill, prompt_of, route_pd,
)
from kvxfer_transformers.testing import make_tiny_granite_hybrid

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Path:
    return make_tiny_granite_hybrid(tmp_path_factory.mktemp("hf-tiny-granite-hybrid"))


@pytest.fixture(scope="module")
def hf_pair(granite, hf_logs):
    with hf_pd_clients("hf-ssm", granite, hf_logs, "--block-size", "16",
                       "--kv-transfer-config", hf_config("fail")) as pair:
        yield pair


def reference(client, prompt):
    return client.complete(prompt, MAX_TOKENS).token_ids


def test_answers_depend_on_the_whole_context(hf_pair):
    p, _ = hf_pair
    answers = {tuple(reference(p, prompt_of(100, seed, last=7))) for seed in range(4)}
    assert len(answers) == 4, answers


def test_prefill_answers_a_state_slot_and_every_block(hf_pair):
    p, d = hf_pair
    prompt = prompt_of(70, seed=5)
    params = prefill(p, prompt).kv_transfer_params
    assert [len(g) for g in params["remote_block_ids"]] == [1, -(-70 // 16)]
    assert d.complete(prompt, MAX_TOKENS, kv_transfer_params=params).token_ids == reference(p, prompt)


@pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                    layout="hybrid: Mamba2 state (conv + SSM, one slot) + full attention (GraniteMoeHybrid), "
                           "NHD split, block 16 -> same",
                    path="direct (one read for both groups)", device="CPU")
@pytest.mark.parametrize("length", [2, 40, 257])
def test_tokens_equal_a_single_instance(hf_pair, length):
    p, d = hf_pair
    prompt = prompt_of(length, seed=300 + length)
    got = route_pd(p, d, prompt, MAX_TOKENS)
    want = reference(p, prompt)
    assert got.token_ids == want, first_difference(got.token_ids, want)
    assert got.cached_tokens == length - 1, got.raw   # the decode loaded the prompt, did not compute it


def test_decoder_uses_the_transferred_kv_and_state(hf_pair):
    # A and B share length and last token: a decoder that used B's own prompt would answer B
    p, d = hf_pair
    a, b = prompt_of(90, seed=21, last=5), prompt_of(90, seed=22, last=5)
    ref_a = reference(p, a)
    assert ref_a != reference(p, b)
    got = d.complete(b, MAX_TOKENS, kv_transfer_params=prefill(p, a).kv_transfer_params).token_ids
    assert got == ref_a, first_difference(got, ref_a)


def test_a_state_slot_not_held_for_the_request_is_refused(hf_pair):
    """B's blocks with A's state slot (both held): the producer refuses the read (the slot is not
    B's), typed, and nothing is loaded (policy fail: HTTP 500 naming it)."""
    p, d = hf_pair
    a, b = prompt_of(90, seed=31, last=5), prompt_of(90, seed=32, last=5)
    params_a, params_b = prefill(p, a).kv_transfer_params, prefill(p, b).kv_transfer_params
    mixed = [params_a["remote_block_ids"][0], params_b["remote_block_ids"][1]]
    with pytest.raises(RequestFailed) as failed:
        d.complete(b, MAX_TOKENS, kv_transfer_params={**params_b, "remote_block_ids": mixed})
    assert failed.value.status == 500 and "is not held for request" in str(failed.value), failed.value


def test_the_answer_depends_on_the_moved_state(granite, monkeypatch):
    """Two engines in this process, the read over real NIXL: the decode equals the single instance;
    with the arrived state replaced by zeros (the state transfer broken) it does not."""
    from kvxfer_transformers.engine import HFEngine
    from kvxfer_transformers.params import RemotePrefill
    from kvxfer_transformers.settings import ServeSettings
    from kvxfer_transformers.state import StateSlots

    settings = ServeSettings(enabled=True, transfer_timeout=30)
    side = port_run(8)
    monkeypatch.setenv("KVXFER_SIDE_CHANNEL_HOST", "127.0.0.1")
    engines = []
    try:
        for i in range(2):
            monkeypatch.setenv("KVXFER_SIDE_CHANNEL_PORT", str(side + 4 * i))
            engines.append(HFEngine.start(str(granite), settings=settings, block_size=16, num_blocks=64))
        p, d = engines
        prompt = prompt_of(90, seed=77)
        want = p.generate(prompt, MAX_TOKENS).token_ids

        def decode():
            params = p.prefill(prompt, MAX_TOKENS).kv_transfer_params
            return d.decode(prompt, MAX_TOKENS, RemotePrefill.parse(params, num_groups=2))

        got = decode()
        assert got.token_ids == want and got.loaded_tokens == len(prompt) - 1
        load = StateSlots.load
        monkeypatch.setattr(StateSlots, "load", lambda self, slot: [[x.zero_() for x in layer]
                                                                  for layer in load(self, slot)])
        assert decode().token_ids != want
    finally:
        for e in engines:
            e.close()
