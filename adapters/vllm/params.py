"""kv_transfer_params: reading what a client or proxy sent, writing what the prefill instance answers.

Field names are vLLM's (its proxy forwards them unchanged). Values come from clients, so
they are checked with exceptions, never ``assert``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

#: Keys a decode instance needs to pull a request's blocks.
REQUIRED = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port")

TRANSFER_MODE = "kvxfer-pull"


class BadParams(ValueError):
    """kv_transfer_params that cannot be used (names the field and what was wrong)."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """This instance prefills; a decode instance will pull the blocks."""
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """This instance decodes a request whose prompt was prefilled elsewhere."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def _block_ids(raw: Any) -> list[int]:
    """Flat block ids; vLLM sends one list per KV-cache group (``[[1, 2]]``) and older peers a flat list."""
    if not isinstance(raw, (list, tuple)):
        raise BadParams(f"remote_block_ids must be a list; got {type(raw).__name__}")
    if raw and all(isinstance(g, (list, tuple)) for g in raw):
        if len(raw) != 1:
            raise BadParams(f"remote_block_ids has {len(raw)} KV-cache groups; only 1 is supported")
        raw = raw[0]
    out = []
    for b in raw:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise BadParams(f"remote_block_ids must hold non-negative integers; got {b!r}")
        out.append(b)
    return out


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prefilled request's blocks are: the producer's request id, side channel and block ids."""

    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int | None = None
    engine_id: str | None = None
    tp_size: int = 1

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> "RemotePrefill":
        """Raises BadParams when a required field is missing or malformed."""
        missing = [k for k in REQUIRED if params.get(k) in (None, "")]
        if missing:
            raise BadParams(f"kv_transfer_params lack {missing}")
        request_id, host, port = params["remote_request_id"], params["remote_host"], params["remote_port"]
        if not isinstance(request_id, str):
            raise BadParams(f"remote_request_id must be a string; got {request_id!r}")
        if not isinstance(host, str):
            raise BadParams(f"remote_host must be a string; got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise BadParams(f"remote_port must be a TCP port; got {port!r}")
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
            raise BadParams(f"remote_num_tokens must be a non-negative integer; got {num_tokens!r}")
        tp_size = params.get("tp_size", 1)
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise BadParams(f"tp_size must be a positive integer; got {tp_size!r}")
        engine_id = params.get("remote_engine_id")
        return cls(request_id, host, port, tuple(_block_ids(params["remote_block_ids"])),
                   num_tokens or None, engine_id if isinstance(engine_id, str) else None, tp_size)

    def tokens_available(self, prompt_len: int) -> int:
        """Prompt tokens the producer computed (all of the prompt unless it said fewer)."""
        return prompt_len if self.num_tokens is None else min(self.num_tokens, prompt_len)


def producer_answer(*, request_id: str, block_ids: Sequence[int], engine_id: str, host: str,
                    port: int, tp_size: int, num_tokens: int) -> dict[str, Any]:
    """The kv_transfer_params a prefill instance returns; a decode instance consumes them as they are."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": TRANSFER_MODE,
    }
