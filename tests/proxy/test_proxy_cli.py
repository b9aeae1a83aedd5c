"""Flags, configuration errors and the real ``python -m kvxfer.proxy`` process (layer: tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from kvxfer.errors import ConfigError
from kvxfer.proxy.cli import main
from kvxfer.proxy.config import Endpoint, ProxyConfig, pair_endpoints, parse_args
from proxy_fakes import FakeInstance, ServerThread, free_port, wait_until


def test_toy_proxy_flags_parse_to_endpoints():
    cfg = parse_args(["--port", "8192", "--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports", "8000",
                      "--decoder-hosts", "10.0.0.3", "10.0.0.4", "--decoder-ports", "8000", "8001"])
    assert cfg.port == 8192 and cfg.host == "127.0.0.1"
    assert cfg.prefill == (Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000))
    assert cfg.decode == (Endpoint("10.0.0.3", 8000), Endpoint("10.0.0.4", 8001))
    assert cfg.abort_url_template is None


def test_defaults_match_the_seed_single_host_example():
    cfg = parse_args([])
    assert cfg.prefill == (Endpoint("localhost", 8100),) and cfg.decode == (Endpoint("localhost", 8200),)


def test_port_count_mismatch_is_a_clear_error(capsys):
    with pytest.raises(ConfigError, match="expected 1 or 3 ports; got 2"):
        pair_endpoints("decoder", ["a", "b", "c"], [1, 2])
    assert main(["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "3"]) == 2
    assert "--prefiller-ports must give one port for all hosts or one per host" in capsys.readouterr().err


@pytest.mark.parametrize("template, fragment", [
    ("http://{host}:{port}/abort/{rid}", r"unknown \['rid'\]"),
    ("{host}:{port}/abort", "must start with http"),
    ("http://{host", "malformed"),
])
def test_bad_abort_template_is_rejected(template, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ProxyConfig(prefill=(Endpoint("a", 1),), decode=(Endpoint("b", 2),), abort_url_template=template)


def test_bad_values_are_rejected(capsys):
    with pytest.raises(ConfigError, match="health_interval must be > 0"):
        ProxyConfig(prefill=(Endpoint("a", 1),), decode=(Endpoint("b", 2),), health_interval=0)
    assert main(["--decoder-ports", "70000"]) == 2
    assert main(["--port", "nope"]) == 2
    assert main(["--help"]) == 0
    assert "--abort-url-template" in capsys.readouterr().out


def test_cli_process_serves_and_exits_cleanly_on_sigterm():
    p_fake, d_fake = FakeInstance("P0", "prefill"), FakeInstance("D0", "decode")
    servers = [ServerThread(p_fake).start(), ServerThread(d_fake).start()]
    port = free_port()
    argv = [sys.executable, "-m", "kvxfer.proxy", "--port", str(port), "--prefiller-hosts", "127.0.0.1",
            "--prefiller-ports", str(servers[0].port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
            str(servers[1].port), "--health-interval", "0.5", "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "NO_PROXY": "*"})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as client:
            def up() -> bool:
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    assert proc.poll() is None, proc.stdout.read().decode()
                    return False
            wait_until(up, timeout=30, what="the proxy process to serve")
            r = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "cli-1"})
            assert r.status_code == 200 and r.json()["request_id"] == "cli-1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for s in servers:
            s.stop()
    assert [x.request_id for x in p_fake.received] == [x.request_id for x in d_fake.received] == ["cli-1"]


def test_port_in_use_returns_1():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--port", str(port), "--health-interval", "60", "--log-level", "critical"]) == 1
