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
    (0, 600, 128, 16, 600),    # 4 whole units and a partial one: every token (num_tokens)
    (0, 120, 128, 16, 120),    # the partial blocks cover 128 tokens on both sides: all moved
    (0, 3, 128, 16, 3),        # under one block on both sides: moved too
    (0, 600, 32, 128, 600),
    (0, 100, 32, 128, 100),    # 4 local blocks = 1 producer block
    (128, 600, 32, 128, 472),  # local prefix of 128 tokens: the rest
    (32, 600, 32, 128, 0),     # prefix ends inside a producer block: nothing pairs
    (0, 600, 48, 32, 0),       # not multiples of one another: the SDK cannot pair them
    (640, 600, 128, 16, 0),    # the prefix cache already has it all
])
def test_tokens_to_load(computed, available, local, remote, want):
    size = remote or local
    assert tokens_to_load(computed=computed, available=available, local_block=local, remote_block=size
                          if remote else None, remote_blocks=_blocks(available, size)) == want


@pytest.mark.parametrize("computed, available, local, remote, want", [
    (0, 600, 32, 32, 600),     # same blocks: every token
    (0, 600, 128, 16, 512),    # 4 whole units; the last 88 tokens are computed here
    (0, 120, 128, 16, 120),    # the partial blocks cover 128 tokens on both sides: all moved
    (0, 3, 128, 16, 0),        # 1 producer block cannot fill a 128-token block
    (128, 600, 32, 128, 384),  # local prefix of 128 tokens: the rest, in whole units
])
def test_a_gpu_cache_loads_whole_units(computed, available, local, remote, want):
    """``partial=False`` (the decode's cache on a GPU): whole units of the larger block size."""
    assert tokens_to_load(computed=computed, available=available, local_block=local, remote_block=remote,
                          remote_blocks=_blocks(available, remote), partial=False) == want
    if want:
        got = load_blocks(computed=computed, count=want, fresh=tuple(range(100, 100 + _blocks(want, local))),
                          remote_ids=tuple(range(_blocks(available, remote))), local_block=local,
                          remote_block=remote)
        assert len(got.local) * local == len(got.remote) * remote and got.num_tokens is None


@pytest.mark.parametrize("local, remote", [(128, 16), (16, 128), (32, 128), (128, 32), (32, 32), (64, 16)])
def test_every_load_moves_every_token_after_the_prefix(local, remote):
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
            assert count == available - computed                # no recompute tail
            assert len(got.local) == _blocks(count, local) and len(got.remote) == _blocks(count, remote)
            assert got.local == fresh[:len(got.local)]
            assert got.remote[0] * remote == computed           # starts at the first token to load
            same = len(got.local) * local == len(got.remote) * remote
            assert got.num_tokens == (None if same else count), (available, computed, count)


def test_the_producers_block_size_travels_in_its_answer():
    answer = producer_answer(request_id="r", block_ids=(1, 2), engine_id="e", host="h", port=7,
                             tp_size=1, num_tokens=20, block_size=16)
    assert answer["remote_block_size"] == 16 and RemotePrefill.parse(answer).block_size == 16
    del answer["remote_block_size"]
    assert RemotePrefill.parse(answer).block_size is None


# ---- the chosen blocks, moved by real Agents: TP 2 producer with blocks of 16 -> vLLM CPU, blocks of 128 ----

@pytest.mark.parametrize("prompt", [3, 100, 120, 300, 600])
def test_tp2_small_blocks_into_vllm_cpu_large_blocks_move_exactly_the_chosen_tokens(prompt):
    import numpy as np
    import torch

    from kvxfer import Agent, AgentConfig, KVSpec
    from kvxfer.layout.oracle import Arena, logical_kv as oracle_kv
    from kvxfer.testing import FakeBackend, FakeWorld, MemoryNetwork, MemoryTransport, logical_kv
    from kvxfer_vllm.cache import describe_cache

    layers, heads, dim, small, big, n = 2, 2, 64, 16, 128, 8
    world, network = FakeWorld(), MemoryNetwork()

    def agent(name, spec, tensors, port):
        a = Agent(name, spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port),
                  backend=FakeBackend(name, world), transport=MemoryTransport(network))
        a.register(tensors)
        a.listen()
        return a

    remote_ids = tuple(range(63, 63 - _blocks(prompt, small), -1))   # the producer's blocks, backwards
    rng = np.random.default_rng(prompt)
    agents, p_specs, p_caches = [], [], []
    try:
        for r in range(2):  # kvxfer-hf-like producer ranks: NHD split, blocks of 16
            spec = KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=small, num_blocks=64,
                          dtype="float32", layout="NHD", storage="split", tp_rank=r, tp_size=2, model="m")
            cache = [rng.standard_normal(s).astype(np.float32) for s in spec.tensor_shapes()]
            agents.append(agent(f"p{r}", spec, cache, 7600))
            agents[-1].hold("req", list(remote_ids))
            p_specs.append(spec)
            p_caches.append(cache)
        whole = torch.zeros(layers, n, heads, big, 2 * dim)    # vLLM CPU backend, one allocation
        desc = describe_cache([whole[i] for i in range(layers)], num_blocks=n, block_size=big, num_kv_heads=heads,
                              head_size=dim, tp_rank=0, tp_size=1, model="m", cpu_isa="vec")
        consumer = agent("d", desc.spec, desc.tensors, 7650)
        agents.append(consumer)

        count = tokens_to_load(computed=0, available=prompt, local_block=big, remote_block=small,
                               remote_blocks=len(remote_ids))
        assert count == prompt   # every prompt token, partial last blocks included
        fresh = (5, 2, 7, 0, 6)[:_blocks(prompt, big)]
        got = load_blocks(computed=0, count=count, fresh=fresh, remote_ids=remote_ids, local_block=big,
                          remote_block=small)
        consumer.read(("127.0.0.1", 7600), list(got.local), list(got.remote), "req",
                      num_tokens=got.num_tokens).wait(10)

        landed = oracle_kv(consumer.cache, Arena.wrap(whole.numpy()), list(got.local)).view("<f4")
        prompt_blocks = list(remote_ids)   # the prompt's tokens from 0, in the producer's blocks
        sent = np.concatenate([logical_kv(s, c, prompt_blocks) for s, c in zip(p_specs, p_caches)], axis=3)
        assert count and np.array_equal(landed[:, :, :count], sent[:, :, :count])
        if got.num_tokens is not None:   # lists of unequal coverage: nothing past the prompt lands
            assert not landed[:, :, count:].any()
        untouched = [b for b in range(n) if b not in got.local]
        assert not whole[:, untouched].any()
    finally:
        for a in agents:
            a.close()
