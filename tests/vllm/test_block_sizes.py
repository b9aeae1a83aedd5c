"""A vLLM decode whose producer has other blocks: which tokens it loads and which blocks it pairs
(adapters/vllm/extent.py), without servers. The real-vLLM end to end is
tests/transformers/test_cross_block_sizes.py."""

from __future__ import annotations

import pytest

from kvxfer_vllm.extent import load_blocks, tokens_to_load
from kvxfer_vllm.params import RemotePrefill, producer_answer


def _blocks(tokens, size):
    return -(-tokens // size)


@pytest.mark.parametrize("computed, available, local, remote, want", [
    (0, 600, 32, 32, 600),     # same blocks: every token, partial last block included
    (0, 600, 32, None, 600),   # producer did not say its block size: taken as ours
    (0, 600, 128, 16, 512),    # 4 whole units; the last 88 tokens are computed here
    (0, 120, 128, 16, 120),    # the partial blocks cover 128 tokens on both sides: all moved
    (0, 3, 128, 16, 0),        # 1 producer block cannot fill a 128-token block
    (0, 600, 32, 128, 512),
    (0, 100, 32, 128, 100),    # 4 local blocks = 1 producer block
    (128, 600, 32, 128, 384),  # local prefix of 128 tokens: the rest, in whole units
    (32, 600, 32, 128, 0),     # prefix ends inside a producer block: nothing pairs
    (0, 600, 48, 32, 0),       # not multiples of one another: the SDK cannot pair them
    (640, 600, 128, 16, 0),    # the prefix cache already has it all
])
def test_tokens_to_load(computed, available, local, remote, want):
    size = remote or local
    assert tokens_to_load(computed=computed, available=available, local_block=local, remote_block=size
                          if remote else None, remote_blocks=_blocks(available, size)) == want


@pytest.mark.parametrize("local, remote", [(128, 16), (16, 128), (32, 128), (128, 32), (32, 32), (64, 16)])
def test_every_load_pairs_equal_tokens_and_leaves_less_than_a_unit(local, remote):
    for available in range(1, 700):
        for computed in range(0, available, local):
            count = tokens_to_load(computed=computed, available=available, local_block=local,
                                   remote_block=remote, remote_blocks=_blocks(available, remote))
            if not count:
                continue
            fresh = tuple(range(1000, 1000 + _blocks(computed + count, local) - computed // local))
            ids = tuple(range(_blocks(available, remote)))
            got = load_blocks(computed=computed, count=count, fresh=fresh, remote_ids=ids,
                              local_block=local, remote_block=remote)
            assert len(got.local) * local == len(got.remote) * remote, (available, computed, count)
            assert got.local == fresh[:len(got.local)]
            assert got.remote[0] * remote == computed           # starts at the first token to load
            assert len(got.local) * local >= count              # covers every loaded token
            assert available - computed - count < max(local, remote)


def test_the_producers_block_size_travels_in_its_answer():
    answer = producer_answer(request_id="r", block_ids=(1, 2), engine_id="e", host="h", port=7,
                             tp_size=1, num_tokens=20, block_size=16)
    assert answer["remote_block_size"] == 16 and RemotePrefill.parse(answer).block_size == 16
    del answer["remote_block_size"]
    assert RemotePrefill.parse(answer).block_size is None
