"""kvxfer's disaggregated prefill/decode HTTP proxy (layer: application; nothing else in kvxfer
imports it, and it imports nothing from kvxfer but kvxfer.errors).

Run it with ``kvxfer proxy --prefiller-hosts ... --decoder-hosts ...`` (see docs/proxy.md), or
embed it: ``create_app(ProxyConfig(prefill=(Endpoint(h, p),), decode=(...)))`` returns a
Starlette app. ``create_app`` needs the optional ``proxy`` dependencies (starlette, uvicorn,
httpx, prometheus-client) and is imported lazily so ``kvxfer.proxy.config`` works without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer.proxy.config import Endpoint, ProxyConfig, parse_args

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["Endpoint", "ProxyConfig", "create_app", "main", "parse_args"]


def create_app(config: ProxyConfig) -> Starlette:
    """Build the proxy's Starlette app (see ``kvxfer.proxy.app.create_app``)."""
    from kvxfer.proxy.app import create_app as _create_app

    return _create_app(config)


def main(argv: list[str] | None = None) -> int:
    """``kvxfer proxy`` entry point (see ``kvxfer.proxy.cli.main``)."""
    from kvxfer.proxy.cli import main as _main

    return _main(argv)
