"""The producer's writes into a consumer's blocks, off the caller's thread (layer: agent).

``Agent.write`` checks its ids, reserves the request in the engine and queues it on the
consumer's lane; ``run_writes`` handshakes there (a new consumer), builds each consumer rank's
byte ranges and posts them. A write has no claim: the consumer asked for it (``expect_writes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.agent.reads import rank_port
from kvxfer.engine.transfers import Part
from kvxfer.errors import KvxferError
from kvxfer.layout import build_plan, peer_ranks

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["PendingWrite", "run_writes"]


@dataclass
class PendingWrite:
    """A write reserved in the engine and queued on its consumer's lane."""

    req: object
    local: np.ndarray
    remote_ids: np.ndarray
    note: bytes
    deadline: float | None


class _Reversed:
    """A RequestPlan seen from the writer: its local side is the plan's remote side."""

    def __init__(self, req) -> None:
        self.local, self.remote = req.remote, req.local
        self.num_bytes, self.staging_bytes = req.num_bytes, 0


def run_writes(agent: "AgentParts", remote: tuple[str, int], writes: list[PendingWrite]) -> None:
    """Post ``writes`` (all to the consumer instance at ``remote``); each ends on its handle."""
    engine = agent.engine
    view = agent.require_cache()
    for w in writes:
        if w.req.finished or w.req.error is not None:
            continue
        try:
            left = None if w.deadline is None else max(1e-3, w.deadline - agent.clock.now())
            timeout = agent.config.handshake_timeout if left is None else min(left, agent.config.handshake_timeout)
            head = agent.peers.get(remote[0], remote[1], timeout=timeout)
            parts = []
            for rank in range(head.spec.tp_size):
                # The instance's ranks share the head's spec but for their rank: skip, without a
                # handshake, every consumer rank that needs no head this rank holds.
                if agent.spec.tp_rank not in peer_ranks(replace(head.spec, tp_rank=rank), agent.spec.tp_size):
                    continue
                link = head if rank == head.spec.tp_rank else agent.peers.get(remote[0], rank_port(head, rank),
                                                                                timeout=timeout)
                if agent.spec.tp_rank not in peer_ranks(link.spec, agent.spec.tp_size):
                    continue
                plan = link.plans.get("write")
                if plan is None:  # a write has no staging step: byte ranges, however small the pieces
                    plan = link.plans["write"] = build_plan(link.view, view, allow_conversion=False, mode="direct")
                parts.append(Part(link.agent_name, _Reversed(plan.for_request(w.remote_ids, w.local)),
                                  link.view.geometry.kind, w.note))
        except KvxferError as exc:
            engine.fail(w.req, exc)
            continue
        with engine.posting([w.req]):
            engine.attach(w.req, parts)
    agent.wake.set()
