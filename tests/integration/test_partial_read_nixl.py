"""Reads of ``num_tokens`` tokens whose last blocks are partial (issue 37), over real NIXL (UCX) between
real processes: exactly the first tokens move, nothing past them in the consumer's last block."""

import numpy as np
import pytest

from kvxfer import BlockIdError, KVSpec, ReadRequest

from nixl_peers import Producer, cache_for, free_port_block
from test_agent_nixl import consumer, poll

COMMON = dict(num_layers=2, num_kv_heads=4, head_dim=16, num_blocks=24, dtype="bfloat16", model="ptest")


def tokens(t: np.ndarray, spec: KVSpec, ids) -> np.ndarray:
    """``[kv, tokens, heads, dim]`` of the given blocks of one layer's tensor, token order."""
    x = t[:, ids]
    if spec.layout.value == "HND":
        x = x.transpose(0, 1, 3, 2, 4)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def test_partial_read_small_to_large_blocks_moves_exactly_the_tokens(producers):
    """Producer blocks of 4 (NHD), consumer blocks of 16 (HND): 21 tokens = 6 producer blocks (the
    last holds 1 token) into 2 consumer blocks (the last holds 5); tokens 21..31 stay as they were."""
    port = free_port_block()
    pspec = KVSpec(**COMMON, block_size=4, layout="NHD")
    src_ids = [9, 2, 3, 4, 17, 6]
    prod = Producer(pspec, seed=1, port=port, holds={"r": src_ids})
    producers.append(prod)
    cspec = KVSpec(**COMMON, block_size=16, layout="HND")
    cons, cache = consumer(cspec)
    before = [t.copy() for t in cache]
    dst = [5, 11]
    with cons:
        cons.read(prod.address, dst, src_ids, "r", num_tokens=21).wait(30)
    src = cache_for(pspec, 1)
    for layer in range(cspec.num_layers):
        got, want, old = tokens(cache[layer], cspec, dst), tokens(src[layer], pspec, src_ids), tokens(
            before[layer], cspec, dst)
        np.testing.assert_array_equal(got[:, :21], want[:, :21])
        np.testing.assert_array_equal(got[:, 21:], old[:, 21:])
        others = [b for b in range(cspec.num_blocks) if b not in dst]
        np.testing.assert_array_equal(cache[layer][:, others], before[layer][:, others])
    assert poll(lambda: prod.ask("finished")[0], ["r"]) == ["r"]


def test_partial_read_large_to_small_blocks_tp2_to_tp1(producers):
    """Two producer ranks with blocks of 16 (HND), a consumer of blocks of 4 (NHD), 7 tokens:
    one producer block each, 2 consumer blocks (the last holds 3 of 4 tokens)."""
    port = free_port_block()
    ids = [3]
    for rank in range(2):
        spec = KVSpec(**COMMON, block_size=16, layout="HND", tp_size=2, tp_rank=rank)
        producers.append(Producer(spec, seed=10 + rank, port=port, holds={"r": ids}))
    cspec = KVSpec(**COMMON, block_size=4, layout="NHD")
    cons, cache = consumer(cspec)
    before = [t.copy() for t in cache]
    dst = [8, 1]
    with cons:
        stats = cons.read_many([ReadRequest(producers[0].address, dst, ids, "r", num_tokens=7)])[0].wait(30)
        assert stats.peers == 2
    for rank in range(2):
        pspec = KVSpec(**COMMON, block_size=16, layout="HND", tp_size=2, tp_rank=rank)
        src = cache_for(pspec, 10 + rank)
        for layer in range(cspec.num_layers):
            got = tokens(cache[layer], cspec, dst)[:, :, 2 * rank:2 * rank + 2]
            np.testing.assert_array_equal(got[:, :7], tokens(src[layer], pspec, ids)[:, :7])
            np.testing.assert_array_equal(got[:, 7:], tokens(before[layer], cspec, dst)[:, 7:, 2 * rank:2 * rank + 2])
    for p in producers:
        assert poll(lambda: p.ask("finished")[0], ["r"]) == ["r"]


def test_num_tokens_that_do_not_fit_are_typed_errors_and_change_nothing(producers):
    """The local list is checked at once, the remote one (its block size is the producer's) on the
    handle; either way no byte is written and the producer still holds the request."""
    port = free_port_block()
    pspec = KVSpec(**COMMON, block_size=4)
    prod = Producer(pspec, seed=1, port=port, holds={"r": [1, 2, 3]})
    producers.append(prod)
    cspec = KVSpec(**COMMON, block_size=8)
    cons, cache = consumer(cspec)
    before = [t.copy() for t in cache]
    with cons:
        with pytest.raises(BlockIdError, match="covers 3 blocks x 8 = 24 tokens, more than num_tokens 10"):
            cons.read(prod.address, [0, 1, 2], [1, 2, 3], "r", num_tokens=10)
        with pytest.raises(BlockIdError, match="num_tokens 20 is more than the local block list covers"):
            cons.read(prod.address, [0, 1], [1, 2, 3], "r", num_tokens=20)
        with pytest.raises(BlockIdError, match="non-negative"):
            cons.read(prod.address, [0, 1], [1, 2, 3], "r", num_tokens=-1)
        with pytest.raises(BlockIdError, match="num_tokens 13 is more than the remote block list covers: "
                                               "3 blocks x 4 = 12 tokens"):
            cons.read(prod.address, [0, 1], [1, 2, 3], "r", num_tokens=13).wait(30)
        for a, b in zip(cache, before):
            np.testing.assert_array_equal(a, b)
        assert prod.ask("holding") == ["r"]
        cons.read(prod.address, [0, 1], [1, 2, 3], "r", num_tokens=10).wait(30)
    src = cache_for(pspec, 1)
    for layer in range(cspec.num_layers):
        got = tokens(cache[layer], cspec, [0, 1])
        np.testing.assert_array_equal(got[:, :10], tokens(src[layer], pspec, [1, 2, 3])[:, :10])
        np.testing.assert_array_equal(got[:, 10:], tokens(before[layer], cspec, [0, 1])[:, 10:])
