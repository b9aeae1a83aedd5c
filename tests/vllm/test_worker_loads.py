"""The vLLM worker's loads without servers: real Agents over the byte-copying FakeBackend.

* A failed load whose blocks kvxfer quarantines is not reported to vLLM (neither as finished nor
  as failed blocks) until kvxfer reclaims them: vLLM would recompute into them, or hand them to
  another request, while bytes may still land.
* A step's loads are submitted at once: ``apply`` returns without waiting on any producer, and a
  producer that never answers delays only its own loads.
"""

from __future__ import annotations

import socket
import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import FakeBackend, FakeWorld, MemoryNetwork, MemoryTransport, free_port_block, wait_for
from kvxfer_vllm.metadata import LoadOrder, StepOrders
from kvxfer_vllm.settings import Settings
from kvxfer_vllm.worker import KvxferWorker

SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, dtype="float16", model="m")


class _Peers:
    def __init__(self) -> None:
        self.world, self.network, self.agents = FakeWorld(), MemoryNetwork(), []

    def agent(self, name: str, port: int, seed: int, zmq: bool = False, **cfg) -> tuple[Agent, list[np.ndarray]]:
        """An agent over the fake backend; ``zmq``: the real ZMQ side channel on ``port``."""
        spec = KVSpec(**SPEC)
        config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, **cfg)
        agent = Agent(name, spec, config, backend=FakeBackend(name, self.world),
                      transport=None if zmq else MemoryTransport(self.network))
        rng = np.random.default_rng(seed)
        cache = [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]
        agent.register(cache)
        agent.listen()
        self.agents.append(agent)
        return agent, cache

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def _worker(agent: Agent) -> KvxferWorker:
    worker = KvxferWorker(Settings(), tp_rank=0, tp_size=1, model="m", block_size=4, num_kv_heads=2,
                          head_size=8, mla=False, single_group=True)
    worker._agent = agent  # the test's agent over the fake backend, in place of register()
    return worker


def _collect_until(worker: KvxferWorker, pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        out = worker.collect()
        seen.append(out)
        if pred(out):
            return out, seen
        time.sleep(0.005)
    return None, seen


def test_quarantined_load_is_reported_only_once_kvxfer_reclaims_its_blocks():
    peers = _Peers()
    try:
        prod, _ = peers.agent("p", 7000, seed=1)
        cons, _ = peers.agent("d", 7001, seed=2, transfer_timeout=0.3)
        prod.hold("r", [1, 2])
        cons._backend.hold_transfers(True)  # the move stays in flight: it cannot be confirmed ended
        worker = _worker(cons)
        worker.apply(StepOrders(loads=[LoadOrder("req-1", "r", "127.0.0.1", 7000, (3, 4), (1, 2))]))
        # The read times out (0.3 s) and, its transfer not ended after the grace, fails quarantined.
        assert wait_for(lambda: cons.stats().quarantined_blocks == 2, 5), cons.stats()
        for _ in range(20):  # vLLM asks every step: nothing is reported while quarantined
            out = worker.collect()
            assert not out.recving and not out.failed_blocks, out
            time.sleep(0.01)
        cons._backend.hold_transfers(False)  # the move ends: kvxfer reclaims the blocks
        out, _ = _collect_until(worker, lambda o: "req-1" in o.recving)
        assert out is not None, "the load was never reported after its blocks were reclaimed"
        assert out.failed_blocks == {3, 4} and "req-1" in out.failed
    finally:
        peers.close()


def test_failed_load_without_quarantine_is_reported_at_once():
    """The hold-back is only for quarantined blocks: a refused claim reports in the same step
    range (its move ended, so the blocks are free)."""
    peers = _Peers()
    try:
        peers.agent("p", 7100, seed=1)
        cons, _ = peers.agent("d", 7101, seed=2)
        worker = _worker(cons)
        worker.apply(StepOrders(loads=[LoadOrder("req-1", "never-held", "127.0.0.1", 7100, (3,), (1,))]))
        out, _ = _collect_until(worker, lambda o: "req-1" in o.recving, 5)
        assert out is not None and out.failed_blocks == {3}
        assert cons.stats().quarantined_blocks == 0
    finally:
        peers.close()


def test_a_silent_producer_delays_only_its_own_loads():
    """One step with loads from two prefill instances, one of which never answers (a frozen
    process: the kernel queues the connection, nobody reads it). ``apply`` returns at once; the
    healthy instance's loads finish as fast as without the other; the silent one's fail typed
    within their timeout."""
    peers = _Peers()
    frozen = socket.socket()
    try:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # never accepted: like a SIGSTOPped process's listener
        silent_port = frozen.getsockname()[1]
        good_port = free_port_block(1)
        good, good_cache = peers.agent("good", good_port, seed=1, zmq=True)
        cons, cons_cache = peers.agent("d", free_port_block(1), seed=2, zmq=True, transfer_timeout=1.5,
                                       handshake_timeout=1.5)
        good.hold("g1", [1, 2])
        good.hold("g2", [5, 6])
        worker = _worker(cons)
        orders = StepOrders(loads=[
            LoadOrder("s1", "x1", "127.0.0.1", silent_port, (0,), (1,)),
            LoadOrder("a", "g1", "127.0.0.1", good_port, (3, 4), (1, 2)),
            LoadOrder("s2", "x2", "127.0.0.1", silent_port, (9,), (2,)),
            LoadOrder("b", "g2", "127.0.0.1", good_port, (7, 8), (5, 6)),
        ])
        started = time.monotonic()
        worker.apply(orders)
        # waiting on the silent producer would take its 1.5 s timeout; the bound leaves room for a busy host
        assert time.monotonic() - started < 0.5, "apply waited on a producer"
        done: set[str] = set()
        out, seen = _collect_until(worker, lambda o: done.update(o.recving) or {"a", "b"} <= done, 5)
        healthy = time.monotonic() - started
        assert out is not None and not ({"a", "b"} & set().union(*(o.failed for o in seen))), seen
        assert healthy < 1.0, f"healthy loads took {healthy:.2f} s (the silent producer's timeout is 1.5 s)"
        for layer in range(2):
            np.testing.assert_array_equal(cons_cache[layer][:, [3, 4, 7, 8]], good_cache[layer][:, [1, 2, 5, 6]])
        failed: set[str] = set()
        out, _ = _collect_until(worker, lambda o: failed.update(o.failed) or {"s1", "s2"} <= failed, 5)
        assert out is not None, "the silent producer's loads never failed"
        assert time.monotonic() - started < 1.5 + 0.5 + 0.5
    finally:
        frozen.close()
        peers.close()

