"""What the scheduler-side connector tells the workers each step, and what the workers tell it once at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass(frozen=True)
class LoadOrder:
    """Pull ``remote_blocks`` of the producer's ``remote_request_id`` into ``local_blocks`` (same order).

    ``num_tokens``: the tokens the load moves where the two lists' last blocks are partial and
    cover different tokens (blocks of another size at the producer); None: both lists cover the
    same tokens and move whole."""

    request_id: str                 # this (decode) instance's request id
    remote_request_id: str
    host: str
    port: int
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    remote_tp_size: int = 1
    num_tokens: int | None = None
    hold_token: tuple[int, int, int] | None = None  # the producer's ``remote_hold_token``: read without a claim


@dataclass(frozen=True)
class ReleaseOrder:
    """Tell the producer at host:port to drop its hold on ``remote_request_id`` (nothing will be read)."""

    remote_request_id: str
    host: str
    port: int


@dataclass(frozen=True)
class HeartbeatOrder:
    """Extend the producer's hold on ``remote_request_ids``: their decode requests still wait in this queue."""

    host: str
    port: int
    remote_request_ids: tuple[str, ...]


@dataclass
class StepOrders(KVConnectorMetadata):
    """One step's orders for every worker.

    Producer side: ``holds`` (request id -> block ids to keep readable, issued in the step that
    completes the prompt, so the hold exists before the answer leaves; a decode instance's
    blocks kept for the next turn in the step after the request finished), ``hold_leases``
    (request id -> the lease of that hold, where not the agent's own), ``tokens`` (a hold's
    token, chosen here so that the answer can carry it: every worker writes the same one), ``kept`` (requests whose
    blocks vLLM keeps until the workers report them sent), ``dropped`` (holds to release:
    the request did not end in a way that hands its KV on).
    Consumer side: ``loads`` to start, ``releases`` to send, ``cancels`` (own request ids whose
    in-flight load must stop: the request was aborted), ``heartbeats`` to send (vLLM's
    kv_lease_duration contract: requests queued here keep their producer's hold).
    """

    holds: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hold_leases: dict[str, float] = field(default_factory=dict)   # seconds, where not the agent's lease
    tokens: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # the holds' tokens (``TokenBook``)
    kept: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    loads: list[LoadOrder] = field(default_factory=list)
    releases: list[ReleaseOrder] = field(default_factory=list)
    cancels: set[str] = field(default_factory=set)
    heartbeats: list[HeartbeatOrder] = field(default_factory=list)


@dataclass
class WorkerAddress(KVConnectorHandshakeMetadata):
    """A worker's side-channel address and agent id, collected by vLLM for the scheduler-side connector."""

    host: str
    port: int
    engine_id: str
    tp_rank: int = 0
