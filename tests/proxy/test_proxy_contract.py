"""The P/D contract through a real proxy and real fake instances on loopback (layer: tests)."""

from __future__ import annotations

import json

from kvxfer.proxy.pd import PREFILL_KV_TRANSFER_PARAMS
from proxy_fakes import metric, wait_until


def _sse_events(text: str) -> list:
    return [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]


def test_completion_goes_prefill_then_decode_with_prefills_params(make_cluster):
    c = make_cluster()
    original = {"model": "m", "prompt": "hello", "max_tokens": 50, "temperature": 0.0}
    r = c.client.post("/v1/completions", json=original, headers={"X-Request-Id": "req-1", "Authorization": "Bearer k"})

    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-1"
    (p,), (d,) = c.prefill[0].received, c.decode[0].received
    assert p.seq < d.seq
    assert p.path == d.path == "/v1/completions"
    assert p.request_id == d.request_id == "req-1"
    assert p.headers["authorization"] == d.headers["authorization"] == "Bearer k"
    assert p.body == {**original, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert d.body == {**original, "kv_transfer_params": c.prefill[0].answered_params["req-1"]}
    assert r.json()["kv_transfer_params"] == c.prefill[0].answered_params["req-1"]
    assert r.json()["choices"][0]["text"] == "echo req-1"


def test_chat_stream_is_passed_through_and_prefill_is_not_streamed(make_cluster):
    c = make_cluster()
    original = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30,
                "stream": True, "stream_options": {"include_usage": True}}
    r = c.client.post("/v1/chat/completions", json=original, headers={"X-Request-Id": "chat-1"})

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2"]
    (p,), (d,) = c.prefill[0].received, c.decode[0].received
    assert p.body == {"model": "m", "messages": original["messages"], "max_tokens": 1, "max_completion_tokens": 1,
                      "stream": False, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert d.body == {**original, "kv_transfer_params": c.prefill[0].answered_params["chat-1"]}
    assert d.request_id == "chat-1"


def test_missing_request_id_is_generated_and_sent_to_both(make_cluster):
    c = make_cluster()
    r = c.client.post("/v1/completions", json={"model": "m", "prompt": "x"})

    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid.startswith("kvxfer-") and len(rid) > len("kvxfer-")
    assert c.prefill[0].received[0].request_id == rid
    assert c.decode[0].received[0].request_id == rid
    assert r.json()["request_id"] == rid


def test_client_kv_transfer_params_are_replaced(make_cluster):
    c = make_cluster()
    forged = {"do_remote_prefill": True, "remote_block_ids": [666]}
    r = c.client.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": forged},
                      headers={"X-Request-Id": "r"})

    assert r.status_code == 200
    assert c.prefill[0].received[0].body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert c.decode[0].received[0].body["kv_transfer_params"] == c.prefill[0].answered_params["r"]


def test_models_health_and_metrics(make_cluster):
    c = make_cluster()
    assert c.client.get("/v1/models").json()["data"][0]["owned_by"] == "D0"
    health = c.client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert [i["healthy"] for i in health.json()["prefill"] + health.json()["decode"]] == [True, True]

    c.client.post("/v1/completions", json={"prompt": "x"})
    c.client.post("/v1/chat/completions", json={"messages": []})
    # The outcome is counted just after the last byte goes out, so the client may be faster.
    wait_until(lambda: metric(c.metrics_text(), "kvxfer_proxy_requests_total", endpoint="chat_completions",
                              outcome="ok") == 1, what="chat outcome to be counted")
    text = c.metrics_text()
    assert metric(text, "kvxfer_proxy_requests_total", endpoint="completions", outcome="ok") == 1
    assert metric(text, "kvxfer_proxy_stage_seconds_count", stage="prefill") == 2
    assert metric(text, "kvxfer_proxy_stage_seconds_count", stage="decode") == 2
    port = c.decode_servers[0].port
    assert metric(text, "kvxfer_proxy_instance_healthy", role="decode", instance=f"127.0.0.1:{port}") == 1
    assert metric(text, "kvxfer_proxy_instance_in_flight", role="decode", instance=f"127.0.0.1:{port}") == 0
