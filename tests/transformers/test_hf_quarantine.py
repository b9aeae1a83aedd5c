"""Issue 24 item 2 (transformers half): a failed load's quarantined landing blocks stay out of the
pool until kvxfer reclaims them, then return; blocks of a load that failed and ended return at once.

Two Agents over ``kvxfer.testing.FakeBackend`` (real bytes) and the in-memory side channel; the
decode side's backend holds its transfers, so a read times out with its transfer not confirmed
ended: the real quarantine, not a simulated one.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvxfer import Agent, AgentConfig, BlockIdError, RequestState
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.testing import MemoryNetwork, MemoryTransport, wait_for
from kvxfer_transformers.params import RemotePrefill
from kvxfer_transformers.pool import KVPool, ModelShape
from kvxfer_transformers.settings import ServeSettings
from kvxfer_transformers.transfer import REAP_INTERVAL, LoadFailed, Transfers

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=8)
BLOCKS = 8


@pytest.fixture
def pair():
    """(producer Agent, its pool, consumer Transfers, consumer pool, consumer backend)."""
    world, network = FakeWorld(), MemoryNetwork()
    opened = []

    def agent(name: str, pool: KVPool) -> Agent:
        config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0, handshake_timeout=2.0)
        return Agent(name, pool.spec, config, backend=FakeBackend(name, world), transport=MemoryTransport(network))

    def pool(seed: int) -> KVPool:
        p = KVPool(SHAPE, num_blocks=BLOCKS, block_size=4, dtype=torch.float32, device="cpu", model="m")
        gen = torch.Generator().manual_seed(seed)
        for t in p.tensors:
            t.copy_(torch.rand(t.shape, generator=gen))
        return p

    ppool, cpool = pool(1), pool(2)
    producer = agent("prefill", ppool)
    producer.register(ppool.tensors)
    producer.listen()
    consumer = agent("decode", cpool)
    transfers = Transfers(cpool, ServeSettings(enabled=True, role="kv_consumer"), agent=consumer)
    opened += [producer, transfers]
    yield producer, ppool, transfers, cpool, consumer._backend
    for thing in reversed(opened):
        thing.close()


def _remote(producer: Agent, request_id: str, blocks: tuple[int, ...]) -> RemotePrefill:
    host, port = producer.address
    return RemotePrefill(request_id, host, port, blocks, len(blocks) * 4)


def test_quarantined_landing_blocks_return_to_the_pool_only_after_reclaimed(pair):
    producer, _, transfers, pool, backend = pair
    producer.hold("p-1", [3, 4, 5])
    backend.hold_transfers(True)               # the read is posted; its transfer never confirms an end
    with pytest.raises(LoadFailed):
        transfers.load(_remote(producer, "p-1", (3, 4, 5)), prompt_len=12, timeout=0.3)
    quarantined = transfers.quarantined
    assert len(quarantined) == 3               # 11 of 12 prompt tokens are read: 3 blocks of 4
    assert pool.free_blocks == BLOCKS - len(quarantined)
    time.sleep(3 * REAP_INTERVAL)              # the reaper ran: nothing reclaimed, nothing returned
    assert pool.free_blocks == BLOCKS - len(quarantined) and transfers.quarantined == quarantined
    producer.hold("p-2", [6])
    with pytest.raises(BlockIdError, match="quarantined"):   # kvxfer itself refuses a read into them
        transfers._agent.read(producer.address, quarantined[:1], [6], "p-2", timeout=1)
    backend.hold_transfers(False)              # the transfer ends: kvxfer reclaims the blocks
    assert wait_for(lambda: pool.free_blocks == BLOCKS)
    assert transfers.quarantined == [] and transfers._agent.status("p-1") is RequestState.RECLAIMED


def test_a_failed_load_whose_transfer_ended_returns_its_blocks_at_once(pair):
    producer, _, transfers, pool, backend = pair
    producer.hold("p-1", [3, 4, 5])
    backend.fail_next(1)                       # the transport reports FAILED: the transfer ended
    with pytest.raises(LoadFailed):
        transfers.load(_remote(producer, "p-1", (3, 4, 5)), prompt_len=12, timeout=5)
    assert transfers.quarantined == [] and pool.free_blocks == BLOCKS


@pytest.fixture
def state_pair():
    """As ``pair``, for a hybrid model with state layers (a state group and a full-attention group)."""
    from kvxfer_transformers.groups import layer_groups
    from kvxfer_transformers.state import StateShape, StateSlots

    world, network = FakeWorld(), MemoryNetwork()
    shape = ModelShape(4, 2, 8, layer_groups(["linear_attention", "full_attention"] * 2, None))

    def pool() -> KVPool:
        state = StateSlots(2, [StateShape("conv0", (6, 4), torch.float32)], num_slots=4, device="cpu")
        return KVPool(shape, num_blocks=BLOCKS, block_size=4, dtype=torch.float32, device="cpu", model="m",
                      state=state)

    ppool, cpool = pool(), pool()
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0, handshake_timeout=2.0)
    producer = Agent("prefill", ppool.cache_spec, config, backend=FakeBackend("prefill", world),
                     transport=MemoryTransport(network))
    producer.register(ppool.agent_tensors())
    producer.listen()
    consumer = Agent("decode", cpool.cache_spec, config, backend=FakeBackend("decode", world),
                     transport=MemoryTransport(network))
    transfers = Transfers(cpool, ServeSettings(enabled=True, role="kv_consumer"), agent=consumer)
    yield producer, transfers, cpool, consumer._backend
    transfers.close()
    producer.close()


def _state_remote(producer: Agent, request_id: str, slot: int, blocks: tuple[int, ...]) -> RemotePrefill:
    host, port = producer.address
    return RemotePrefill(request_id, host, port, blocks, len(blocks) * 4, groups=((slot,), blocks))


def test_a_hybrid_loads_quarantined_blocks_and_state_slot_return_only_after_reclaimed(state_pair):
    producer, transfers, pool, backend = state_pair
    producer.hold("p-1", [[1], [3, 4, 5]])
    backend.hold_transfers(True)
    with pytest.raises(LoadFailed):
        transfers.load(_state_remote(producer, "p-1", 1, (3, 4, 5)), prompt_len=12, timeout=0.3)
    assert len(transfers.quarantined) == 3
    assert pool.free_blocks == BLOCKS - 3 and pool.state.free_slots == 3    # the landing slot stays out too
    backend.hold_transfers(False)
    assert wait_for(lambda: pool.free_blocks == BLOCKS and pool.state.free_slots == 4)


def test_a_hybrid_load_that_ended_or_cannot_use_the_state_returns_blocks_and_slot(state_pair):
    producer, transfers, pool, backend = state_pair
    producer.hold("p-1", [[1], [3, 4, 5]])
    backend.fail_next(1)
    with pytest.raises(LoadFailed):
        transfers.load(_state_remote(producer, "p-1", 1, (3, 4, 5)), prompt_len=12, timeout=5)
    assert pool.free_blocks == BLOCKS and pool.state.free_slots == 4
    producer.hold("p-2", [[2], [6]])     # the producer's state covers 3 tokens; this prompt needs 12 - 1
    with pytest.raises(LoadFailed, match="state covers 3 tokens"):
        transfers.load(_state_remote(producer, "p-2", 2, (6,)), prompt_len=12, timeout=5)
    assert pool.free_blocks == BLOCKS and pool.state.free_slots == 4
