"""Reads between two "hosts" (network namespaces joined by a veth pair) under kvxfer's UCX TCP defaults.

The producer and the consumer each run in their own namespace (10.88.0.1 / 10.88.0.2) with
``UCX_TLS=tcp``, as between machines without RDMA; the consumer sets one ``UCX_*`` variable of
its own before it creates its agent. Asserted in the consumer's process: the user's variable is
untouched and kvxfer filled the others; a direct and a staged read are byte-exact. Skipped, with
the reason, only where namespaces cannot be created (not root, no ``ip``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer import KVSpec
from kvxfer.testing import ProducerProcess, expected_read, logical_kv, run_reporting, serve_commands

SPEC = dict(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=48, dtype="bfloat16")
PORT = 47301  # inside the pair's own namespaces: no other user of the port
USER_RCVBUF = "4m"  # the consumer's own choice, which kvxfer's default (8m) must not replace
P_IDS = {"direct": [3, 40, 7, 21, 22, 23], "staged": [1, 2, 30, 31, 45, 9]}
C_IDS = [10, 4, 33, 34, 0, 47]


def _cache(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _producer(cmd, out, host, holds) -> None:
    host.enter()
    os.environ["UCX_TLS"] = "tcp"
    from kvxfer import Agent, AgentConfig

    spec = KVSpec(**SPEC)
    # transfer_path="staged" makes a host-memory producer offer staged reads (it serves direct ones too)
    config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT, handshake_timeout=30.0,
                         transfer_path="staged", pipeline_slot_bytes=64 << 10, pipeline_slots=4)
    with Agent("mh-producer", spec, config) as agent:
        agent.register(_cache(spec, 1))
        agent.listen()
        serve_commands(agent, holds, cmd, out, timeout=120)


def _consumer(out, host, producer_address: str) -> None:
    """Two reads (direct, staged), each by its own Agent; reports env and byte-exactness."""
    try:
        host.enter()
        os.environ["UCX_TLS"] = "tcp"
        os.environ["UCX_TCP_RCVBUF"] = USER_RCVBUF
        from kvxfer import Agent, AgentConfig

        spec = KVSpec(**SPEC)
        report: dict = {}
        for path in ("direct", "staged"):
            cache = _cache(spec, 7)
            before = [t.copy() for t in cache]
            config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT + 10,
                                 handshake_timeout=30.0, transfer_path=path, pipeline_slot_bytes=64 << 10,
                                 pipeline_slots=4)
            with Agent(f"mh-consumer-{path}", spec, config) as agent:
                report["env"] = {k: os.environ.get(k) for k in ("UCX_TCP_RCVBUF", "UCX_TCP_SNDBUF",
                                                                "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")}
                agent.register(cache)
                stats = agent.read((producer_address, PORT), C_IDS, P_IDS[path], path).wait(60)
            want = expected_read(spec, before, C_IDS, [(spec, _cache(spec, 1))], P_IDS[path])
            report[path] = {"mode": stats.mode, "exact": bool(np.array_equal(logical_kv(spec, cache, C_IDS), want)),
                            "changed": not np.array_equal(logical_kv(spec, before, C_IDS), want)}
        out.put(("ok", report))
    except BaseException as exc:  # report it to the test instead of hanging it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_reads_across_hosts_are_exact_and_the_users_ucx_variable_wins(hosts):
    producer_host, consumer_host = hosts
    producer = ProducerProcess(_producer, producer_host, P_IDS)
    try:
        tag, report = run_reporting(_consumer, consumer_host, producer_host.address)
    finally:
        producer.stop()
    assert tag == "ok", report
    assert report["env"] == {"UCX_TCP_RCVBUF": USER_RCVBUF, "UCX_TCP_SNDBUF": "8m",
                             "UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
    for path in ("direct", "staged"):
        assert report[path]["changed"], "the expected blocks must differ from the destination's old bytes"
        assert report[path]["mode"] == path and report[path]["exact"], (path, report[path])
