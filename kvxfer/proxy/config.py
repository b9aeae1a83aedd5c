"""Proxy configuration (layer: proxy app; imports only the standard library and kvxfer.errors).

``ProxyConfig`` is the single value every other proxy module is built from; ``parse_args`` turns
the toy-proxy-compatible command line (``--prefiller-hosts`` ... ``--decoder-ports``) into one.
"""

from __future__ import annotations

import argparse
import string
from dataclasses import dataclass

from kvxfer.errors import ConfigError

__all__ = ["Endpoint", "ProxyConfig", "build_parser", "pair_endpoints", "parse_args"]

ABORT_TEMPLATE_FIELDS = frozenset({"host", "port", "request_id"})


@dataclass(frozen=True)
class Endpoint:
    """One upstream OpenAI-compatible instance (for multi-host DP: the head instance only)."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # bare IPv6 literal
        return f"http://{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs; validated on construction.

    Invariants: at least one prefill and one decode endpoint; positive timeouts and interval;
    ``abort_url_template`` (if set) uses only ``{host}``, ``{port}`` and ``{request_id}``.
    Raises ``ConfigError`` otherwise.
    """

    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]
    host: str = "127.0.0.1"
    port: int = 8192
    timeout: float = 300.0
    connect_timeout: float = 5.0
    health_interval: float = 5.0
    health_timeout: float = 2.0
    abort_url_template: str | None = None
    abort_timeout: float = 5.0
    log_level: str = "info"
    max_body_bytes: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("need at least one prefill instance; got none")
        if not self.decode:
            raise ConfigError("need at least one decode instance; got none")
        for name in ("timeout", "connect_timeout", "health_interval", "health_timeout", "abort_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0; got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535; got {self.port}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be > 0; got {self.max_body_bytes}")
        if self.abort_url_template is not None:
            _check_template(self.abort_url_template)


def _check_template(template: str) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"abort URL template {template!r} is malformed: {exc}") from None
    unknown = names - ABORT_TEMPLATE_FIELDS
    if unknown:
        raise ConfigError(
            f"abort URL template may use {sorted(ABORT_TEMPLATE_FIELDS)}; got unknown {sorted(unknown)}"
        )
    if not template.startswith(("http://", "https://")):
        raise ConfigError(f"abort URL template must start with http:// or https://; got {template!r}")


def pair_endpoints(role: str, hosts: list[str], ports: list[int]) -> tuple[Endpoint, ...]:
    """Pair hosts with ports: one port for every host, or exactly one port per host.

    Raises ``ConfigError`` naming the role and both counts when neither rule applies.
    """
    if not hosts:
        raise ConfigError(f"--{role}-hosts needs at least one host; got none")
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ConfigError(
            f"--{role}-ports must give one port for all hosts or one per host; "
            f"expected 1 or {len(hosts)} ports; got {len(ports)}"
        )
    for port in ports:
        if not 1 <= port <= 65535:
            raise ConfigError(f"--{role}-ports: port must be in 1..65535; got {port}")
    return tuple(Endpoint(h, p) for h, p in zip(hosts, ports))


def build_parser(prog: str = "kvxfer proxy") -> argparse.ArgumentParser:
    """The argument parser; flags match vLLM's toy proxy plus production options."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Disaggregated prefill/decode proxy: OpenAI-compatible front end that sends "
        "each request to a prefill instance, then to a decode instance with the KV transfer "
        "parameters the prefill instance returned.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; use 0.0.0.0 to serve other hosts)")
    p.add_argument("--port", type=int, default=8192, help="port to listen on (default 8192)")
    p.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=["localhost"], metavar="HOST")
    p.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, default=[8100], metavar="PORT")
    p.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["localhost"], metavar="HOST")
    p.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, default=[8200], metavar="PORT")
    p.add_argument("--timeout", type=float, default=300.0, help="upstream read/write timeout in seconds, per wait (default 300)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="upstream connect timeout in seconds (default 5)")
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between GET /health probes of each instance (default 5)")
    p.add_argument("--health-timeout", type=float, default=2.0, help="timeout of one health probe in seconds (default 2)")
    p.add_argument(
        "--abort-url-template",
        default=None,
        help="URL POSTed to release a prefill instance's blocks when the decode side never took "
        "them, e.g. 'http://{host}:{port}/kvxfer/abort/{request_id}' (default: none; the proxy only logs)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def parse_args(argv: list[str]) -> ProxyConfig:
    """Parse ``argv`` into a validated ``ProxyConfig``; raises ``ConfigError`` on bad values.

    argparse itself exits with status 2 on unknown flags or wrong types (as every CLI does).
    """
    ns = build_parser().parse_args(argv)
    return ProxyConfig(
        prefill=pair_endpoints("prefiller", ns.prefiller_hosts, ns.prefiller_ports),
        decode=pair_endpoints("decoder", ns.decoder_hosts, ns.decoder_ports),
        host=ns.host,
        port=ns.port,
        timeout=ns.timeout,
        connect_timeout=ns.connect_timeout,
        health_interval=ns.health_interval,
        health_timeout=ns.health_timeout,
        abort_url_template=ns.abort_url_template,
        log_level=ns.log_level,
    )
