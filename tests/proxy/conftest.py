"""Fixtures for the proxy tests (layer: tests): a cluster of fake instances behind a real proxy."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from kvxfer.proxy import Endpoint, ProxyConfig, create_app
from proxy_fakes import FakeInstance, ServerThread


@dataclass
class Cluster:
    prefill: list[FakeInstance]
    decode: list[FakeInstance]
    prefill_servers: list[ServerThread]
    decode_servers: list[ServerThread]
    proxy: ServerThread
    app: object
    client: httpx.Client
    _extra: list[ServerThread] = field(default_factory=list)

    def metrics_text(self) -> str:
        return self.client.get("/metrics").text


@pytest.fixture
def make_cluster():
    """``make_cluster(n_prefill=1, n_decode=1, **config_overrides) -> Cluster``; torn down after the test."""
    created: list[Cluster] = []

    def make(n_prefill: int = 1, n_decode: int = 1, **overrides) -> Cluster:
        prefill = [FakeInstance(f"P{i}", "prefill") for i in range(n_prefill)]
        decode = [FakeInstance(f"D{i}", "decode") for i in range(n_decode)]
        p_servers = [ServerThread(f).start() for f in prefill]
        d_servers = [ServerThread(f).start() for f in decode]
        settings = dict(health_interval=0.2, health_timeout=1.0, timeout=10.0,
                        abort_url_template="http://{host}:{port}/abort/{request_id}")
        settings.update(overrides)
        config = ProxyConfig(prefill=tuple(Endpoint("127.0.0.1", s.port) for s in p_servers),
                             decode=tuple(Endpoint("127.0.0.1", s.port) for s in d_servers), **settings)
        app = create_app(config)
        proxy = ServerThread(app).start()
        client = httpx.Client(base_url=proxy.url, timeout=30.0, trust_env=False)
        cluster = Cluster(prefill, decode, p_servers, d_servers, proxy, app, client)
        created.append(cluster)
        return cluster

    yield make
    for cluster in created:
        cluster.client.close()
        servers = [cluster.proxy, *cluster.prefill_servers, *cluster.decode_servers, *cluster._extra]
        for server in servers:  # stop all at once: each needs a few polls of its exit flag
            server.request_stop()
        for server in servers:
            server.join()
