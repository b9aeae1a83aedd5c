"""Bounded load test on loopback: 200 requests at concurrency 16 through the proxy, none lost or
duplicated, each one prefill-then-decode with the params its prefill instance returned (layer: tests)."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx

from proxy_fakes import metric, wait_until

N_REQUESTS = 200
CONCURRENCY = 16


async def _one(client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> tuple[str, list[dict]]:
    """Send request ``i``; return its id and the decode echoes that came back (one, or one per SSE event)."""
    rid = f"load-{i:03d}"
    stream = i % 2 == 1
    if i % 4 < 2:
        path, body = "/v1/completions", {"model": "m", "prompt": f"p{i}", "max_tokens": 8, "stream": stream}
    else:
        path, body = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"p{i}"}],
                                              "max_completion_tokens": 8, "stream": stream}
    async with sem:
        r = await client.post(path, json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    if not stream:
        return rid, [r.json()]
    lines = [ln.removeprefix("data: ") for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return rid, [json.loads(ln) for ln in lines[:-1]]


async def _run(base_url: str) -> list[tuple[str, list[dict]]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits, trust_env=False) as client:
        return await asyncio.gather(*(_one(client, sem, i) for i in range(N_REQUESTS)))


def test_200_requests_at_concurrency_16_nothing_lost_or_duplicated(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=2)
    results = asyncio.run(_run(c.proxy.url))

    # Every id came back exactly once, and only in its own answer.
    expected = {f"load-{i:03d}" for i in range(N_REQUESTS)}
    returned = collections.Counter(rid for rid, _ in results)
    assert set(returned) == expected and set(returned.values()) == {1}
    for rid, echoes in results:
        assert echoes and {e["request_id"] for e in echoes} == {rid}

    prefill_seen = [x for p in c.prefill for x in p.received]
    decode_seen = [x for d in c.decode for x in d.received]
    assert sorted(x.request_id for x in prefill_seen) == sorted(expected)  # once each at prefill
    assert sorted(x.request_id for x in decode_seen) == sorted(expected)  # once each at decode
    prefill_by_id = {x.request_id: x for x in prefill_seen}
    params_by_id = {rid: params for p in c.prefill for rid, params in p.answered_params.items()}
    for d in decode_seen:
        p = prefill_by_id[d.request_id]
        assert p.seq < d.seq, f"{d.request_id} reached decode before prefill"
        assert p.body["max_tokens"] == 1 and p.body["stream"] is False
        assert d.body["kv_transfer_params"] == params_by_id[d.request_id]
        assert d.body["kv_transfer_params"]["remote_engine_id"] == f"engine-{p.instance}"
    for rid, echoes in results:  # the client saw the params of its own prefill
        assert all(e["kv_transfer_params"] == params_by_id[rid] for e in echoes)

    # Both instances of each role took a real share of the load.
    for fakes in (c.prefill, c.decode):
        assert all(len(f.received) >= N_REQUESTS // 4 for f in fakes), [len(f.received) for f in fakes]
    wait_until(lambda: metric(c.metrics_text(), "kvxfer_proxy_requests_total", outcome="ok") == N_REQUESTS,
               what="all outcomes to be counted")
    text = c.metrics_text()
    assert metric(text, "kvxfer_proxy_instance_in_flight") == 0
    assert metric(text, "kvxfer_proxy_prefill_releases_total") == 0
