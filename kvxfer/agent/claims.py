"""A consumer's claims on producer ranks: sent together, collected, given back (layer: agent; talks to peers only through ``PeerDirectory``/``PeerLink``, never to the backend or a socket).

A read claims its blocks on every producer rank it depends on before it may report success:
``send_many`` puts every rank's claim on the wire at once (the round trips overlap each other and
whatever the read does next), ``answers`` collects them once they are in (``ready`` says when,
without waiting) and keeps the grants, and a refusal or a lost rank gives every other grant back.

Giving a grant back (``give_back``, ``undo``, the other ranks of a refused claim) tells the
producer rank to release the request, a round trip that may wait on a dead or frozen peer for a
whole handshake timeout: it never runs on the thread that asks. It is handed to ``defer`` with
the producer instance's lane key, so it runs on that producer's lane thread, in order with the
reads queued there after it. ``abort_at`` (``Agent.abort``) tells one rank at once; with
``same_engine`` only the engine that granted it is told (a producer restarted since never did).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from kvxfer.agent.peers import PeerDirectory, PeerLink
from kvxfer.errors import KvxferError, LeaseExpiredError
from kvxfer.protocol import Abort, Claim, ClaimBatch, Grant, Refuse, pack_id_lists
from kvxfer.types import AbortOutcome

__all__ = ["Claims", "lane_key"]

log = logging.getLogger("kvxfer.agent")


class Claims:
    """The claims of one consumer agent (thread-safe).

    Args:
        peers: the agent's links.
        engine_id: this consumer's engine id (named in every claim and abort).
        timeout: seconds for one side-channel round trip (``AgentConfig.handshake_timeout``).
        defer: ``defer(key, fn)`` runs ``fn()`` later on the lane of ``key`` (a producer
            instance's address); default: at once, on the calling thread.
    """

    def __init__(self, peers: PeerDirectory, engine_id: str, timeout: float,
                 defer: Callable[[tuple, Callable[[], object]], None] | None = None) -> None:
        self._peers, self._engine_id, self._timeout = peers, engine_id, timeout
        self._defer = defer or (lambda key, fn: fn())
        self._granted: dict[str, list[PeerLink]] = {}
        self._lanes: dict[str, tuple] = {}  # request id -> the lane key its claim was sent for
        self._lock = threading.Lock()

    def send(self, request_id: str, remote_ids: np.ndarray, links: list[PeerLink], window: float = 0.0,
             timeout: float | None = None, lane: tuple | None = None) -> list:
        """Send the claim to every rank now; returns ``(link, PendingAnswer or the error its send
        raised)`` for ``answers``. ``timeout`` bounds the wait for each answer (default: the
        agent's round-trip timeout; a read passes what is left of its own timeout). ``lane``:
        the producer instance's lane key its give-backs run on (default: the first rank's)."""
        return self.send_many([(request_id, remote_ids, window)], links, timeout, lane)[0]

    def send_many(self, items: list[tuple[str, np.ndarray, float]], links: list[PeerLink],
                  timeout: float | None = None, lane: tuple | None = None) -> list[list]:
        """Claim many requests ``(request_id, remote_ids, window)`` on every rank of ``links`` at once:
        one ``ClaimBatch`` per rank that answers them (``PeerInfo.batch_claims``), else one ``Claim``
        per request. Returns, per item, the ``sent`` list ``answers`` takes."""
        wait = self._timeout if timeout is None else timeout
        self._note_lanes(items, lane if lane is not None else lane_key(links[0]) if links else None)
        out: list[list] = [[] for _ in items]
        # Each pending answer holds its link: take links in one global order, so two reads
        # claiming from the same ranks at once never wait on each other crosswise.
        made: dict[bool, list] = {}  # the claims, made once per form (packed ids or listed)
        for link in sorted(links, key=lambda lk: (lk.host, lk.port)):
            form = bool(link.info.packed_ids)
            claims = made.get(form)
            if claims is None:
                claims = made[form] = self._claims(items, form)
            if link.info.batch_claims and len(claims) > 1:
                try:
                    shared = _SharedReply(link.send(ClaimBatch(claims), wait))
                except KvxferError as exc:
                    for sent in out:
                        sent.append((link, exc))
                    continue
                for i, sent in enumerate(out):
                    sent.append((link, _NthReply(shared, i)))
                continue
            for claim, sent in zip(claims, out):
                try:
                    sent.append((link, link.send(claim, wait)))
                except KvxferError as exc:
                    sent.append((link, exc))
        return out

    def try_send_many(self, items: list[tuple[str, np.ndarray, float]], link: PeerLink,
                      timeout: float, lane: tuple | None = None) -> list[list] | None:
        """``send_many`` to one rank, only where that cannot wait on the peer (``PeerLink.try_send``):
        the ``sent`` lists, or None with nothing sent (then ``send_many`` does it). ``lane``: as
        ``send``'s (the producer instance's lane key; default: this rank's)."""
        self._note_lanes(items, lane if lane is not None else lane_key(link))
        claims = self._claims(items, bool(link.info.packed_ids))
        batch = link.info.batch_claims and len(claims) > 1
        if not batch and len(claims) > 1:
            return None  # an older peer: one message per claim, sent by the lane
        pending = link.try_send(ClaimBatch(claims) if batch else claims[0], timeout)
        if pending is None:
            return None
        if not batch:
            return [[(link, pending)]]
        shared = _SharedReply(pending)
        return [[(link, _NthReply(shared, i))] for i in range(len(claims))]

    def _note_lanes(self, items: list, lane: tuple | None) -> None:
        if lane is None:
            return
        with self._lock:
            for item in items:
                self._lanes[item[0]] = lane

    def ready(self, sent: list, wait: float = 0.0) -> bool:
        """Whether every answer of ``sent`` is in (``answers`` then never waits on a peer), after
        waiting at most ``wait`` seconds for the first one still out. Never raises."""
        for _, pending in sent:
            if isinstance(pending, KvxferError):
                continue
            if not pending.ready(wait):
                return False
        return True

    def _claims(self, items: list[tuple[str, np.ndarray, float]], packed: bool) -> list[Claim]:
        """The claims of ``items``: ids packed in one pass for a current peer, listed for an older one."""
        ids = pack_id_lists([remote_ids for _, remote_ids, _ in items]) if packed else [None] * len(items)
        return [self._claim(rid, remote_ids, window, p) for (rid, remote_ids, window), p in zip(items, ids)]

    def _claim(self, request_id: str, remote_ids: np.ndarray, window: float, packed: bytes | None) -> Claim:
        """The claim of one request: ids ``packed`` for a current peer (``pack_ids``), listed for
        an older one or where they do not pack (None)."""
        if packed is not None:
            return Claim(request_id, [], self._engine_id, window, packed)
        return Claim(request_id, remote_ids.tolist(), self._engine_id, window)

    def answers(self, request_id: str, sent: list) -> float | None:
        """Collect the answers of ``send`` and keep the grants; if any rank refused or was lost,
        give the other grants back and raise (``LeaseExpiredError`` for a refusal, else the
        rank's error, e.g. ``PeerLostError``). Returns the shortest window the ranks granted
        (``Grant.lease_remaining``, seconds from their receipt of the claim), None where none
        says one."""
        links = [link for link, _ in sent]
        replies = [_answer(pending) for _, pending in sent]
        granted = [link for link, reply in zip(links, replies) if isinstance(reply, Grant)]
        for link, reply in zip(links, replies):
            if isinstance(reply, Grant):
                continue
            self.abort_links(request_id, granted)
            if isinstance(reply, KvxferError):
                raise reply
            if isinstance(reply, Refuse):
                raise LeaseExpiredError(f"producer {link.engine_id} refused {request_id!r}: {reply.reason}")
            raise LeaseExpiredError(f"producer {link.engine_id} answered the claim with {type(reply).__name__}")
        with self._lock:
            self._granted[request_id] = granted
        return min((reply.lease_remaining for reply in replies if reply.lease_remaining > 0), default=None)

    def undo(self, request_id: str, sent: list) -> None:
        """A claim the read no longer wants: on its lane (never here), collect its answers and
        give back every grant."""
        def run() -> None:
            try:
                self.answers(request_id, sent)
            except KvxferError:
                return  # the other grants were given back already
            self.give_back(request_id)

        self._defer(self._lane_of(request_id, sent[0][0] if sent else None), run)

    def pop(self, request_id: str) -> list[PeerLink] | None:
        """Forget ``request_id``'s grants (its read ended); returns the ranks that granted it."""
        with self._lock:
            return self._granted.pop(request_id, None)

    def pop_many(self, request_ids: list[str]) -> None:
        """``pop`` for ended reads (a step's), under one hold of the lock."""
        granted = self._granted
        with self._lock:
            for request_id in request_ids:
                granted.pop(request_id, None)

    def give_back(self, request_id: str) -> None:
        """Release ``request_id`` at every rank that granted it (the read will not happen), on the
        producer's lane: this returns at once."""
        self.abort_links(request_id, self.pop(request_id) or [])

    def abort_links(self, request_id: str, links: list[PeerLink]) -> None:
        """Tell each of ``links`` to release ``request_id``, on the producer's lane (returns at once)."""
        if not links:
            return
        key = self._lane_of(request_id, links[0])

        def run() -> None:
            for link in links:
                self.abort_at(link, request_id, same_engine=True)

        self._defer(key, run)

    def _lane_of(self, request_id: str, link: PeerLink | None) -> tuple | None:
        with self._lock:
            key = self._lanes.get(request_id)
            if len(self._lanes) > 4096:  # forget the oldest: without its key a give-back runs on its rank's lane
                for old in list(self._lanes)[:1024]:
                    del self._lanes[old]
        return key if key is not None else (lane_key(link) if link is not None else None)

    def abort_at(self, link: PeerLink, request_id: str, same_engine: bool = False) -> AbortOutcome:
        """Tell one producer rank to release ``request_id``; never raises (the outcome says what
        happened). ``same_engine``: only the engine of ``link``, e.g. undoing its own grant."""
        ask = lambda lk: lk.ask(Abort(request_id, self._engine_id), self._timeout)  # noqa: E731
        try:
            reply = self._peers.call(link.host, link.port, ask,
                                     engine_id=link.engine_id if same_engine else None)
        except KvxferError as exc:
            log.warning("abort of %r at %s: %s", request_id, link.engine_id, exc)
            return AbortOutcome.UNREACHABLE
        if isinstance(reply, Refuse):
            log.warning("abort of %r refused by %s: %s", request_id, link.engine_id, reply.reason)
            return AbortOutcome.REFUSED
        return AbortOutcome.RELEASED if getattr(reply, "released", True) else AbortOutcome.NOT_HELD

    def ask_engine(self, link: PeerLink, message):
        """``message`` to ``link``'s engine on its session (one fresh handshake if the session was
        lost; a restarted peer, another engine, is not asked: PeerLostError)."""
        return self._peers.call(link.host, link.port, lambda lk: lk.ask(message, self._timeout),
                                engine_id=link.engine_id)


class _SharedReply:
    """The one answer of a ``ClaimBatch``, taken once and shared by its claims."""

    def __init__(self, pending) -> None:
        self._pending = pending
        self._reply = None
        self._lock = threading.Lock()

    def reply(self, index: int):
        with self._lock:
            if self._reply is None:
                self._reply = _answer(self._pending)
        reply = self._reply
        if isinstance(reply, (KvxferError, Refuse)):
            return reply  # the whole batch failed or was refused: every claim shares it
        # a Grants, checked by the session against the batch (``ClientSession.response``): one
        # reply per claim, in order, each naming its claim's request
        return reply.replies[index]

    def ready(self, wait: float = 0.0) -> bool:
        """Whether ``reply`` returns at once. False while another thread is taking the answer: it
        may be waiting on the peer (a give-back of one claim of the batch, on its lane), and a
        poller of another claim must not queue behind it."""
        if self._reply is not None or isinstance(self._pending, KvxferError):
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._reply is not None or self._pending.ready(wait)
        finally:
            self._lock.release()

    def cancel(self) -> None:
        self._pending.cancel()


class _NthReply:
    """One claim's share of a ``_SharedReply`` (what ``answers`` expects of a pending answer)."""

    def __init__(self, shared: _SharedReply, index: int) -> None:
        self._shared, self._index = shared, index

    def answer(self):
        reply = self._shared.reply(self._index)
        if isinstance(reply, KvxferError):
            raise reply
        return reply

    def ready(self, wait: float = 0.0) -> bool:
        return self._shared.ready(wait)

    def cancel(self) -> None:
        self._shared.cancel()


def lane_key(link: PeerLink) -> tuple:
    """The lane key of ``link``'s producer instance: its rank 0's address (ranks use consecutive
    ports, ``rank_port``), the key its reads queue under, so a give-back runs in order with them
    whichever rank it is for."""
    spec = getattr(link, "spec", None)
    rank = getattr(spec, "tp_rank", 0) if spec is not None else 0
    return (link.host, link.port - rank)


def _answer(pending):
    """A ``PendingAnswer``'s reply, or the error it (or its send) raised."""
    if isinstance(pending, KvxferError):
        return pending
    try:
        return pending.answer()
    except KvxferError as exc:
        return exc
