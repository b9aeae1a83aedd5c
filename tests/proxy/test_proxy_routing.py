"""Least-outstanding routing, failover and health checks (layer: tests)."""

from __future__ import annotations

import json
import socket

import pytest

from kvxfer.proxy.config import Endpoint
from kvxfer.proxy.routing import InstancePool, NoHealthyInstance
from proxy_fakes import ServerThread, metric, wait_until


def _pool(n: int) -> InstancePool:
    return InstancePool("decode", tuple(Endpoint("10.0.0.1", 8000 + i) for i in range(n)))


def test_pick_prefers_fewest_outstanding_and_rotates_ties():
    pool = _pool(3)
    a, b, c = pool.instances
    assert [pool.pick() for _ in range(4)] == [a, b, c, a]  # all idle: round-robin
    with pool.lease(a), pool.lease(a), pool.lease(b):
        assert [pool.pick() for _ in range(3)] == [c, c, c]
    assert a.outstanding == b.outstanding == 0


def test_pick_skips_unhealthy_and_excluded_and_raises_when_none_left():
    pool = _pool(2)
    a, b = pool.instances
    pool.mark(a, False, "test")
    assert {pool.pick() for _ in range(3)} == {b}
    with pytest.raises(NoHealthyInstance, match="no healthy decode instance"):
        pool.pick(exclude={b})
    pool.mark(a, True)
    assert pool.pick(exclude={b}) is a


def test_busy_decoder_gets_no_new_requests_unlike_round_robin(make_cluster):
    c = make_cluster(n_decode=2)
    c.decode[0].mode = "slow_stream"
    c.decode[1].mode = "slow_stream"
    data = json.dumps({"prompt": "x", "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", c.proxy.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: long\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    wait_until(lambda: sum(len(d.received) for d in c.decode) == 1, what="the long stream to reach a decoder")
    busy, idle = c.decode if c.decode[0].received else c.decode[::-1]
    idle.mode = "ok"
    for i in range(4):  # round-robin would send two of these to the busy decoder
        assert c.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(busy.received) == 1 and len(idle.received) == 4
    sock.close()
    wait_until(lambda: busy.hung_up.get("long") == "disconnected", what="the long stream to be closed")


def test_refused_connection_fails_over_to_another_instance(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=2, health_interval=60.0)  # no probe will help here
    c.prefill_servers[0].stop()
    c.decode_servers[0].stop()
    for i in range(4):
        r = c.client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": f"f{i}"})
        assert r.status_code == 200, r.text
    assert [x.request_id for x in c.prefill[1].received] == ["f0", "f1", "f2", "f3"]
    assert [x.request_id for x in c.decode[1].received] == ["f0", "f1", "f2", "f3"]
    text = c.metrics_text()
    assert metric(text, "kvxfer_proxy_upstream_retries_total", role="prefill") == 1  # then it is out of the pool
    assert metric(text, "kvxfer_proxy_upstream_retries_total", role="decode") == 1
    assert c.prefill[0].aborts == c.prefill[1].aborts == []  # nothing was stranded


def test_health_checks_take_a_dead_instance_out_and_bring_it_back(make_cluster):
    c = make_cluster(n_decode=2, health_interval=0.1)
    dead_port = c.decode_servers[1].port
    label = f"127.0.0.1:{dead_port}"

    def healthy() -> float:
        return metric(c.metrics_text(), "kvxfer_proxy_instance_healthy", role="decode", instance=label)

    c.decode_servers[1].stop()
    wait_until(lambda: healthy() == 0, what="the dead decoder to leave the pool")
    for _ in range(3):
        assert c.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(c.decode[0].received) == 3 and c.decode[1].received == []
    entry = [d for d in c.client.get("/health").json()["decode"] if d["instance"] == label][0]
    assert entry["healthy"] is False and "health probe failed" in entry["last_error"]

    revived = ServerThread(c.decode[1], port=dead_port).start()  # same instance restarts on its port
    c._extra.append(revived)
    wait_until(lambda: healthy() == 1, what="the revived decoder to rejoin")
    for _ in range(4):
        assert c.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(c.decode[1].received) >= 1


def test_failing_health_endpoint_takes_instance_out(make_cluster):
    c = make_cluster(n_prefill=2, health_interval=0.1)
    c.prefill[0].health_ok = False
    wait_until(lambda: not c.client.get("/health").json()["prefill"][0]["healthy"], what="probe to fail")
    assert "HTTP 503" in c.client.get("/health").json()["prefill"][0]["last_error"]
    for _ in range(3):
        assert c.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert c.prefill[0].received == [] and len(c.prefill[1].received) == 3
    c.prefill[0].health_ok = True
    wait_until(lambda: c.client.get("/health").json()["prefill"][0]["healthy"], what="probe to pass")
