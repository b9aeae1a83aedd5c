"""One request's trip through prefill then decode (layer: proxy app; imports httpx, nothing from
kvxfer but the proxy's own modules).

``PDForwarder.handle`` owns the whole upstream conversation for one client request and writes
the client's response through an ASGI ``send``.

Release rule for the producer's blocks: the proxy asks the prefill instance to release
(``--abort-url-template``; always logged) whenever that instance may hold blocks no decode
instance will read: the request stopped during or after prefill but before a decode instance
received it (client gone, no healthy decode instance, every decode connection refused, garbage
from prefill), or the decode instance answered an error status. Once a decode instance holds the
request and may be reading, the proxy never releases behind its back: it closes the decode
stream and leaves the release to the decoder's notification or the producer's lease timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from kvxfer.proxy.config import ProxyConfig
from kvxfer.proxy.metrics import ProxyMetrics
from kvxfer.proxy.pd import BadUpstream, decode_body, error_body, parse_prefill_response, prefill_body
from kvxfer.proxy.routing import Instance, InstancePool, NoHealthyInstance

__all__ = ["PDForwarder", "UpstreamFailure", "send_json"]

log = logging.getLogger("kvxfer.proxy")


class UpstreamFailure(Exception):
    """The request cannot be completed; carries the HTTP answer for the client.

    ``body`` is the JSON-serialisable error (or an upstream's own 4xx JSON, passed through).
    """

    def __init__(self, status: int, body: Any, outcome: str):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body
        self.outcome = outcome


@dataclass
class _Trip:
    """Where one request is; decides whether the producer must be told to release."""

    request_id: str
    prefill: Instance | None = None  # the prefill instance that may hold blocks
    decode_received: bool = False  # a decode instance may be reading the blocks

    def may_strand_blocks(self) -> bool:
        return self.prefill is not None and not self.decode_received


class PDForwarder:
    """Runs the prefill -> decode flow; one per app, shared by all requests on one event loop."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient, prefill: InstancePool,
                 decode: InstancePool, metrics: ProxyMetrics):
        self.config = config
        self.client = client
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def handle(self, path: str, body: dict[str, Any], request_id: str, headers: dict[str, str], send) -> str:
        """Serve one request end to end; returns its outcome label (see ``metrics.OUTCOMES``).

        Writes exactly one HTTP response through ``send`` unless cancelled (client gone), in
        which case the open upstream request is closed and the release rule applies.
        """
        trip = _Trip(request_id)
        tracked = _StartTracker(send)
        try:
            params = await self._prefill(path, body, headers, trip)
            await self._decode(path, body, params, headers, trip, tracked)
            return "ok"
        except UpstreamFailure as failure:
            if trip.may_strand_blocks():
                self.release_prefill(trip.prefill, request_id, f"request failed ({failure.outcome})")
            if tracked.started:  # a stream already began: end it with an SSE error event
                await _send_sse_error(send, failure.body)
            else:
                await send_json(send, failure.status, failure.body, request_id)
            return failure.outcome
        except asyncio.CancelledError:
            if trip.may_strand_blocks():
                self.release_prefill(trip.prefill, request_id, "client disconnected before decode started")
            else:
                log.info("request %s: client disconnected; upstream request closed", request_id)
            raise

    # -- stages ---------------------------------------------------------------------------

    async def _prefill(self, path: str, body: dict, headers: dict, trip: _Trip) -> dict:
        payload = prefill_body(body)
        t0 = time.monotonic()
        try:
            async with self._exchange("prefill", self.prefill_pool, path, payload, headers, trip, stream=False) as resp:
                if resp.status_code >= 400:
                    trip.prefill = None  # the producer rejected the request: it holds nothing
                    raise _rejected("prefill", resp.status_code, resp.content)
                try:
                    return parse_prefill_response(resp.content)
                except BadUpstream as exc:
                    raise UpstreamFailure(502, error_body(str(exc), "bad_upstream", 502), "prefill_error") from None
        finally:
            self.metrics.stage_seconds.labels("prefill").observe(time.monotonic() - t0)

    async def _decode(self, path: str, body: dict, params: dict, headers: dict, trip: _Trip, send) -> None:
        payload = decode_body(body, params)
        t0 = time.monotonic()
        try:
            async with self._exchange("decode", self.decode_pool, path, payload, headers, trip, stream=True) as resp:
                if resp.status_code >= 400:
                    content = await resp.aread()
                    trip.decode_received = False  # the decoder finished with an error: it reads nothing
                    raise _rejected("decode", resp.status_code, content)
                if body.get("stream", False):
                    await _pipe_stream(resp, send, trip.request_id)
                    return
                content = await resp.aread()
                try:
                    json.loads(content)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    raise UpstreamFailure(502, error_body(f"decode instance answered non-JSON: {content[:80]!r}",
                                                          "bad_upstream", 502), "decode_error") from None
                await send_json(send, 200, content, trip.request_id)
        except httpx.TimeoutException:
            raise UpstreamFailure(504, error_body("decode instance timed out", "upstream_timeout", 504),
                                  "decode_error") from None
        except httpx.HTTPError as exc:
            raise UpstreamFailure(502, error_body(f"decode instance failed: {type(exc).__name__}: {exc}",
                                                  "bad_upstream", 502), "decode_error") from None
        finally:
            self.metrics.stage_seconds.labels("decode").observe(time.monotonic() - t0)

    @asynccontextmanager
    async def _exchange(self, role: str, pool: InstancePool, path: str, payload: dict, headers: dict, trip: _Trip,
                        stream: bool) -> AsyncIterator[httpx.Response]:
        """POST to the least-loaded healthy instance of ``pool``, yielding its response.

        The instance counts the request as outstanding until the block exits (streams
        included); the response is closed on exit. A refused connection takes the instance out
        of the pool and the request goes to the next one. Raises ``UpstreamFailure``. Updates
        ``trip`` as soon as an instance may have received the request.
        """
        tried: set[Instance] = set()
        last_refusal = ""
        while True:
            try:
                inst = pool.pick(exclude=tried)
            except NoHealthyInstance as exc:
                detail = f"{exc}; last refusal: {last_refusal}" if last_refusal else str(exc)
                raise UpstreamFailure(503, error_body(detail, "no_healthy_instance", 503), "no_instance") from None
            request = self.client.build_request("POST", f"{inst.endpoint.base_url}{path}", json=payload, headers=headers)
            with pool.lease(inst):
                _set_received(role, trip, inst)
                try:
                    resp = await self.client.send(request, stream=stream)
                except httpx.ConnectError as exc:  # never reached the instance: safe to try another
                    _set_received(role, trip, None)
                    pool.mark(inst, False, f"connection failed: {exc}")
                    tried.add(inst)
                    last_refusal = f"{inst.label}: {exc}"
                    self.metrics.upstream_retries.labels(role).inc()
                    continue
                except httpx.TimeoutException:
                    raise UpstreamFailure(504, error_body(f"{role} instance {inst.label} timed out",
                                                          "upstream_timeout", 504), f"{role}_error") from None
                except httpx.HTTPError as exc:
                    raise UpstreamFailure(502, error_body(f"{role} instance {inst.label} failed: {type(exc).__name__}: {exc}",
                                                          "bad_upstream", 502), f"{role}_error") from None
                try:
                    yield resp
                finally:
                    await resp.aclose()
                return

    # -- releasing the producer's blocks ----------------------------------------------------

    def release_prefill(self, inst: Instance, request_id: str, reason: str) -> None:
        """Log that ``inst`` may hold blocks of ``request_id`` and, if configured, ask it to release.

        Never blocks and never raises: the POST runs as a background task with its own timeout.
        Without a template the producer's own lease timeout frees the blocks.
        """
        template = self.config.abort_url_template
        log.warning("request %s: %s; prefill instance %s may hold its KV blocks; %s", request_id, reason, inst.label,
                    "asking it to release them" if template else
                    "no --abort-url-template, so its own lease timeout will free them")
        self.metrics.releases.labels("abort_posted" if template else "logged_only").inc()
        if not template:
            return
        url = template.format(host=inst.endpoint.host, port=inst.endpoint.port, request_id=request_id)
        task = asyncio.get_running_loop().create_task(self._post_abort(url, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_abort(self, url: str, request_id: str) -> None:
        try:
            resp = await self.client.post(url, json={"request_id": request_id}, headers={"X-Request-Id": request_id},
                                          timeout=self.config.abort_timeout)
            ok = resp.status_code < 400
            if not ok:
                log.warning("request %s: abort POST %s answered HTTP %d", request_id, url, resp.status_code)
        except httpx.HTTPError as exc:
            ok = False
            log.warning("request %s: abort POST %s failed: %s: %s", request_id, url, type(exc).__name__, exc)
        self.metrics.abort_posts.labels("sent" if ok else "failed").inc()

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for pending abort POSTs (called at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)


def _set_received(role: str, trip: _Trip, inst: Instance | None) -> None:
    if role == "prefill":
        trip.prefill = inst
    else:
        trip.decode_received = inst is not None


class _StartTracker:
    """Wraps an ASGI ``send``; remembers whether the response has started."""

    def __init__(self, send):
        self._send = send
        self.started = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _rejected(role: str, status: int, content: bytes) -> UpstreamFailure:
    """An upstream error status: pass a 4xx JSON error through, map anything else to 502."""
    if 400 <= status < 500:
        try:
            return UpstreamFailure(status, json.loads(content), "upstream_rejected")
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    return UpstreamFailure(502, error_body(f"{role} instance answered HTTP {status}: {content[:200]!r}",
                                           "bad_upstream", 502), f"{role}_error")


async def _pipe_stream(resp: httpx.Response, send, request_id: str) -> None:
    """Pass an upstream event stream through to the client, chunk by chunk."""
    content_type = resp.headers.get("content-type", "text/event-stream")
    await send({"type": "http.response.start", "status": resp.status_code, "headers": [
        (b"content-type", content_type.encode("latin-1")), (b"x-request-id", request_id.encode("latin-1")),
        (b"cache-control", b"no-cache")]})
    async for chunk in resp.aiter_bytes():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_json(send, status: int, body: Any, request_id: str | None = None) -> None:
    """Send a complete JSON response; ``body`` may be pre-encoded bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_sse_error(send, body: Any) -> None:
    """End an already started event stream with one ``data: {"error": ...}`` event."""
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(body).encode() + b"\n\n",
                "more_body": False})
