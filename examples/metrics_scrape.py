"""Agent metrics: both sides of a read serve Prometheus metrics; scrape them over HTTP.

Run:  python examples/metrics_scrape.py      (needs prometheus-client: pip install 'kvxfer[metrics]')
In a deployment set KVXFER_METRICS_PORT (or AgentConfig.metrics_port) and point Prometheus at
each rank's port; docs/metrics.md lists every metric.
"""

import multiprocessing as mp
import os
import time
import urllib.request

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=64,
              dtype="bfloat16", layout="NHD", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5740"))


def make_cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for shape in SPEC.tensor_shapes()]


def scrape(address, prefix: str = "kvxfer_agent_") -> dict[str, float]:
    """GET /metrics and keep the samples named ``prefix...`` (text format: ``name{labels} value``)."""
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(prefix))
    return {name: float(value) for name, value in samples}


def prefill(out, done) -> None:
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT, metrics_port=0)
    with Agent("prefill", SPEC, config) as agent:
        agent.register(make_cache(seed=1))
        agent.listen()
        agent.hold("req-7", [10, 11, 3])
        out.put(agent.metrics_address)
        done.wait(60)   # the decode side scrapes us meanwhile


def decode(prefill_metrics) -> None:
    held = scrape(prefill_metrics)
    print(f"prefill before the read: kvxfer_agent_held_requests={held['kvxfer_agent_held_requests']:.0f} "
          f"kvxfer_agent_held_blocks={held['kvxfer_agent_held_blocks']:.0f}")
    assert held["kvxfer_agent_held_blocks"] == 3
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 1, metrics_port=0)
    with Agent("decode", SPEC, config) as agent:
        agent.register(make_cache(seed=2))
        stats = agent.read(("127.0.0.1", PORT), [0, 1, 2], [10, 11, 3], "req-7", timeout=30).wait()
        ok = 'kvxfer_agent_transfers_total{direction="read",outcome="ok",path="direct"}'
        moved = 'kvxfer_agent_transfer_bytes_total{direction="read",path="direct"}'
        for _ in range(500):   # the counters move on the completing thread, just after wait() returns
            got = scrape(agent.metrics_address)
            if got[ok] == 1:
                break
            time.sleep(0.01)
        print(f"decode after the read: {ok} {got[ok]:.0f}\n  {moved} {got[moved]:.0f}")
        assert got[ok] == 1 and got[moved] == stats.num_bytes


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=prefill, args=(out, done))
    p.start()
    try:
        decode(out.get(timeout=120))
    finally:
        done.set()
        p.join(30)
    raise SystemExit(p.exitcode)
