"""Prometheus metrics of the proxy (layer: proxy app; imports prometheus_client, nothing from kvxfer).

Each ``ProxyMetrics`` owns its own ``CollectorRegistry`` so several apps (tests, embedding) can
live in one process without colliding in the global registry.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvxfer.proxy.routing import Instance

__all__ = ["CONTENT_TYPE_LATEST", "OUTCOMES", "ProxyMetrics"]

# Every value the ``outcome`` label of kvxfer_proxy_requests_total can take.
OUTCOMES = (
    "ok",  # the decode answer reached the client (streams: ended normally)
    "bad_request",  # malformed client input, rejected before any upstream call
    "prefill_error",  # prefill instance refused, failed, timed out or answered garbage
    "decode_error",  # decode instance refused, failed, timed out or answered garbage
    "no_instance",  # no healthy instance of a needed role
    "upstream_rejected",  # an instance answered 4xx; its JSON error was passed to the client
    "client_disconnect",  # the client went away; upstream work was cancelled
    "internal_error",  # a bug in the proxy; the client got HTTP 500
)

_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    """The proxy's metric families, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvxfer_proxy_requests", "Client requests by endpoint and outcome.", ["endpoint", "outcome"], registry=r
        )
        self.in_flight = Gauge(
            "kvxfer_proxy_instance_in_flight", "Requests in flight per upstream instance.", ["role", "instance"], registry=r
        )
        self.healthy = Gauge(
            "kvxfer_proxy_instance_healthy", "1 if the instance is in the pool, else 0.", ["role", "instance"], registry=r
        )
        self.stage_seconds = Histogram(
            "kvxfer_proxy_stage_seconds",
            "Seconds per stage: prefill (request to JSON answer), decode (request to last byte).",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.releases = Counter(
            "kvxfer_proxy_prefill_releases",
            "Requests whose prefill blocks no decoder would read, by action (abort_posted, logged_only).",
            ["action"],
            registry=r,
        )
        self.abort_posts = Counter(
            "kvxfer_proxy_abort_posts", "Results of POSTs to --abort-url-template (sent, failed).", ["result"], registry=r
        )
        self.upstream_retries = Counter(
            "kvxfer_proxy_upstream_retries", "Requests re-sent to another instance after a refused connection.",
            ["role"], registry=r,
        )
        for endpoint in ("completions", "chat_completions"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        for action in ("abort_posted", "logged_only"):
            self.releases.labels(action)
        for result in ("sent", "failed"):
            self.abort_posts.labels(result)
        for stage in ("prefill", "decode"):
            self.stage_seconds.labels(stage)

    def instance_changed(self, inst: Instance) -> None:
        """Pool hook: mirror an instance's health and in-flight count."""
        self.in_flight.labels(inst.role, inst.label).set(inst.outstanding)
        self.healthy.labels(inst.role, inst.label).set(1 if inst.healthy else 0)

    def render(self) -> bytes:
        """The exposition text for GET /metrics."""
        return generate_latest(self.registry)
