"""Fake OpenAI-compatible prefill/decode instances and a threaded uvicorn runner for the proxy
tests (layer: tests; loopback only, every wait bounded).

A ``FakeInstance`` records every request it receives (with a global sequence number, so tests
can check prefill-before-decode order) and behaves according to its mutable ``mode``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

_SEQ = itertools.count()
_SEQ_LOCK = threading.Lock()


def next_seq() -> int:
    with _SEQ_LOCK:
        return next(_SEQ)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@dataclass
class Received:
    seq: int
    instance: str
    path: str
    request_id: str | None
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeInstance:
    """An OpenAI-compatible fake. Modes (``mode``):

    ok          prefill: JSON with fresh kv_transfer_params; decode: echo (JSON or 3 SSE events)
    garbage     200 with a non-JSON body
    no_params   prefill JSON without kv_transfer_params
    error400    400 with an OpenAI JSON error
    error500    500 with a plain-text body
    hang        never answers; waits (at most 20 s) for the caller to hang up
    slow_stream decode: one SSE event every 25 ms, at most 400, until the caller hangs up
    drop_stream decode: two SSE events, then the connection breaks mid-stream
    """

    name: str
    role: str  # "prefill" | "decode"
    mode: str = "ok"
    health_ok: bool = True
    received: list[Received] = field(default_factory=list)
    answered_params: dict[str, dict] = field(default_factory=dict)  # prefill: request id -> params returned
    aborts: list[str] = field(default_factory=list)
    hung_up: dict[str, str] = field(default_factory=dict)  # request id -> "disconnected" | "completed"
    events_sent: dict[str, int] = field(default_factory=dict)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if method == "GET" and path == "/health":
            return await _json(send, 200 if self.health_ok else 503, {"ok": self.health_ok})
        if method == "GET" and path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})
        if method == "POST" and path.startswith("/abort/"):
            self.aborts.append(path.removeprefix("/abort/"))
            return await _json(send, 200, {"aborted": True})
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(raw)
            rid = headers.get("x-request-id")
            self.received.append(Received(next_seq(), self.name, path, rid, headers, body))
            return await self._complete(path, rid, body, receive, send)
        return await _json(send, 404, {"error": "not found"})

    async def _complete(self, path, rid, body, receive, send) -> None:
        mode = self.mode
        if mode == "garbage":
            return await _raw(send, 200, b"<html>surprise</html>", b"text/html")
        if mode == "error400":
            return await _json(send, 400, {"error": {"message": "bad model", "type": "BadRequestError", "code": 400}})
        if mode == "error500":
            return await _raw(send, 500, b"Internal Server Error", b"text/plain")
        if mode == "hang":
            try:
                await asyncio.wait_for(_until_disconnect(receive), 20)
                self.hung_up[rid] = "disconnected"
            except asyncio.TimeoutError:
                self.hung_up[rid] = "completed"
            return
        if self.role == "prefill":
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{self.name}",
                      "remote_block_ids": [next_seq(), next_seq()], "remote_request_id": rid,
                      "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
            self.answered_params[rid] = params
            answer: dict[str, Any] = {"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            if mode != "no_params":
                answer["kv_transfer_params"] = params
            return await _json(send, 200, answer)
        echo = {"request_id": rid, "served_by": self.name, "kv_transfer_params": body.get("kv_transfer_params")}
        if not body.get("stream"):
            return await _json(send, 200, {**echo, "choices": [{"index": 0, "text": f"echo {rid}"}]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        limit, delay = {"slow_stream": (400, 0.025), "drop_stream": (2, 0.0)}.get(mode, (3, 0.0))
        disconnected = asyncio.ensure_future(_until_disconnect(receive))
        sent = 0
        try:
            for i in range(limit):
                if disconnected.done():
                    self.hung_up[rid] = "disconnected"
                    return
                event = {**echo, "index": i, "choices": [{"index": 0, "text": f"t{i}"}]}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                            "more_body": True})
                sent += 1
                self.events_sent[rid] = sent
                await asyncio.sleep(delay)
            if mode == "drop_stream":
                raise RuntimeError("fake decoder crashed mid-stream")  # uvicorn drops the connection
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            self.hung_up[rid] = "completed"
        finally:
            disconnected.cancel()


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json(send, status: int, body: Any) -> None:
    await _raw(send, status, json.dumps(body).encode(), b"application/json")


async def _raw(send, status: int, data: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Serves an ASGI app with uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int | None = None):
        self.app = app
        self.port = port or free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, what=f"server on port {self.port} to start")
        return self

    def stop(self) -> None:
        self.request_stop()
        self.join()

    def request_stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def join(self) -> None:
        if self._server is not None:
            self._thread.join(timeout=10)
            self._server = None


def metric(text: str, sample_name: str, **labels: str) -> float:
    """The sum of the samples named ``sample_name`` whose labels include ``labels`` (0.0 if none)."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()))
