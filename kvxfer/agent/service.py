"""What a producer answers on its side channel: claims, heartbeats, aborts (layer: agent).

Each connected consumer gets its own sans-IO ``ServerSession``; after the handshake its
requests land here and are applied to the agent's lease table. Peer input never raises
out of here: bad requests get a ``Refuse`` and change nothing.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.engine.leases import ClaimResult
from kvxfer.errors import KvxferError, ProtocolError
from kvxfer.transport.sessions import LogLimiter
from kvxfer.types import ReleaseOutcome, ReleaseReason
from kvxfer.layout import expected_notifications
from kvxfer.protocol import (
    Abort, Ack, Announce, Claim, ClaimBatch, Done, Grant, Grants, Heartbeat, HeartbeatAck, PackRequest, PeerInfo,
    Refuse, ServerSession, WritesDone, claim_blocks,
)
from kvxfer.agent.announce import Announcement

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["ProducerService"]

log = logging.getLogger("kvxfer.agent")


class ProducerService:
    """Serves one agent's side channel."""

    def __init__(self, agent: "AgentParts") -> None:
        self._agent = agent
        self._granted: dict[str, set[str]] = {}   # consumer engine id -> request ids granted to it
        self._expected: dict[int, int] = {}       # consumer TP size -> notifications a read brings
        self._lock = threading.Lock()
        # Refusals are a peer's to cause at will: one INFO line per kind per 10 s, with a count.
        self._refusals = LogLimiter(log, level=logging.INFO, prefix="producer")

    def pinned(self, session: ServerSession) -> bool:
        """Whether ``session``'s consumer has claims in flight here: a request granted to it is
        still held. The transport never evicts such a session."""
        peer = session.peer
        if peer is None:
            return False
        with self._lock:
            granted = self._granted.get(peer.engine_id)
            if not granted:
                return False
            granted &= {rid for rid in granted if self._agent.leases.held(rid)}
            if not granted:
                del self._granted[peer.engine_id]
            return bool(granted)

    def _note_grant(self, engine_id: str, request_id: str) -> None:
        leases = self._agent.leases
        with self._lock:
            self._granted.setdefault(engine_id, set()).add(request_id)
            if sum(map(len, self._granted.values())) > 2 * len(leases) + 64:  # forget released ones
                for engine in list(self._granted):
                    self._granted[engine] = {rid for rid in self._granted[engine] if leases.held(rid)}
                    if not self._granted[engine]:
                        del self._granted[engine]

    def _claim(self, message: Claim, peer: PeerInfo | None) -> Grant | Refuse:
        """Grant or refuse one claim (a ``Claim``, or one of a ``ClaimBatch``)."""
        leases = self._agent.leases
        consumer_tp = peer.spec.tp_size if peer is not None else 1
        expected = self._expected.get(consumer_tp)
        if expected is None:
            try:
                expected = self._expected[consumer_tp] = expected_notifications(self._agent.spec, consumer_tp)
            except KvxferError as exc:
                return Refuse(message.request_id, f"incompatible consumer TP size {consumer_tp}: {exc}")
        try:
            blocks = claim_blocks(message)
        except ProtocolError as exc:
            result = ClaimResult(False, str(exc))
        else:
            result = leases.claim(message.request_id, message.engine_id, blocks, expected,
                                  window=message.window)
        if not result.granted:
            self._refusals.event("claim", f"refused claim of {message.request_id!r} by "
                                          f"{message.engine_id}: {result.reason}")
            return Refuse(message.request_id, result.reason)
        self._note_grant(message.engine_id, message.request_id)
        return Grant(message.request_id, result.lease_remaining)

    def _announce(self, message: Announce) -> Ack | Refuse:
        """Record a consumer's announce (its block ids are checked against its cache by the write's
        plan, when the producer writes)."""
        if not message.listen_host:
            return Refuse(message.request_id, "announce without the consumer's listen_host")
        blocks = np.asarray(message.block_ids, dtype=np.int64)
        self._agent.announced.add(Announcement(message.request_id, message.engine_id,
                                                (message.listen_host, message.listen_port), blocks,
                                                message.payload))
        self._agent.reports.forget(message.request_id)
        return Ack()

    def make_session(self) -> ServerSession:
        """A fresh server session for a new client identity (called by the transport).

        Its request callback reaches the session through a weak reference: a strong one would
        close a cycle (session -> callback -> session) that keeps a closed session and its peer's
        ``PeerInfo`` (up to 512 KiB of backend metadata) alive until the cyclic collector runs.
        """
        def on_request(message):
            return self.handle(message, ref().peer)  # only ever called by the live session itself

        session = ServerSession(self._agent.codec, self._agent.peer_info(), on_request=on_request)
        ref = weakref.ref(session)
        return session

    def handle(self, message, peer: PeerInfo | None):
        """Apply one request from a handshaken consumer; returns the reply message."""
        leases = self._agent.leases
        if isinstance(message, Claim):
            return self._claim(message, peer)
        if isinstance(message, ClaimBatch):  # each claim judged alone, as if it came by itself
            return Grants([self._claim(claim, peer) for claim in message.claims])
        if isinstance(message, Heartbeat):
            alive, gone = leases.heartbeat(message.request_ids, message.engine_id)
            return HeartbeatAck(alive, gone)
        if isinstance(message, Abort):
            ann = self._agent.announced.cancel(message.request_id, message.engine_id)
            if ann is not None:  # a push not yet ended: its streams to that consumer stop here
                self._agent.announced.stop_streams(message.request_id, ann.remote)
                self._agent.reports.released(message.request_id, ReleaseReason.ABORTED.value)
                return Ack(released=True)
            if not leases.may_act(message.request_id, message.engine_id):  # the hold names other engines
                self._refusals.event("abort", f"refused abort of {message.request_id!r} by "
                                              f"{message.engine_id}: held for other consumer engines")
                return Refuse(message.request_id, f"request {message.request_id!r} is held for other consumer "
                                                  f"engines, not {message.engine_id!r}")
            outcome = leases.release(message.request_id, ReleaseReason.ABORTED, consumer=message.engine_id)
            # The wire keeps its bool: True when this abort ended the hold (now or once windows close).
            return Ack(released=outcome in (ReleaseOutcome.FREE_NOW, ReleaseOutcome.FREE_WHEN_FINISHED))
        if isinstance(message, Done):  # same effect as the completion notification of a NIXL read
            ids = (message.request_id, *message.more)
            epochs = message.epochs if len(message.epochs) == len(ids) else [0] * len(ids)
            for request_id, epoch in zip(ids, epochs):
                leases.done(request_id, message.engine_id, epoch)  # an earlier hold's epoch: nothing
            return Ack()
        if isinstance(message, Announce):
            return self._announce(message)
        if isinstance(message, WritesDone):
            why = self._agent.reports.writes_done(message.request_id, message.engine_id, message.writes, message.aux,
                                                   error=message.error)
            return Ack() if why is None else Refuse(message.request_id, why)
        if isinstance(message, PackRequest):
            paths = self._agent.paths
            packer = paths.packer if paths is not None else None
            if packer is None or peer is None:
                return Refuse(message.request_id, "producer-side packing is not enabled on this agent")
            return packer.handle(message, peer)  # typed errors for hostile input become a Reject
        return Refuse(getattr(message, "request_id", "?") or "?", f"unexpected {type(message).__name__}")
