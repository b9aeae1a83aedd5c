"""Which reads go by their hold token instead of a claim, and their look at the word (layer: agent).

A read that carries a ``HoldToken`` (``ReadRequest.token``) moves at once and succeeds only if the
producer's hold word still equals the token once the move has completed (docs/reliability.md,
"hold tokens"): ``TokenReads.verifier`` gives the engine that look (``_Request.verify``): a load
from the mapped table on this host, or one small NIXL READ of the word on another host
(``kvxfer.engine.remotewords``). The token is used only where it proves what the claim would: the
producer announced its table (``PeerInfo.hold_words`` on this host, ``hold_words_addr`` for NIXL),
and this rank is the only consumer rank that reads
or depends on that producer rank (an unclaimed hold then counts one done, as a first claim
would). Elsewhere the read claims, as before. A token whose tag is not ``hold_tag(request id,
the read's remote ids)`` fails the read before anything moves or is sent.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvxfer.engine.holdwords import WordView, hold_tag
from kvxfer.engine.remotewords import RemoteWordView, WordReader
from kvxfer.engine.transfers import LOOKING
from kvxfer.errors import ConfigError, KvxferError, LeaseExpiredError
from kvxfer.layout import expected_notifications
from kvxfer.layout.request import check_block_ids
from kvxfer.types import HoldToken

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["TokenReads", "reserve_token", "tag_error"]

log = logging.getLogger("kvxfer.agent")


def tag_error(request_id: str, token: HoldToken, remote_ids) -> LeaseExpiredError | None:
    """Why ``token`` cannot prove a hold of ``remote_ids`` for ``request_id`` (None when it can)."""
    tag = hold_tag(request_id, remote_ids)
    if tag == token.tag:
        return None
    return LeaseExpiredError(
        f"request {request_id!r}: its hold token (slot {token.slot}, epoch {token.epoch}) was not given for "
        f"this request and these {len(remote_ids)} remote blocks (tag {token.tag:#x}, expected {tag:#x}): "
        "nothing was read or sent")


def reserve_token(words, request_id: str, block_ids, num_blocks: int, token, named) -> None:
    """``Agent.hold(..., token=)``'s checks and reservation (``HoldWords.reserve``); raises
    ``BlockIdError`` for bad ids and ``ConfigError`` for the token, naming the value, changing nothing."""
    ids = check_block_ids("held", block_ids, num_blocks)
    if words is None:
        raise ConfigError(f"request {request_id!r}: a hold token needs this agent's table of hold words "
                          "(AgentConfig.hold_words is 0)")
    if named:
        raise ConfigError(f"request {request_id!r}: a hold naming consumer engines takes no token (its reads "
                          f"claim, so the names are checked); got token {token!r}")
    words.reserve(request_id, token, ids)


class TokenReads:
    """The consumer's maps of its producers' tables (one per producer engine on this host)."""

    def __init__(self, agent: "AgentParts") -> None:
        self._agent = agent
        self._views: dict[str, object] = {}      # engine id -> WordView, RemoteWordView or None
        self._words_reader: WordReader | None = None
        self._lock = threading.Lock()

    #: Map a same-host producer's table (False: look at it over NIXL as across hosts; tests use it)
    map_same_host = True

    def view(self, link):
        """The producer's table when a token read of it proves its hold, else None: a map of the
        file on this host (``WordView``), or across hosts a ``RemoteWordView`` (one NIXL READ of the
        word per read, issue 35)."""
        agent, info = self._agent, link.info
        if not info.hold_slots or agent.paths is None:
            return None
        here = bool(info.hold_words and info.host_id and info.host_id == agent.paths.kit.host_id
                    and self.map_same_host)
        if not here and not info.hold_words_addr:
            return None
        key = info.engine_id
        with self._lock:
            if key in self._views:
                return self._views[key]
        try:
            ones = expected_notifications(link.spec, agent.spec.tp_size) == 1
        except KvxferError:
            ones = False
        view = None
        if ones and here:
            try:
                view = WordView(info.hold_words, info.hold_slots)
            except (OSError, KvxferError) as exc:
                log.info("kvxfer: hold words of %s not readable here (%s): looked at over NIXL", key, exc)
        if ones and view is None and info.hold_words_addr:
            try:
                view = self._reader().view(link.agent_name, info.hold_words_addr, info.hold_slots)
            except KvxferError as exc:
                log.info("kvxfer: hold words of %s cannot be looked at (%s): its reads claim", key, exc)
        with self._lock:
            if key not in self._views:
                self._views[key] = view
                # a closed link (a restarted producer, a lost session) drops its map: the reads still
                # moving keep theirs through their verifier, and the map goes with the last of them
                link.on_close.append(lambda: self._forget(key))
            return self._views[key]

    def _reader(self) -> WordReader:
        """This agent's landing rows for looks across hosts (registered on first use)."""
        with self._lock:
            if self._words_reader is None:
                agent = self._agent
                self._words_reader = WordReader(agent.backend, agent.registry)
            return self._words_reader

    def _forget(self, key: str) -> None:
        with self._lock:
            self._views.pop(key, None)

    @staticmethod
    def verifier(view, request_id: str, token: HoldToken) -> "Verifier":
        """The engine's look at the word once the move completed (``_Request.verify``)."""
        return Verifier(view, request_id, token)


class Verifier:
    """One token read's look at its producer's word: called by the engine once the move has
    completed (and again while a look across hosts is out: ``LOOKING``), it returns None when
    the word still equals the token, else the read's ``LeaseExpiredError``. ``cancel`` gives up a
    look that is out when the read ends another way. Never waits."""

    def __init__(self, view, request_id: str, token: HoldToken) -> None:
        self._view, self._request_id, self._token = view, request_id, token
        self._look: dict | None = {} if isinstance(view, RemoteWordView) else None
        self._lock = threading.Lock()  # one thread at a time starts or polls the look

    def __call__(self) -> object:
        if self._look is None:
            why = self._view.check(self._token)
        else:
            if not self._lock.acquire(blocking=False):
                return LOOKING  # another poller is looking right now
            try:
                why = self._view.check(self._token, self._look)
            finally:
                self._lock.release()
            if why is None:
                return LOOKING
        return LeaseExpiredError(f"request {self._request_id!r}: {why}") if why else None

    def many(self, verifiers: list) -> list | None:
        """The looks of ``verifiers`` (a step's, this one among them) at once, where each maps the
        same table on this host as this one (one gather of their slots: ``WordView.check_many``);
        each result as ``__call__`` returns it. None where they do not: each then looks on its own."""
        view = self._view
        if self._look is not None or any(type(v) is not Verifier or v._view is not view for v in verifiers):
            return None
        whys = view.check_many([v._token for v in verifiers])
        return [LeaseExpiredError(f"request {v._request_id!r}: {why}") if why else None
                for v, why in zip(verifiers, whys)]

    def cancel(self) -> None:
        if self._look is not None:
            with self._lock:
                RemoteWordView.cancel(self._look)
