"""`bidirectional_kv_xfer` in a real vLLM P/D pair: a conversation's second turn reads the first
turn's KV back from the decode instance that holds it, and answers as one instance alone would.

P (``kv_producer``) prefills turn 1, D (``kv_consumer``) decodes it and, with
``bidirectional_kv_xfer``, keeps the request's blocks for ``decoder_kv_blocks_ttl`` (a kvxfer hold)
and answers ``kv_transfer_params`` naming them. Turn 2 (turn 1's prompt, its answer and new
tokens) goes to P with those params: P loads the tokens D holds, computes the new ones, holds its
blocks for D as usual, and D decodes turn 2. Every answer must equal D's answer to the same
tokens without any transfer (a single instance), and P must have loaded the first turn's tokens
(its prompt-cache figure and its read log), so the answer depends on the moved KV.
"""

from __future__ import annotations

import re

import pytest

from conftest import BLOCK_SIZE, pd_servers
from vllm_harness import prompt_of, route_pd

MAX_TOKENS = 6
TTL_S = 120
BIDI = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL_S, "kv_recompute_threshold": 8,
        "transfer_timeout": 60}
#: KV bytes per token of the tiny model in float32: 4 layers x (K, V) x 2 heads x 64 x 4 bytes.
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4
READ = re.compile(r"kvxfer read (\S+): (\d+) bytes")


@pytest.fixture(scope="module")
def pair(tiny_model, vllm_logs):
    p_config = {"kv_connector": "KvxferConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                "kv_connector_extra_config": BIDI}
    d_config = {**p_config, "kv_role": "kv_consumer"}
    # P without a prefix cache: everything turn 2 does not compute must come from D
    with pd_servers("bidi", tiny_model, vllm_logs, p_config, d_config,
                    p_args=("--no-enable-prefix-caching",)) as (p, d):
        yield p, d


@pytest.mark.parametrize("first_len, new_len", [(45, 20), pytest.param(300, 37, marks=pytest.mark.slow)])
def test_the_second_turn_reads_the_first_back_from_the_decode_instance(pair, first_len, new_len):
    p, d = pair
    pc, dc = p.client(), d.client()
    reads_before = p.log_text().count("kvxfer read ")
    turn1 = prompt_of(first_len, seed=900 + first_len)
    answer1 = route_pd(pc, dc, turn1, MAX_TOKENS)
    held = answer1.kv_transfer_params
    assert held and held["do_remote_decode"] is True and held["do_remote_prefill"] is False, held
    # D computed every token but the last it generated
    assert held["remote_num_tokens"] == first_len + MAX_TOKENS - 1

    turn2 = turn1 + answer1.token_ids + prompt_of(new_len, seed=901 + first_len)
    first = pc.complete(turn2, 1, kv_transfer_params=held)          # P: reads turn 1 back, computes the rest
    assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"] is True
    answer2 = dc.complete(turn2, MAX_TOKENS, kv_transfer_params=first.kv_transfer_params)

    # P loaded the blocks of every token D computed (P keeps no prefix cache); both sides' blocks
    # are of one size, so the partial last block moves whole and P computes over its tail
    reads = READ.findall(p.log_text())[reads_before:]
    blocks = -(-held["remote_num_tokens"] // BLOCK_SIZE)
    assert [int(n) for _, n in reads] == [blocks * BLOCK_SIZE * TOKEN_BYTES], reads

    # a single instance, no transfers: D alone (its prefix cache holds only KV it computed or loaded)
    ref1 = dc.complete(turn1, MAX_TOKENS).token_ids
    ref2 = dc.complete(turn2, MAX_TOKENS).token_ids
    assert answer1.token_ids == ref1
    assert first.token_ids == ref2[:1]
    assert answer2.token_ids == ref2


def test_a_short_first_turn_under_the_threshold_is_computed_and_released(pair):
    """kv_recompute_threshold: fewer tokens than it are computed by P, and D's hold is given back."""
    p, d = pair
    pc, dc = p.client(), d.client()
    turn1 = prompt_of(3, seed=77)
    answer1 = route_pd(pc, dc, turn1, 4)
    held = answer1.kv_transfer_params
    assert held["remote_num_tokens"] == 6 < BIDI["kv_recompute_threshold"]
    reads_before = p.log_text().count("kvxfer read ")
    turn2 = turn1 + answer1.token_ids + prompt_of(5, seed=78)
    first = pc.complete(turn2, 1, kv_transfer_params=held)
    assert p.log_text().count("kvxfer read ") == reads_before
    assert first.token_ids == dc.complete(turn2, 1).token_ids
