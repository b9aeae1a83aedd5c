"""``kvxfer proxy`` command line (layer: proxy app; imports uvicorn lazily, nothing from kvxfer but
kvxfer.errors and the proxy's own modules).

``main(argv)`` parses the toy-proxy-compatible flags, builds the app and serves it with uvicorn
until SIGINT/SIGTERM. Returns the process exit status: 0 after a clean shutdown, 2 for bad
arguments (argparse's convention), 1 if the server could not start (port in use).
"""

from __future__ import annotations

import contextlib
import logging
import sys

from kvxfer.errors import ConfigError
from kvxfer.proxy.config import ProxyConfig, parse_args

__all__ = ["main", "serve"]


def serve(config: ProxyConfig) -> None:
    """Run the proxy for ``config`` in the foreground until SIGINT/SIGTERM, then shut down
    gracefully (in-flight requests get up to 30 s) and return."""
    import uvicorn

    from kvxfer.proxy.app import create_app

    class _Server(uvicorn.Server):
        # uvicorn re-raises the stop signal after a graceful shutdown (so the process dies of
        # SIGTERM, or raises KeyboardInterrupt); a service that shut down cleanly exits 0 instead.
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uv_config = uvicorn.Config(create_app(config), host=config.host, port=config.port, log_level=config.log_level,
                               lifespan="on", timeout_graceful_shutdown=30)
    server = _Server(uv_config)
    server.run()
    if not server.started:
        raise OSError(f"kvxfer proxy could not start on {config.host}:{config.port} (see the log above)")


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``kvxfer proxy ARGS...``; returns an exit status."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), message already printed
        return exc.code if isinstance(exc.code, int) else 2
    except ConfigError as exc:
        print(f"kvxfer proxy: error: {exc}", file=sys.stderr)
        return 2
    try:
        serve(config)
    except SystemExit as exc:  # uvicorn calls sys.exit(3) when it cannot bind or start
        if exc.code in (0, None):
            return 0
        print(f"kvxfer proxy: error: could not start on {config.host}:{config.port} (see the log above)",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvxfer proxy: error: {exc}", file=sys.stderr)
        return 1
    return 0
