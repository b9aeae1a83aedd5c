"""Prometheus metrics of one Agent, served over HTTP (layer: agent; must not import
prometheus_client at module level: it is an optional dependency, loaded only when metrics are on).

Each ``AgentMetrics`` owns a private ``CollectorRegistry`` (several agents may live in one
process) and its own HTTP server thread. Counters and histograms are fed by completed
transfer handles (``observe``); what the agent holds now (``AgentStats``) is read at scrape
time by a collector, so nothing is updated on the hot path but one callback per transfer.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvxfer.agent.reports import AgentStats
from kvxfer.errors import ConfigError

__all__ = ["AgentMetrics", "PATHS", "load_prometheus"]

#: Values of the ``path`` label: how a transfer moved its bytes (``TransferStats.mode``, a
#: ``TransferPath`` value; "host-staged": descriptors into host staging, unpacked on the consumer).
PATHS = ("direct", "host-staged", "staged", "ipc")

# Claims and transfers of one request: from tens of microseconds (same host) to the 120 s
# default transfer timeout.
_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

# AgentStats field -> (gauge name, help). Read at each scrape.
_GAUGES = {
    "held_requests": ("kvxfer_agent_held_requests", "Producer requests held (blocks not yet free)."),
    "held_blocks": ("kvxfer_agent_held_blocks", "Producer blocks held for consumers."),
    "claimed_requests": ("kvxfer_agent_claimed_requests",
                         "Held requests inside a consumer's transfer window (claimed)."),
    "ending_requests": ("kvxfer_agent_ending_requests",
                        "Released, aborted or expired requests waiting for a transfer window to close."),
    "in_flight": ("kvxfer_agent_in_flight_transfers", "Reads and writes not ended yet (draining included)."),
    "draining": ("kvxfer_agent_draining_transfers",
                 "Failed transfers waiting for the backend to confirm they ended."),
    "quarantined_blocks": ("kvxfer_agent_quarantined_blocks",
                           "Destination blocks of failed reads not confirmed ended (do not reuse)."),
    "sessions": ("kvxfer_agent_sessions", "Side-channel sessions (handshaken consumers) kept now."),
    "express_lanes": ("kvxfer_agent_express_lanes",
                      "Express-lane connections open now (sessions whose requests skip ZMQ)."),
}


def load_prometheus():
    """The ``prometheus_client`` module.

    Raises:
        ConfigError: it is not installed (metrics were asked for).
    """
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families of custom collectors
    except ImportError as exc:
        raise ConfigError("metrics_port is set but the package prometheus-client is not installed "
                          "(pip install 'kvxfer[metrics]')") from exc
    return prometheus_client


class _HeldNow:
    """A collector of gauges (and the rejected-frames counter) read from ``stats()`` at each scrape."""

    def __init__(self, prom, stats: Callable[[], AgentStats]) -> None:
        self._core = prom.core
        self._stats = stats

    def describe(self):
        return self._families(AgentStats())

    def collect(self):
        return self._families(self._stats())

    def _families(self, stats: AgentStats) -> list:
        core = self._core
        out = []
        for field, (name, doc) in _GAUGES.items():
            family = core.GaugeMetricFamily(name, doc)
            family.add_metric([], getattr(stats, field))
            out.append(family)
        rejected = core.CounterMetricFamily(
            "kvxfer_agent_rejected_frames", "Side-channel frames refused, by reason.", labels=["reason"])
        for reason, count in sorted(stats.rejected_frames.items()):
            rejected.add_metric([reason], count)
        out.append(rejected)
        return out


class AgentMetrics:
    """An agent's metric families in a private registry, served on ``host:port`` until ``close``.

    Args:
        stats: ``Agent.stats`` (called at each scrape, on the server's thread).
        port: the base port; this agent serves on ``port + rank`` (as side-channel ports go), and
            0 picks a free one (see ``address``).
        host: the address to bind ("" or None: every interface).
        engine_id: the agent's engine id, exported as ``kvxfer_agent_info``.
        rank: this agent's place among the ranks of its host, ``dp_rank * tp_size + tp_rank``.

    Raises:
        ConfigError: prometheus-client is missing, or the port cannot be bound.
    """

    def __init__(self, stats: Callable[[], AgentStats], port: int, host: str | None = None,
                 engine_id: str = "", *, rank: int = 0) -> None:
        prom = load_prometheus()
        if port:
            port += rank
            if port > 65535:
                raise ConfigError(f"metrics port {port - rank} + rank {rank} is past 65535")
        self.registry = r = prom.CollectorRegistry(auto_describe=True)
        self.transfers = prom.Counter(
            "kvxfer_agent_transfers", "Transfers ended, by direction, path and outcome (ok or the error class).",
            ["direction", "path", "outcome"], registry=r)
        self.bytes = prom.Counter(
            "kvxfer_agent_transfer_bytes", "Payload bytes moved by transfers that succeeded.",
            ["direction", "path"], registry=r)
        self.seconds = prom.Histogram(
            "kvxfer_agent_transfer_seconds", "Seconds from posting a transfer to its completion (succeeded only).",
            ["direction", "path"], buckets=_SECONDS_BUCKETS, registry=r)
        self.setup = prom.Histogram(
            "kvxfer_agent_setup_seconds",
            "Seconds from the call until the transfer was posted (handshake, claim, plan; succeeded only).",
            ["direction", "path"], buckets=_SECONDS_BUCKETS, registry=r)
        self.claim = prom.Histogram(
            "kvxfer_agent_claim_seconds", "Seconds from sending a read's claims to having every answer.",
            ["path"], buckets=_SECONDS_BUCKETS, registry=r)
        prom.Info("kvxfer_agent", "This agent.", registry=r).info({"engine_id": engine_id, "rank": str(rank)})
        for path in PATHS:
            self.transfers.labels("read", path, "ok")
            self.bytes.labels("read", path)
        self.transfers.labels("write", "direct", "ok")
        self.bytes.labels("write", "direct")
        r.register(_HeldNow(prom, stats))
        self._server = _serve(prom.make_wsgi_app(r), host or "0.0.0.0", port)
        self.address: tuple[str, int] = (host or "0.0.0.0", int(self._server.server_address[1]))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"kvxfer-metrics-{self.address[1]}", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False

    def observe(self, direction: str, path: str, handle) -> None:
        """A transfer handle's done-callback: count it by outcome; on success, its bytes and times.

        ``path`` names the path for a failed handle (it has no stats); a succeeded one reports its own.
        Runs on the completing thread after the handle is done: a waiter may see the handle done
        a moment before the counters move.
        """
        error = handle.exception()
        if error is not None:
            self.transfers.labels(direction, _label(path), type(error).__name__).inc()
            return
        stats = handle.wait(0)
        path = _label(stats.mode)
        self.transfers.labels(direction, path, "ok").inc()
        self.bytes.labels(direction, path).inc(stats.num_bytes)
        self.seconds.labels(direction, path).observe(stats.seconds)
        self.setup.labels(direction, path).observe(stats.setup_seconds)
        if direction == "read":
            self.claim.labels(path).observe(stats.claim_seconds)

    def close(self) -> None:
        """Stop serving and wait for the server thread (at most 5 s). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _label(path) -> str:
    """A path (``TransferPath`` member or string) as its label value."""
    return str(getattr(path, "value", path))


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up close()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's signature
        return  # one line per scrape on stderr would drown the agent's own log


def _serve(app, host: str, port: int) -> _Server:
    """A bound (not yet serving) threaded WSGI server for ``app``; IPv6 when ``host`` is one.

    Raises:
        ConfigError: the address cannot be bound.
    """
    server_class = _Server
    if ":" in host:
        server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    try:
        return make_server(host, port, app, server_class=server_class, handler_class=_Quiet)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
