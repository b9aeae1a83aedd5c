"""``transfer_path="auto"`` on host memory across two "hosts" (network namespaces, UCX over TCP).

Both agents keep the default ``auto``. A read of thousands of tiny pieces (2 KiB per layer x
block) from a producer on another network stack takes the staged path, which packs them into
a few large transfers; a short read of the same pieces, and the same large read between two
agents of one namespace, stay direct. Every read is byte-exact. The rule and its measurements:
``kvxfer.engine.paths.choose``, docs/benchmarks.md ("Two hosts").
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer import KVSpec
from kvxfer.bench.hosts import HostsUnavailableError, two_hosts
from kvxfer.engine.paths.choose import HOST_MANY_DESCRIPTORS
from kvxfer.testing import ProducerProcess, expected_read, logical_kv, run_reporting, serve_commands

# 1 KV head x 64 dim bf16 x 16 tokens: 2 KiB per layer x K/V x block; 4 layers x K/V = 8 pieces a block
SPEC = dict(num_layers=4, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=1200, dtype="bfloat16")
PORT = 47321
MANY = HOST_MANY_DESCRIPTORS // 8          # blocks: exactly the rule's descriptor count, fragmented
P_IDS = {"many": list(range(0, 2 * MANY, 2)), "few": list(range(1, 2 * 64, 2))}
C_IDS = {"many": list(range(1, 2 * MANY, 2)), "few": list(range(2 * MANY, 2 * MANY + 128, 2))}


def _cache(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _config(host: str, port: int):
    from kvxfer import AgentConfig

    # transfer_path stays "auto"; small slots keep the staging areas small
    return AgentConfig(side_channel_host=host, side_channel_port=port, handshake_timeout=30.0,
                       pipeline_slot_bytes=1 << 20, pipeline_slots=4)


def _producer(cmd, out, host, holds, env) -> None:
    if host is not None:
        host.enter()
    os.environ.update(env)
    from kvxfer import Agent

    spec = KVSpec(**SPEC)
    with Agent("auto-producer", spec, _config(host.address if host else "127.0.0.1", PORT)) as agent:
        agent.register(_cache(spec, 1))
        agent.listen()
        serve_commands(agent, holds, cmd, out, timeout=120)


def _consumer(out, host, producer_address: str, env) -> None:
    try:
        if host is not None:
            host.enter()
        os.environ.update(env)
        from kvxfer import Agent

        spec = KVSpec(**SPEC)
        cache = _cache(spec, 7)
        before = [t.copy() for t in cache]
        report = {}
        with Agent("auto-consumer", spec, _config(host.address if host else "127.0.0.1", PORT + 10)) as agent:
            agent.register(cache)
            for rid in ("many", "few"):
                stats = agent.read((producer_address, PORT), C_IDS[rid], P_IDS[rid], rid).wait(120)
                want = expected_read(spec, before, C_IDS[rid], [(spec, _cache(spec, 1))], P_IDS[rid])
                report[rid] = {"mode": str(stats.mode), "exact": bool(np.array_equal(
                    logical_kv(spec, cache, C_IDS[rid]), want)), "changed": not np.array_equal(
                    logical_kv(spec, before, C_IDS[rid]), want)}
        out.put(("ok", report))
    except BaseException as exc:  # report it to the test instead of hanging it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def _run(producer_host, consumer_host, env) -> dict:
    producer = ProducerProcess(_producer, producer_host, P_IDS, env)
    address = producer_host.address if producer_host else "127.0.0.1"
    try:
        tag, report = run_reporting(_consumer, consumer_host, address, env, timeout=240)
    finally:
        producer.stop()
    assert tag == "ok", report
    for rid, got in report.items():
        assert got["changed"] and got["exact"], (rid, got)
    return report


def test_auto_stages_many_tiny_pieces_from_another_host_and_reads_few_directly():
    try:
        with two_hosts() as (producer_host, consumer_host):
            report = _run(producer_host, consumer_host, {"UCX_TLS": "tcp"})
    except HostsUnavailableError as exc:
        pytest.skip(str(exc))
    assert report["many"]["mode"] == "staged", report
    assert report["few"]["mode"] == "direct", report


def test_auto_reads_the_same_pieces_directly_within_one_host():
    report = _run(None, None, {})
    assert report["many"]["mode"] == "direct" and report["few"]["mode"] == "direct", report
