"""Ownership on the GPU paths (marked gpu): abort during an IPC kernel or a staged pipeline leaves no
late byte; a producer's release during an IPC or staged read never frees blocks being read.

Producer in a spawned process on GPU 0 whose engine reuses freed blocks at once (``ownership_peers``);
the consumer is this process on GPU 0. docs/reliability.md lists these.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from .agent_peers import device_cache, free_port_block, host_cache, logical
from .ownership_peers import OwnerProducer

pytestmark = pytest.mark.gpu

# 4 layers x 8 heads x 128 x 16 tokens x bf16-sized: 256 KiB a block; 1,024 blocks a request (256 MiB).
BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2560, dtype="bfloat16",
           model="gpu-owner")
TRIALS = 5
N = 1024
SMALL_SLOTS = dict(pipeline_slot_bytes=4 << 20, pipeline_slots=4)


@pytest.fixture
def owner(cuda):
    from kvxfer import KVSpec

    spec = KVSpec(**BIG)
    prod = OwnerProducer(spec, 10, free_port_block(), 0, **SMALL_SLOTS)
    yield prod, spec
    prod.stop()


def _consumer(spec, path):
    import torch

    from kvxfer import Agent, AgentConfig

    torch.cuda.set_device(0)
    agent = Agent("gpu-owner-consumer", spec, AgentConfig(side_channel_host="127.0.0.1",
                                                          side_channel_port=free_port_block(1),
                                                          transfer_path=path, **SMALL_SLOTS))
    cache = device_cache(spec, 99, 0)
    torch.cuda.synchronize()
    agent.register(cache)
    return agent, cache


def _blocks(cache, ids) -> list[np.ndarray]:
    return [t[:, ids].cpu().numpy() for t in cache]  # on the default stream: does not wait for kvxfer's


def _idle(stats: dict) -> bool:
    return all(stats[k] == 0 for k in ("held_requests", "claimed_requests", "in_flight", "draining",
                                       "quarantined_blocks"))


def _wait(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
        got = fn()
    return got


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_abort_mid_transfer_leaves_no_late_byte(owner, path):
    import dataclasses

    from kvxfer import KvxferError

    prod, spec = owner
    cons, cache = _consumer(spec, path)
    rng = np.random.default_rng(5)
    with cons:
        failed = 0
        for trial in range(TRIALS):
            src = rng.permutation(spec.num_blocks)[:N].tolist()
            dst = rng.permutation(spec.num_blocks)[:N].tolist()
            rid = f"abort-{path}-{trial}"
            prod.ask(("hold", rid, src, None))
            handle = cons.read(prod.address, dst, src, rid, timeout=30)
            cons.abort(rid)
            try:
                handle.wait(35)
            except KvxferError:
                failed += 1
            first = _blocks(cache, dst)
            time.sleep(0.3)
            for a, b in zip(first, _blocks(cache, dst)):
                np.testing.assert_array_equal(a, b, err_msg=f"{path} trial {trial}: bytes landed after the read ended")
            assert _wait(lambda: _idle(dataclasses.asdict(cons.stats())), 5)
        assert _wait(lambda: _idle(prod.ask(("stats",))), 20), prod.ask(("stats",))


@pytest.mark.parametrize("path", ["ipc", "staged"])
def test_release_during_a_read_never_frees_blocks_being_read(owner, path):
    from kvxfer import KvxferError

    prod, spec = owner
    cons, cache = _consumer(spec, path)
    rng = np.random.default_rng(6)
    with cons:
        exact, reused = 0, set()
        fresh = [b for b in rng.permutation(spec.num_blocks).tolist()]
        for trial in range(TRIALS):
            # every trial reads blocks the engine has not reused yet, so their seeded bytes are the truth
            src = [b for b in fresh if b not in reused][:N // 2]
            fresh = [b for b in fresh if b not in src]
            dst = rng.permutation(spec.num_blocks)[:len(src)].tolist()
            rid = f"release-{path}-{trial}"
            want = logical(spec, host_cache(spec, 10), src)
            prod.ask(("hold", rid, src, None))
            handle = cons.read(prod.address, dst, src, rid, timeout=30)
            # read() returns before its claim is sent: release once the producer granted it
            until = time.monotonic() + 10
            while not (handle.done() or prod.ask(("stats",))["claimed_requests"] >= 1) and time.monotonic() < until:
                pass
            prod.ask(("release", rid))  # FREE_NOW when the read already ended and freed it: fine
            try:
                handle.wait(35)
            except KvxferError:
                continue  # a typed error is allowed; wrong bytes are not
            got = [t.cpu().numpy() for t in cache]
            np.testing.assert_array_equal(logical(spec, got, dst), want)
            exact += 1
            assert _wait(lambda: rid in prod.ask(("reused",)), 10)
            reused.update(src)
        assert exact >= 1
