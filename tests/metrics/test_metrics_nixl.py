"""Agent metrics scraped with a real HTTP client while real transfers run: a producer process and
a consumer over real NIXL (UCX) and the real ZMQ side channel, both serving metrics."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.testing import free_port_block

from metrics_peers import MetricsProducer, cache_for
from metrics_scrape import scrape, scrape_until

# 4 layers x 8 heads x 128 dim x 16 tokens, bf16: 256 KiB per block over all layers and K/V.
SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=96,
              dtype="bfloat16", model="metrics")
BLOCKS = 4                                           # per request
REQUESTS = 24
HALF = REQUESTS // 2
REQUEST_BYTES = BLOCKS * 2 * SPEC.num_layers * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 2
TRANSFERS = "kvxfer_agent_transfers_total"


@pytest.fixture
def producer():
    holds = {f"r{i}": list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(REQUESTS)}
    prod = MetricsProducer(SPEC, seed=1, port=free_port_block(1), holds=holds)
    yield prod
    prod.stop()


def _reader(cons: Agent, address, stats: list, paused: threading.Event, resume: threading.Event,
            errors: list) -> None:
    """Read every request, pausing after the first half until the test has scraped it."""
    try:
        for i in range(REQUESTS):
            if i == HALF:
                paused.set()
                if not resume.wait(30):
                    raise TimeoutError("the test never resumed the reader")
            dst = list(range(i * BLOCKS, (i + 1) * BLOCKS))
            stats.append(cons.read(address, dst, dst, f"r{i}", timeout=30).wait(30))
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)
        paused.set()


def test_metrics_scraped_while_transfers_run(producer):
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1), metrics_port=0)
    with Agent("consumer", SPEC, config) as cons, httpx.Client() as http:
        cache = cache_for(SPEC, 99)
        cons.register(cache)
        assert cons.metrics_address[0] == "127.0.0.1"
        before = scrape(producer.metrics_address, http)
        assert before.value("kvxfer_agent_held_requests") == REQUESTS
        assert before.value("kvxfer_agent_held_blocks") == REQUESTS * BLOCKS
        assert scrape(cons.metrics_address, http).total(TRANSFERS) == 0

        stats: list = []
        errors: list = []
        paused, resume = threading.Event(), threading.Event()
        reader = threading.Thread(target=_reader, args=(cons, producer.address, stats, paused, resume, errors),
                                  daemon=True)
        reader.start()
        try:
            # First half read: the counters say exactly what the handles did.
            assert paused.wait(60) and not errors, errors
            mid = scrape_until(cons.metrics_address, lambda g: g.total(TRANSFERS) >= HALF, client=http)
            assert mid.value(TRANSFERS, direction="read", path="direct", outcome="ok") == HALF
            assert mid.total(TRANSFERS) == HALF
            assert mid.value("kvxfer_agent_transfer_bytes_total", direction="read", path="direct") == \
                sum(s.num_bytes for s in stats) == HALF * REQUEST_BYTES
            prod_mid = scrape_until(producer.metrics_address,
                                    lambda g: g.value("kvxfer_agent_held_requests") == REQUESTS - HALF,
                                    client=http)
            assert prod_mid.value("kvxfer_agent_held_requests") == REQUESTS - HALF
            assert prod_mid.value("kvxfer_agent_held_blocks") == (REQUESTS - HALF) * BLOCKS
            assert prod_mid.value("kvxfer_agent_sessions") == 1

            # Second half: scrape both agents over and over while the reads run.
            resume.set()
            seen: list[float] = []
            while True:  # at least once, however fast the reads are
                seen.append(scrape(cons.metrics_address, http).total(TRANSFERS))
                scrape(producer.metrics_address, http)
                if not reader.is_alive():
                    break
            reader.join()
        finally:
            resume.set()
            reader.join(60)
        assert not errors, errors
        assert seen == sorted(seen) and HALF <= seen[0] and seen[-1] <= REQUESTS, seen  # never back
        print(f"{len(seen)} consumer scrapes while the second half ran: {seen[0]:.0f} .. {seen[-1]:.0f}")

        end = scrape_until(cons.metrics_address, lambda g: g.total(TRANSFERS) >= REQUESTS, client=http)
        assert end.value(TRANSFERS, direction="read", path="direct", outcome="ok") == REQUESTS
        assert end.total(TRANSFERS) == REQUESTS                # no failure counted
        assert end.value("kvxfer_agent_transfer_bytes_total", direction="read", path="direct") == \
            sum(s.num_bytes for s in stats) == REQUESTS * REQUEST_BYTES
        for hist in ("kvxfer_agent_transfer_seconds", "kvxfer_agent_setup_seconds"):
            assert end.value(f"{hist}_count", direction="read", path="direct") == REQUESTS
            assert end.value(f"{hist}_sum", direction="read", path="direct") == \
                pytest.approx(sum(getattr(s, "seconds" if hist.endswith("transfer_seconds") else "setup_seconds")
                                  for s in stats))
        assert end.value("kvxfer_agent_claim_seconds_count", path="direct") == REQUESTS
        assert end.value("kvxfer_agent_claim_seconds_sum", path="direct") == \
            pytest.approx(sum(s.claim_seconds for s in stats))
        assert end.value("kvxfer_agent_in_flight_transfers") == 0

        # Every byte the counters report arrived, exactly.
        src = cache_for(SPEC, 1)
        ids = list(range(REQUESTS * BLOCKS))
        for layer in range(SPEC.num_layers):
            np.testing.assert_array_equal(cache[layer][:, ids], src[layer][:, ids])

        # The producer let every hold go once the consumer was done.
        after = scrape_until(producer.metrics_address,
                             lambda g: g.value("kvxfer_agent_held_requests") == 0, client=http)
        assert (after.value("kvxfer_agent_held_requests"), after.value("kvxfer_agent_held_blocks")) == (0, 0)
        assert after.total(TRANSFERS) == 0                     # it served reads, it moved nothing itself
