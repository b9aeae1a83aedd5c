"""The OpenAI-compatible HTTP face of ``kvxfer-hf serve`` (layer: adapter; starlette, this package, kvxfer errors).

``GET /health``, ``GET /metrics`` (pool occupancy, Prometheus text), ``GET /v1/models`` and ``POST /v1/completions`` with token-id prompts, shaped
like vLLM's answers (``choices[0].token_ids`` with ``return_token_ids``, ``kv_transfer_params``
at the top level), so a client and ``kvxfer proxy`` drive it as they drive vLLM. Model work
runs in a worker thread; the engine serialises forward passes. Bad input gets a 4xx with an
OpenAI-shaped error naming the field; a failed KV load under ``kv_load_failure_policy=fail``
gets a 500.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvxfer import KvxferError

from kvxfer_transformers.engine import Generation, HFEngine
from kvxfer_transformers.params import BadParams, RemotePrefill, wants_remote_decode, wants_remote_prefill
from kvxfer_transformers.transfer import LoadFailed

log = logging.getLogger("kvxfer_transformers.server")


class BadRequest(ValueError):
    """A request this server cannot serve; ``status`` is the HTTP code (400, or 404 for an unknown model)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    return_token_ids: bool
    kv_transfer_params: dict[str, Any] | None


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean; got {value!r}")
    return value


def _prompt(raw: Any, vocab: int) -> list[int]:
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw)):
        raise BadRequest("'prompt' must be token ids: this server has no tokenizer (like vLLM with "
                         "--skip-tokenizer-init)")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], list):
        raw = raw[0]  # a batch of one prompt
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"'prompt' must be a non-empty list of token ids; got {type(raw).__name__}")
    for t in raw:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise BadRequest(f"'prompt' token ids must be integers in [0, {vocab}); got {t!r}")
    return list(raw)


def parse_completion(body: Any, *, served_name: str, vocab: int, max_model_len: int) -> CompletionRequest:
    """Check a /v1/completions body; raises BadRequest naming the field and what was wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object; got {type(body).__name__}")
    if body.get("model") not in (None, served_name):
        raise BadRequest(f"the model {body['model']!r} does not exist; this server serves {served_name!r}", 404)
    prompt = _prompt(body.get("prompt"), vocab)
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer; got {max_tokens!r}")
    if len(prompt) + max_tokens > max_model_len:
        raise BadRequest(f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                         f"model's length {max_model_len}")
    temperature = body.get("temperature", 0)
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or temperature != 0):
        raise BadRequest(f"only greedy decoding is served: 'temperature' must be 0; got {temperature!r}")
    if body.get("n", 1) not in (1, None):
        raise BadRequest(f"'n' must be 1; got {body['n']!r}")
    if _bool(body, "stream", False):
        raise BadRequest("'stream': true is not supported by kvxfer-hf; send stream: false")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"'kv_transfer_params' must be an object or null; got {type(params).__name__}")
    return CompletionRequest(prompt, max_tokens, _bool(body, "ignore_eos", False),
                             _bool(body, "return_token_ids", False), params)


def error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _run(engine: HFEngine, req: CompletionRequest) -> Generation:
    """Pick the path vLLM would: prefill for a remote decoder, decode a remote prefill, or local."""
    params = req.kv_transfer_params
    if wants_remote_prefill(params):
        try:
            remote = RemotePrefill.parse(params, num_groups=engine.num_groups)
        except BadParams as exc:
            raise BadRequest(f"kv_transfer_params: {exc}") from None
        if engine.settings.consumes:
            return engine.decode(req.prompt, req.max_tokens, remote, req.ignore_eos)
        if engine.transfers is not None:  # kv_role kv_producer: compute here, free the producer now
            engine.transfers.release_remote(remote)
    if wants_remote_decode(params) and engine.settings.produces:
        return engine.prefill(req.prompt, req.max_tokens, req.ignore_eos)
    return engine.generate(req.prompt, req.max_tokens, req.ignore_eos)


def answer(req: CompletionRequest, gen: Generation, served_name: str) -> dict[str, Any]:
    """vLLM's /v1/completions answer shape (no text: there is no tokenizer)."""
    choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": gen.finish_reason,
                              "stop_reason": None}
    if req.return_token_ids:
        choice["token_ids"] = gen.token_ids
        choice["prompt_token_ids"] = req.prompt
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": served_name, "choices": [choice],
        "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(gen.token_ids),
                  "total_tokens": len(req.prompt) + len(gen.token_ids),
                  "prompt_tokens_details": {"cached_tokens": gen.loaded_tokens}},
        "kv_transfer_params": gen.kv_transfer_params,
    }


def metrics_text(engine: HFEngine) -> str:
    """The pool's occupancy: free and total blocks, requests held for a decoder, quarantined blocks."""
    t = engine.transfers
    values = {"kvxfer_hf_kv_blocks_free": engine.pool.free_blocks,
              "kvxfer_hf_kv_blocks_total": engine.pool.spec.num_blocks,
              "kvxfer_hf_held_requests": t.held_requests if t is not None else 0,
              "kvxfer_hf_quarantined_blocks": len(t.quarantined) if t is not None else 0}
    return "".join(f"{k} {v}\n" for k, v in values.items())


def create_app(engine: HFEngine, served_name: str) -> Starlette:
    """The ASGI app over ``engine`` (closing the engine is the caller's job)."""

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(metrics_text(engine), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": served_name, "object": "model",
                                                         "owned_by": "kvxfer-hf",
                                                         "max_model_len": engine.max_model_len}]})

    async def completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(f"request body is not valid JSON: {exc}", 400)
        try:
            req = parse_completion(body, served_name=served_name, vocab=engine.vocab_size,
                                   max_model_len=engine.max_model_len)
            gen = await run_in_threadpool(_run, engine, req)
        except BadRequest as exc:
            return error(str(exc), exc.status)
        except LoadFailed as exc:
            log.warning("KV load failed (kv_load_failure_policy=fail): %s", exc)
            return error(f"KV load failed (kv_load_failure_policy=fail): {exc}", 500)
        except KvxferError as exc:
            log.warning("request failed: %s", exc)
            return error(f"{type(exc).__name__}: {exc}", 503)
        return JSONResponse(answer(req, gen, served_name))

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])
