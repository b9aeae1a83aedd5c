"""Consumer-first push: the consumer announces where a request's KV must land (layer: agent).

SGLang's model, and any engine whose decode side reserves its blocks before prefill runs: the
consumer calls ``Agent.announce`` (its blocks, its listener, a small engine payload); the producer
finds the announcement with ``Agent.announced`` and pushes with ``Agent.open_writes``. The
consumer's request is received once every announced producer's writes and its ``WritesDone``
(with the aux payload) arrived, or fails typed: a refused or undeliverable announce, or the
announce's deadline passing first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.agent.jobs import LaneJob
from kvxfer.agent.args import address, deadline_for, payload as checked_payload, request_id as checked_id
from kvxfer.config import check_count
from kvxfer.errors import ConfigError, KvxferError, LeaseExpiredError, PeerLostError, TransferFailedError
from kvxfer.layout.request import check_block_ids
from kvxfer.protocol import Announce, Refuse

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["AnnounceJob", "Announcement", "AnnouncementBook", "MAX_ANNOUNCED", "start_announce"]

#: How many announced requests a producer keeps at most (the oldest is dropped first).
MAX_ANNOUNCED = 65_536


@dataclass(frozen=True)
class Announcement:
    """A consumer's announce, as the producer sees it (``Agent.announced``).

    ``remote``: the consumer rank's side-channel address (pass it to ``Agent.open_writes``);
    ``engine_id``: the consumer engine; ``block_ids``: its destination blocks, in request order;
    ``payload``: the consumer engine's own bytes (kvxfer does not read them).
    """

    request_id: str
    engine_id: str
    remote: tuple[str, int]
    block_ids: np.ndarray = field(repr=False)
    payload: bytes = b""


class AnnouncementBook:
    """The producer's announcements by request (thread-safe; bounded by ``MAX_ANNOUNCED`` requests
    and by age: an announcement older than ``max_age`` seconds is forgotten)."""

    def __init__(self, max_age: float, limit: int = MAX_ANNOUNCED, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._by_request: OrderedDict[str, dict[str, tuple[float, Announcement]]] = OrderedDict()
        self._max_age, self._limit, self._clock = max_age, limit, clock
        # this producer's write streams still open, by (request, consumer rank's address): a
        # consumer's abort stops them (``stop_streams``)
        self._streams: dict[tuple[str, tuple[str, int]], list] = {}

    def opened(self, request_id: str, remote: tuple[str, int], stream) -> None:
        """``stream`` (a ``WriteStream``) pushes ``request_id`` to ``remote`` until ``closed``."""
        with self._lock:
            self._streams.setdefault((request_id, remote), []).append(stream)

    def closed(self, request_id: str, remote: tuple[str, int], stream) -> None:
        with self._lock:
            streams = self._streams.get((request_id, remote), [])
            if stream in streams:
                streams.remove(stream)
            if not streams:
                self._streams.pop((request_id, remote), None)

    def stop_streams(self, request_id: str, remote: tuple[str, int]) -> int:
        """The consumer at ``remote`` aborted ``request_id``: every stream of it there fails, posts
        no further chunk, and cancels those not yet posted; returns how many were open."""
        with self._lock:
            streams = list(self._streams.get((request_id, remote), []))
        for stream in streams:
            stream.stop(aborted_error(request_id))
        return len(streams)

    def add(self, ann: Announcement) -> None:
        """Record ``ann``; a consumer engine announcing the same request again replaces its first."""
        now = self._clock()
        with self._lock:
            per = self._by_request.pop(ann.request_id, {})
            per[ann.engine_id] = (now, ann)
            self._by_request[ann.request_id] = per
            while len(self._by_request) > self._limit:
                self._by_request.popitem(last=False)
            while self._by_request:  # the oldest first: stop at the first young one
                oldest = next(iter(self._by_request.values()))
                if min(t for t, _ in oldest.values()) + self._max_age >= now:
                    break
                self._by_request.popitem(last=False)

    def get(self, request_id: str) -> tuple[Announcement, ...]:
        """The live announcements of ``request_id``, in arrival order (drains nothing)."""
        with self._lock:
            per = self._by_request.get(request_id, {})
            return tuple(ann for _, ann in per.values())

    def cancel(self, request_id: str, engine_id: str) -> Announcement | None:
        """Drop ``engine_id``'s announcement of ``request_id`` (its abort); returns it, or None if
        there was none."""
        with self._lock:
            per = self._by_request.get(request_id)
            if not per or engine_id not in per:
                return None
            _, ann = per.pop(engine_id)
            if not per:
                del self._by_request[request_id]
            return ann

    def forget(self, request_id: str) -> None:
        """Drop every announcement of ``request_id`` (the producer is done with it)."""
        with self._lock:
            self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_request)


class AnnounceJob(LaneJob):
    """The consumer's ``Announce`` round trip, on the producer's lane."""

    def __init__(self, agent: "AgentParts", remote: tuple[str, int], message: Announce, deadline: float | None) -> None:
        self.agent, self.remote, self.message, self.deadline = agent, remote, message, deadline

    def run(self, agent: "AgentParts") -> None:
        timeout = agent.config.handshake_timeout
        if self.deadline is not None:
            timeout = max(1e-3, min(timeout, self.deadline - agent.clock.now()))
        host, port = self.remote
        try:
            reply = agent.peers.call(host, port, lambda link: link.ask(self.message, timeout))
        except KvxferError as exc:
            self.fail(exc)
            return
        if isinstance(reply, Refuse):
            self.fail(TransferFailedError(f"producer at {host}:{port} refused the announce of "
                                          f"{self.message.request_id!r}: {reply.reason}"))

    def fail(self, error: Exception) -> None:
        if not isinstance(error, KvxferError):
            error = TransferFailedError(f"announce of {self.message.request_id!r} failed: {error!r}")
        if isinstance(error, PeerLostError):
            error = PeerLostError(f"announce of {self.message.request_id!r} to {self.remote[0]}:{self.remote[1]}: "
                                  f"{error}")
        self.agent.reports.push_failed(self.message.request_id, error)


def start_announce(agent: "AgentParts", remote, request_id: str, block_ids, payload: bytes, producers: int,
                   timeout: float | None) -> None:
    """``Agent.announce``: check the arguments (raises at once), expect the push, queue the round trip."""
    agent.check_open()
    agent.require_cache()
    if agent.address is None:
        raise ConfigError("announce needs this agent's listener: call listen() first")
    request_id = checked_id(request_id)
    blocks = check_block_ids("block_ids", block_ids, agent.spec.num_blocks)
    payload = checked_payload(payload, "payload")
    producers = check_count(producers, "producers", 1)
    deadline = deadline_for(agent.config.transfer_timeout if timeout is None else timeout, agent.clock.now())
    remote = address(remote)
    agent.reports.expect_writes(request_id, producers, None, deadline)
    message = Announce(request_id, agent.engine_id, blocks.tolist(), agent.address[0], agent.address[1], payload)
    agent.lanes.put(remote, AnnounceJob(agent, remote, message, deadline))


def aborted_error(request_id: str) -> LeaseExpiredError:
    """What a producer's write stream fails with once its consumer aborted the request."""
    return LeaseExpiredError(f"request {request_id!r} aborted by the consumer")
