"""kv_transfer_params in vLLM's field names, for every engine adapter (layer: engine-facing helper; standard library only).

The prefill side answers with ``producer_answer``; the decode side reads a peer's answer with
``RemotePrefill.parse``. The fields are exactly those vLLM's KvxferConnector writes and reads,
so a ``kvxfer-hf`` server and a vLLM server can prefill for each other behind the unchanged
``kvxfer proxy``; a new engine's adapter uses the same two functions. Values come from clients: checked with exceptions, never ``assert``.

``remote_block_ids`` is vLLM's form: one list per KV-cache group (``[[4, 5]]`` for one group;
vLLM's NixlConnector sends its transfer groups' lists, a sliding group's clipped to its window,
a state group's to the slot holding the running state). A state group's slots travel as that
group's list; nothing else carries them. A cache of several groups parses with ``num_groups``
and reads ``RemotePrefill.groups``; without it, several groups are refused as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

#: Keys a decode instance needs to pull a request's blocks.
REQUIRED = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port")

#: What vLLM's KvxferConnector writes in ``transfer_mode`` (the decoder pulls).
TRANSFER_MODE = "kvxfer-pull"


class BadParams(ValueError):
    """kv_transfer_params that cannot be used (names the field and what was wrong)."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """This instance prefills; a decode instance will pull the blocks."""
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """This instance decodes a prompt whose KV was computed elsewhere."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadParams(f"{name} must be an integer {bound}; got {value!r}")
    return value


def _ids(raw: Any, name: str) -> tuple[int, ...]:
    if not isinstance(raw, (list, tuple)):
        raise BadParams(f"{name} must be a list; got {type(raw).__name__}")
    return tuple(_int(b, f"{name}[i]", 0, (1 << 63) - 1) for b in raw)


def _block_ids(raw: Any, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """One id tuple per group from vLLM's one-list-per-group form (``[[1, 2], [7]]``), or, for one
    group, a flat list as older peers send."""
    if not isinstance(raw, (list, tuple)):
        raise BadParams(f"remote_block_ids must be a list; got {type(raw).__name__}")
    nested = bool(raw) and all(isinstance(g, (list, tuple)) for g in raw)
    if not nested:
        if num_groups != 1:
            raise BadParams(f"remote_block_ids must hold one list per KV-cache group: expected {num_groups} "
                            f"lists; got a flat list")
        return (_ids(raw, "remote_block_ids"),)
    if len(raw) != num_groups:
        what = "only 1 is supported" if num_groups == 1 else f"expected {num_groups}"
        raise BadParams(f"remote_block_ids has {len(raw)} KV-cache groups; {what}")
    return tuple(_ids(g, f"remote_block_ids[{i}]") for i, g in enumerate(raw))


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prefilled prompt's blocks are: the producer's request id, side channel and block ids.

    ``num_tokens`` is ``remote_num_tokens``: the prompt tokens whose KV the producer computed
    (None: the whole prompt). ``groups``: one id tuple per KV-cache group (block ids, or a state
    group's slots); ``block_ids`` is the first group's (the only one of a one-group cache).
    ``block_size`` is ``remote_block_size``: tokens per producer block (None: the producer did
    not say; older producers and vLLM's NixlConnector).
    """

    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int | None = None
    engine_id: str | None = None
    tp_size: int = 1
    groups: tuple[tuple[int, ...], ...] = ()
    block_size: int | None = None
    hold_token: tuple[int, int, int] | None = None  # ``remote_hold_token``: (slot, epoch, tag), or None

    def __post_init__(self) -> None:
        if not self.groups:   # built by hand with block ids alone: one group
            object.__setattr__(self, "groups", (tuple(self.block_ids),))

    @classmethod
    def parse(cls, params: Mapping[str, Any], num_groups: int = 1) -> "RemotePrefill":
        """Read a producer's answer for a cache of ``num_groups`` KV-cache groups.

        Raises:
            BadParams: a required field missing or malformed; ``remote_block_ids`` not one list
                per group (names both counts); ``pp_size`` other than 1 (pipeline parallelism).
        """
        num_groups = _int(num_groups, "num_groups", 1)
        if not isinstance(params, Mapping):
            raise BadParams(f"kv_transfer_params must be an object; got {type(params).__name__}")
        missing = [k for k in REQUIRED if params.get(k) in (None, "")]
        if missing:
            raise BadParams(f"kv_transfer_params lack {missing}")
        request_id, host = params["remote_request_id"], params["remote_host"]
        if not isinstance(request_id, str):
            raise BadParams(f"remote_request_id must be a string; got {request_id!r}")
        if not isinstance(host, str):
            raise BadParams(f"remote_host must be a string; got {host!r}")
        port = _int(params["remote_port"], "remote_port", 1, 65535)
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None:
            num_tokens = _int(num_tokens, "remote_num_tokens", 0)
        tp_size = _int(params.get("tp_size", 1), "tp_size", 1)
        pp_size = params.get("pp_size", 1)
        if pp_size is not None and _int(pp_size, "pp_size", 1) != 1:
            raise BadParams(f"pipeline parallelism is not supported: pp_size must be 1; got {pp_size}")
        engine_id = params.get("remote_engine_id")
        block_size = params.get("remote_block_size")
        if block_size is not None:
            block_size = _int(block_size, "remote_block_size", 1)
        groups = _block_ids(params["remote_block_ids"], num_groups)
        token = params.get("remote_hold_token")
        if token is not None:
            if not isinstance(token, (list, tuple)) or len(token) != 3:
                raise BadParams(f"remote_hold_token must be [slot, epoch, tag]; got {token!r}")
            token = (_int(token[0], "remote_hold_token[0]", 0, (1 << 64) - 1),
                     _int(token[1], "remote_hold_token[1]", 1, (1 << 64) - 1),
                     _int(token[2], "remote_hold_token[2]", 0, (1 << 64) - 1))
        return cls(request_id, host, port, groups[0], num_tokens,
                   engine_id if isinstance(engine_id, str) else None, tp_size, groups, block_size, token)

    def tokens_available(self, prompt_len: int) -> int:
        """Prompt tokens whose KV the producer holds (all of the prompt unless it said fewer)."""
        return prompt_len if self.num_tokens is None else min(self.num_tokens, prompt_len)


def _answer_groups(block_ids: Any) -> list[list[int]]:
    """vLLM's one-list-per-group form of a flat list (one group) or of one list per group."""
    if not isinstance(block_ids, (list, tuple)):
        raise BadParams(f"block_ids must be a list of ids or one list per group; got {type(block_ids).__name__}")
    if block_ids and all(isinstance(g, (list, tuple)) for g in block_ids):
        return [list(_ids(g, f"block_ids[{i}]")) for i, g in enumerate(block_ids)]
    return [list(_ids(block_ids, "block_ids"))]


def producer_answer(*, request_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]], engine_id: str,
                    host: str, port: int, tp_size: int, num_tokens: int,
                    block_size: int | None = None, hold_token: Sequence[int] | None = None) -> dict[str, Any]:
    """The kv_transfer_params a prefill instance returns (vLLM's KvxferConnector answers the same fields).

    ``block_ids``: the ids of a one-group cache, or one list per KV-cache group (block ids, a
    state group's slots), already cut to what moves (a sliding group's window). ``block_size``
    (tokens per block of ``block_ids``) lets a decoder with other blocks choose which tokens to
    load before it allocates (``remote_block_size``; omitted when None). ``hold_token``: the
    producer's ``HoldToken.wire()`` for the request (``remote_hold_token``; omitted when None): a
    decoder that reads exactly ``block_ids`` with it needs no claim (docs/reliability.md, "hold
    tokens"); older decoders ignore the field.

    Raises:
        BadParams: ids that are not lists of non-negative integers (names the list).
    """
    answer = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": _answer_groups(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": TRANSFER_MODE,
    }
    if block_size is not None:
        answer["remote_block_size"] = block_size
    if hold_token is not None:
        if not isinstance(hold_token, (list, tuple)) or len(hold_token) != 3:
            raise BadParams(f"hold_token must be [slot, epoch, tag]; got {hold_token!r}")
        answer["remote_hold_token"] = [_int(v, "hold_token[i]", 0, (1 << 64) - 1) for v in hold_token]
    return answer
