"""The proxy's ASGI application (layer: proxy app; imports starlette/httpx/prometheus_client and
nothing from kvxfer but kvxfer.errors and the proxy's own modules).

``create_app(config)`` returns a Starlette app serving POST /v1/completions and
/v1/chat/completions (prefill then decode, streams passed through), GET /v1/models (from a
decode instance), GET /health and GET /metrics. Every error the proxy produces is JSON with an
``"error"`` object; unknown routes and wrong methods included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvxfer.proxy.config import ProxyConfig
from kvxfer.proxy.flow import PDForwarder, send_json
from kvxfer.proxy.metrics import CONTENT_TYPE_LATEST, ProxyMetrics
from kvxfer.proxy.pd import BadRequest, error_body, new_request_id, parse_client_body
from kvxfer.proxy.routing import HealthChecker, InstancePool, NoHealthyInstance

__all__ = ["create_app"]

log = logging.getLogger("kvxfer.proxy")

# Client headers worth forwarding upstream (vLLM's --api-key checks Authorization).
_FORWARDED_HEADERS = ("authorization",)
_MAX_REQUEST_ID = 256


def create_app(config: ProxyConfig) -> Starlette:
    """Build the proxy app for ``config``.

    The upstream HTTP client and the health-check loop live for the app's lifespan (the ASGI
    server must run lifespan events, as uvicorn does). ``app.state`` exposes ``config``,
    ``metrics``, ``prefill_pool``, ``decode_pool`` and (while running) ``forwarder``.
    """
    metrics = ProxyMetrics()
    holder: dict[str, PDForwarder] = {}
    routes = [
        Route("/v1/completions", _PDEndpoint(holder, metrics, config, "completions"), methods=["POST"]),
        Route("/v1/chat/completions", _PDEndpoint(holder, metrics, config, "chat_completions"), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=_lifespan(holder), exception_handlers={HTTPException: _http_error})
    app.state.config = config
    app.state.metrics = metrics
    app.state.prefill_pool = InstancePool("prefill", config.prefill, metrics.instance_changed)
    app.state.decode_pool = InstancePool("decode", config.decode, metrics.instance_changed)
    return app


def _lifespan(holder: dict[str, PDForwarder]):
    """The app's lifespan: one pooled upstream client, the health loop, and a drain at exit."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        config: ProxyConfig = app.state.config
        pools = [app.state.prefill_pool, app.state.decode_pool]
        timeout = httpx.Timeout(config.timeout, connect=config.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            forwarder = PDForwarder(config, client, pools[0], pools[1], app.state.metrics)
            holder["forwarder"] = app.state.forwarder = forwarder
            checker = HealthChecker(pools, client, config.health_interval, config.health_timeout)
            health_task = asyncio.get_running_loop().create_task(checker.run())
            log.info("kvxfer proxy: prefill %s, decode %s", [str(e) for e in config.prefill],
                     [str(e) for e in config.decode])
            try:
                yield
            finally:
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task
                await forwarder.drain(config.abort_timeout)

    return lifespan


async def _health(request: Request) -> Response:
    """200 when at least one instance of each role is healthy, else 503; lists every instance."""
    pools: list[InstancePool] = [request.app.state.prefill_pool, request.app.state.decode_pool]
    body: dict[str, Any] = {
        pool.role: [{"instance": i.label, "healthy": i.healthy, "in_flight": i.outstanding, "last_error": i.last_error}
                    for i in pool.instances] for pool in pools}
    ready = all(pool.healthy() for pool in pools)
    body["status"] = "ok" if ready else "unavailable"
    return JSONResponse(body, status_code=200 if ready else 503)


async def _metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _models(request: Request) -> Response:
    """The model list of a healthy decode instance (all instances serve the same model)."""
    try:
        inst = request.app.state.decode_pool.pick()
        resp = await request.app.state.forwarder.client.get(f"{inst.endpoint.base_url}/v1/models",
                                                            headers=_forwarded(request, None))
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")
    except NoHealthyInstance as exc:
        return JSONResponse(error_body(str(exc), "no_healthy_instance", 503), status_code=503)
    except httpx.HTTPError as exc:
        return JSONResponse(error_body(f"decode instance failed: {type(exc).__name__}", "bad_upstream", 502), 502)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 unknown route, 405 wrong method) as OpenAI-shaped JSON."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, "invalid_request_error", exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


def _forwarded(request: Request, request_id: str | None) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return headers


class _PDEndpoint:
    """Raw ASGI endpoint for one OpenAI route: validates input, then races the P/D flow against
    the client's disconnect so a departed client cancels upstream work at once."""

    def __init__(self, holder: dict[str, PDForwarder], metrics: ProxyMetrics, config: ProxyConfig, name: str):
        self.holder = holder
        self.metrics = metrics
        self.config = config
        self.name = name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        outcome = await self._serve(scope, receive, send)
        self.metrics.requests.labels(self.name, outcome).inc()

    async def _serve(self, scope: dict, receive: Any, send: Any) -> str:
        request = Request(scope, receive)
        request_id = request.headers.get("x-request-id") or new_request_id()
        try:
            raw = await self._read_body(request)
            if len(request_id) > _MAX_REQUEST_ID or not request_id.isprintable():
                raise BadRequest(f"X-Request-Id must be 1..{_MAX_REQUEST_ID} printable characters")
            body = parse_client_body(raw)
        except ClientDisconnect:
            return "client_disconnect"
        except _TooLarge as exc:
            await send_json(send, 413, error_body(str(exc), "invalid_request_error", 413), request_id)
            return "bad_request"
        except BadRequest as exc:
            await send_json(send, 400, error_body(str(exc), "invalid_request_error", 400), request_id)
            return "bad_request"
        tracker = _CompletionTracker(send)
        work = asyncio.ensure_future(self.holder["forwarder"].handle(
            scope["path"], body, request_id, _forwarded(request, request_id), tracker))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not tracker.complete:
                work.cancel()  # the client left: close the upstream request now
            try:
                return await work
            except asyncio.CancelledError:
                if not watcher.done():
                    raise  # we ourselves are being cancelled (server shutdown)
                return "client_disconnect"
            except Exception:
                log.exception("request %s: internal error", request_id)
                if not tracker.started:
                    await send_json(send, 500, error_body("internal proxy error", "internal_error", 500), request_id)
                return "internal_error"
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()

    async def _read_body(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise _TooLarge(f"request body exceeds {self.config.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _CompletionTracker:
    """Wraps an ASGI ``send``; remembers whether the response started and completed."""

    def __init__(self, send: Any):
        self._send = send
        self.started = False
        self.complete = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


async def _wait_for_disconnect(receive: Any) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
