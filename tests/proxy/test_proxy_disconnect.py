"""A client that hangs up: upstream requests are closed and stranded prefill blocks released
(layer: tests). The client is a raw socket so the hang-up happens exactly where the test says."""

from __future__ import annotations

import json
import socket

from proxy_fakes import metric, wait_until


def _open_request(port: int, path: str, body: dict, request_id: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _counted(c, outcome: str, n: int = 1) -> bool:
    return metric(c.metrics_text(), "kvxfer_proxy_requests_total", outcome=outcome) == n


def test_hangup_during_prefill_closes_prefill_and_asks_it_to_release(make_cluster):
    c = make_cluster()
    c.prefill[0].mode = "hang"
    sock = _open_request(c.proxy.port, "/v1/completions", {"prompt": "x", "max_tokens": 9}, "gone-early")
    wait_until(lambda: len(c.prefill[0].received) == 1, what="prefill to receive the request")
    sock.close()

    wait_until(lambda: c.prefill[0].hung_up.get("gone-early") == "disconnected", what="prefill request closed")
    wait_until(lambda: c.prefill[0].aborts == ["gone-early"], what="abort POST to the prefill instance")
    wait_until(lambda: _counted(c, "client_disconnect"), what="outcome to be counted")
    assert c.decode[0].received == []
    assert metric(c.metrics_text(), "kvxfer_proxy_instance_in_flight") == 0


def test_hangup_during_decode_stream_closes_decode_without_release(make_cluster):
    c = make_cluster()
    c.decode[0].mode = "slow_stream"
    body = {"prompt": "x", "max_tokens": 400, "stream": True}
    sock = _open_request(c.proxy.port, "/v1/completions", body, "gone-late")
    seen = b""
    while b"data: " not in seen:  # the stream has started reaching the client
        chunk = sock.recv(4096)
        assert chunk, "proxy closed the connection before streaming"
        seen += chunk
    sock.close()

    wait_until(lambda: c.decode[0].hung_up.get("gone-late") == "disconnected", what="decode stream closed")
    assert c.decode[0].events_sent["gone-late"] < 400
    wait_until(lambda: _counted(c, "client_disconnect"), what="outcome to be counted")
    # The decoder held the request and may have read the blocks: the proxy must not release them.
    assert metric(c.metrics_text(), "kvxfer_proxy_prefill_releases_total") == 0
    assert c.prefill[0].aborts == []
    assert metric(c.metrics_text(), "kvxfer_proxy_instance_in_flight") == 0


def test_hangup_without_abort_template_only_logs(make_cluster, caplog):
    c = make_cluster(abort_url_template=None)
    c.prefill[0].mode = "hang"
    with caplog.at_level("WARNING", logger="kvxfer.proxy"):
        sock = _open_request(c.proxy.port, "/v1/chat/completions", {"messages": []}, "no-template")
        wait_until(lambda: len(c.prefill[0].received) == 1, what="prefill to receive the request")
        sock.close()
        wait_until(lambda: _counted(c, "client_disconnect"), what="outcome to be counted")
    assert metric(c.metrics_text(), "kvxfer_proxy_prefill_releases_total", action="logged_only") == 1
    assert c.prefill[0].aborts == []
    assert any("no-template" in r.getMessage() and "lease timeout" in r.getMessage() for r in caplog.records)
