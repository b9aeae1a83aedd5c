"""The prefill/decode request contract, as pure functions (layer: proxy app; standard library only).

No I/O here: these functions turn a client's OpenAI request into the body sent to the prefill
instance and the body sent to the decode instance, and read the KV transfer parameters out of the
prefill response. Keeping them pure is what lets the tests pin the contract exactly.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

__all__ = [
    "BadRequest",
    "BadUpstream",
    "PREFILL_KV_TRANSFER_PARAMS",
    "decode_body",
    "error_body",
    "new_request_id",
    "parse_client_body",
    "parse_prefill_response",
    "prefill_body",
]

# What the producer is told: "run prefill, keep the blocks for a remote decoder".
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BadRequest(ValueError):
    """The client's request is unusable; the message is safe to show the client."""


class BadUpstream(ValueError):
    """An upstream instance answered something the proxy cannot use (not JSON, wrong shape)."""


def new_request_id() -> str:
    """A fresh request id for clients that sent no ``X-Request-Id``."""
    return f"kvxfer-{uuid.uuid4().hex}"


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """Decode a client's JSON body; returns the object, raises ``BadRequest`` with a reason.

    Contract: the body is a JSON object; ``stream`` (if present) is a bool; ``max_tokens`` and
    ``max_completion_tokens`` (if present and not null) are positive integers.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object; got {type(body).__name__}")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest(f"'stream' must be a boolean; got {body['stream']!r}")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer; got {value!r}")
    return body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to the prefill instance; ``body`` is not modified.

    ``max_tokens=1`` (and ``max_completion_tokens=1`` when the client set it), ``stream=false``,
    no ``stream_options``, and ``kv_transfer_params`` asking for a remote decode.
    """
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's original body with the prefill instance's ``kv_transfer_params``; no mutation."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = copy.deepcopy(kv_transfer_params)
    return out


def parse_prefill_response(raw: bytes) -> dict[str, Any]:
    """Return the ``kv_transfer_params`` object from a prefill instance's JSON response.

    Raises ``BadUpstream`` if the response is not a JSON object or lacks a ``kv_transfer_params``
    object (a prefill instance without a KV connector answers like that; decoding would then
    silently recompute the prompt, so the proxy refuses instead).
    """
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadUpstream(f"prefill instance answered non-JSON: {raw[:80]!r}") from None
    if not isinstance(data, dict):
        raise BadUpstream(f"prefill instance answered JSON {type(data).__name__}; expected an object")
    params = data.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise BadUpstream(
            "prefill instance answered without a kv_transfer_params object "
            f"(got {type(params).__name__}); is it running with a KV connector?"
        )
    return params


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """An OpenAI-shaped error object: ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": kind, "code": status}}
