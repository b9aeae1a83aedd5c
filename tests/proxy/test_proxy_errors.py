"""Bad input, bad instances and timeouts: JSON errors for the client, a proxy that keeps serving
(layer: tests)."""

from __future__ import annotations

import json

import pytest

from proxy_fakes import metric, wait_until

OK_BODY = {"model": "m", "prompt": "hi", "max_tokens": 5}


def _assert_still_serving(c) -> None:
    for f in c.prefill + c.decode:
        f.mode = "ok"
    r = c.client.post("/v1/completions", json=OK_BODY)
    assert r.status_code == 200, r.text
    assert r.json()["request_id"] == r.headers["x-request-id"]


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err


@pytest.mark.parametrize("raw, reason", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"prompt": "x", "max_tokens": -3}', "'max_tokens' must be a positive integer"),
])
def test_malformed_client_body_is_400_and_reaches_no_instance(make_cluster, raw, reason):
    c = make_cluster()
    r = c.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert reason in _error(r, 400)["message"]
    assert c.prefill[0].received == [] and c.decode[0].received == []
    _assert_still_serving(c)


def test_oversized_body_is_413(make_cluster):
    c = make_cluster(max_body_bytes=1000)
    r = c.client.post("/v1/completions", json={"prompt": "x" * 2000})
    _error(r, 413)
    assert c.prefill[0].received == []
    _assert_still_serving(c)


def test_unknown_route_and_wrong_method_are_json_errors(make_cluster):
    c = make_cluster()
    assert "/v1/nope" in _error(c.client.post("/v1/nope", json={}), 404)["message"]
    _error(c.client.get("/v1/completions"), 405)
    _error(c.client.delete("/health"), 405)
    _assert_still_serving(c)


@pytest.mark.parametrize("mode, status, fragment", [
    ("garbage", 502, "non-JSON"),
    ("no_params", 502, "without a kv_transfer_params"),
    ("error500", 502, "HTTP 500"),
])
def test_bad_prefill_answers_are_502(make_cluster, mode, status, fragment):
    c = make_cluster()
    c.prefill[0].mode = mode
    r = c.client.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": f"bad-{mode}"})
    assert fragment in _error(r, status)["message"]
    assert c.decode[0].received == []
    if mode == "error500":  # the producer failed the request: it holds nothing, nothing to release
        assert c.prefill[0].aborts == []
    else:  # it answered 200: it may hold blocks no decoder will read
        wait_until(lambda: c.prefill[0].aborts == [f"bad-{mode}"], what="abort POST")
    _assert_still_serving(c)


def test_prefill_4xx_json_is_passed_through_without_decode(make_cluster):
    c = make_cluster()
    c.prefill[0].mode = "error400"
    r = c.client.post("/v1/completions", json=OK_BODY)
    assert _error(r, 400)["message"] == "bad model"
    assert c.decode[0].received == [] and c.prefill[0].aborts == []
    _assert_still_serving(c)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_is_502_and_releases_prefill_blocks(make_cluster, stream):
    c = make_cluster()
    c.decode[0].mode = "error500"
    r = c.client.post("/v1/completions", json={**OK_BODY, "stream": stream}, headers={"X-Request-Id": "d500"})
    assert "decode instance answered HTTP 500" in _error(r, 502)["message"]
    wait_until(lambda: c.prefill[0].aborts == ["d500"], what="abort POST")
    _assert_still_serving(c)


def test_decode_garbage_is_502(make_cluster):
    c = make_cluster()
    c.decode[0].mode = "garbage"
    _error(c.client.post("/v1/completions", json=OK_BODY), 502)
    _assert_still_serving(c)


def test_prefill_timeout_is_504_and_proxy_closes_the_request(make_cluster):
    c = make_cluster(timeout=0.5)
    c.prefill[0].mode = "hang"
    r = c.client.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "slow"})
    assert "timed out" in _error(r, 504)["message"]
    wait_until(lambda: c.prefill[0].hung_up.get("slow") == "disconnected", what="prefill request to be closed")
    wait_until(lambda: c.prefill[0].aborts == ["slow"], what="abort POST")
    assert c.decode[0].received == []
    _assert_still_serving(c)


def test_decode_timeout_is_504_without_release(make_cluster):
    c = make_cluster(timeout=0.5)
    c.decode[0].mode = "hang"
    r = c.client.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "dslow"})
    _error(r, 504)
    wait_until(lambda: metric(c.metrics_text(), "kvxfer_proxy_requests_total", endpoint="completions",
                              outcome="decode_error") == 1, what="outcome to be counted")
    # The decoder had the request and may have been reading: no release behind its back.
    assert metric(c.metrics_text(), "kvxfer_proxy_prefill_releases_total") == 0
    assert c.prefill[0].aborts == []
    _assert_still_serving(c)


def test_no_reachable_decode_instance_is_503_and_releases(make_cluster):
    c = make_cluster()
    c.decode_servers[0].stop()
    r = c.client.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "nod"})
    assert "no healthy decode instance" in _error(r, 503)["message"]
    wait_until(lambda: c.prefill[0].aborts == ["nod"], what="abort POST")
    text = c.metrics_text()
    assert metric(text, "kvxfer_proxy_prefill_releases_total", action="abort_posted") == 1
    wait_until(lambda: metric(c.metrics_text(), "kvxfer_proxy_abort_posts_total", result="sent") == 1, what="count")
    assert c.client.get("/health").status_code == 503


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(make_cluster):
    c = make_cluster()
    c.decode[0].mode = "drop_stream"
    r = c.client.post("/v1/completions", json={**OK_BODY, "stream": True}, headers={"X-Request-Id": "drop"})
    assert r.status_code == 200  # the status line went out with the first event
    events = [ln.removeprefix("data: ") for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert [json.loads(e).get("index") for e in events[:2]] == [0, 1]
    err = json.loads(events[-1])["error"]
    assert err["code"] == 502 and "decode instance failed" in err["message"]
    wait_until(lambda: metric(c.metrics_text(), "kvxfer_proxy_requests_total", outcome="decode_error") == 1,
               what="outcome to be counted")
    assert metric(c.metrics_text(), "kvxfer_proxy_prefill_releases_total") == 0  # the decoder had it
    _assert_still_serving(c)


def test_overlong_request_id_is_400(make_cluster):
    c = make_cluster()
    r = c.client.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "x" * 300})
    assert "X-Request-Id" in _error(r, 400)["message"]
    assert c.prefill[0].received == []
