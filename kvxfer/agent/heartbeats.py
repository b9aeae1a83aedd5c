"""What a consumer tells producers outside a read: aborts and keepalives (layer: agent).

Both reach every producer rank a request depends on, give a lost session one fresh handshake,
and never raise for the producer's state: they return what happened (``AbortOutcome``,
``KeepaliveResult``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from kvxfer.errors import ClosedError, KvxferError
from kvxfer.protocol import Heartbeat
from kvxfer.types import AbortOutcome, KeepaliveResult

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["send_keepalive", "tell_abort"]

log = logging.getLogger("kvxfer.agent")


def tell_abort(agent: "AgentParts", request_id: str, remote, links) -> AbortOutcome:
    """Tell the producer ranks (``links``, or those of the instance at ``remote``) to release
    ``request_id``; the worst rank's outcome (NOT_TOLD: nobody to tell)."""
    if links is None and remote is not None:
        try:
            links = [link for group in agent.links_for(remote) for link in group]
        except KvxferError as exc:
            log.warning("abort of %r at %s:%s: %s", request_id, remote[0], remote[1], exc)
            return AbortOutcome.UNREACHABLE
    if not links:
        return AbortOutcome.NOT_TOLD
    return AbortOutcome.combine([agent.claims.abort_at(link, request_id) for link in links])


def send_keepalive(agent: "AgentParts", remote: tuple[str, int], request_ids: Sequence[str]) -> KeepaliveResult:
    """``Agent.keepalive``: one heartbeat to every rank of the instance at ``remote`` this rank
    depends on. Raises ClosedError only."""
    beat = Heartbeat(list(request_ids), agent.engine_id)
    try:
        links = [link for group in agent.links_for(remote) for link in group]
    except KvxferError as exc:
        log.warning("keepalive at %s:%s: %s", remote[0], remote[1], exc)
        return KeepaliveResult(unreachable=((remote[0], int(remote[1])),))
    asked = set(beat.request_ids)
    gone: set[str] = set()
    unreachable: list[tuple[str, int]] = []
    for link in links:
        try:
            ack = agent.peers.call(link.host, link.port,
                                    lambda lk: lk.ask(beat, agent.config.handshake_timeout))
        except ClosedError:
            raise
        except KvxferError as exc:
            log.warning("keepalive at %s (%s:%d): %s", link.engine_id, link.host, link.port, exc)
            unreachable.append((link.host, link.port))
            continue
        gone.update(rid for rid in ack.gone if rid in asked)  # a rank speaks only for what it was asked
    return KeepaliveResult(tuple(sorted(gone)), tuple(unreachable))
