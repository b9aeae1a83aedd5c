"""Completion notices sent over the side channel (layer: agent).

Reads that move bytes without a NIXL transfer (CUDA IPC, the staged pipeline) have no NIXL
completion notification to carry "this consumer is done" to the producer; a NIXL notification
sent on its own would also need a UCX connection the transfer never made (and on a one-GPU
host UCX's TCP wire-up of that connection was seen to fail). ``DoneSender`` instead sends a
``Done`` message on the producer rank's link, from that rank's own lane so neither the
progress loop nor another producer's notices ever wait on its round trip. A notice that cannot be delivered (even after the one fresh handshake the
link's ``ask`` gets) is logged; the producer then frees the blocks when its lease expires (the
bytes have already arrived).

The link's session is multiplexed (requests carry ids; see ``kvxfer.transport.zmq_client``), so a
notice in flight never holds up the next request's claim: no second session is needed.

A producer of the previous release does not know ``Done`` (it answers ``Reject('malformed')``)
and announces no ``host_id``, which every current agent does. Such a peer is told the way it
expects, by the request-done NIXL notification (``notify``); only direct reads reach it (the
GPU paths need fields it does not send), so this is the notify-only replicas' notice.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvxfer.agent.lanes import PeerLanes
from kvxfer.errors import KvxferError
from kvxfer.protocol import MAX_BATCH, Done, Refuse

__all__ = ["DoneSender", "knows_done"]

log = logging.getLogger("kvxfer.agent")


def knows_done(info) -> bool:
    """Whether the peer of this ``PeerInfo`` knows ``Done``: current agents always announce a
    non-empty ``host_id`` (boot id + "/" + hostname); the previous release sends none."""
    return bool(info.host_id)


class DoneSender:
    """Delivers ``Done`` notices, in order per producer rank, each rank on its own lane (a frozen
    producer delays only its own notices); the notices handed to one rank's lane together (a
    step's reads, or everything since the last flush) go as one message. ``close`` drains and stops.

    ``send`` only queues: no thread is woken while a read completes (on a small host the woken
    lane takes the interpreter from the thread that just completed the read, which is the
    engine's). ``flush`` hands what is queued to the lanes: the agent's ``drive_once`` does, on
    kvxfer's own thread at its cadence (at most ``IDLE_CADENCE`` later) and in ``Agent.poll``. A
    notice is not urgent: the bytes have arrived, and the producer only frees the blocks sooner.

    Args:
        engine_id: this consumer's engine id (the notices' sender).
        ask: ``ask(link, message)`` sends ``message`` on ``link``'s session (to that engine only,
            with one fresh handshake if the session was lost) and returns the reply.
        notify: ``notify(link, request_id)`` sends the request-done NIXL notification instead, to
            a peer that does not know ``Done`` (``knows_done``); without it such a peer is sent
            ``Done`` anyway.
    """

    def __init__(self, engine_id: str, ask: Callable[[object, Done], object],
                 notify: Callable[[object, str], None] | None = None) -> None:
        self._engine_id, self._ask, self._notify = engine_id, ask, notify
        self._lanes = PeerLanes("kvxfer-done", self._run)
        self._queued: list = []  # (link, request_id) not yet handed to a lane (``flush``)
        self._lock = threading.Lock()

    def send(self, link, request_id: str, epoch: int = 0) -> None:
        """Queue a notice to ``link``'s producer rank (never blocks, wakes nobody); it goes at the
        next ``flush``. ``epoch``: the hold token's the read went by (0: it claimed)."""
        with self._lock:
            self._queued.append((link, request_id, epoch))

    def pending(self) -> int:
        """Notices queued and not yet handed to a lane."""
        return len(self._queued)

    def flush(self) -> None:
        """Hand every queued notice to its producer rank's lane, one batch per rank."""
        if not self._queued:
            return
        with self._lock:
            items, self._queued = self._queued, []
        by_rank: dict[tuple, list] = {}
        for item in items:
            link = item[0]
            by_rank.setdefault((link.host, link.port), []).append(item)
        for key, notices in by_rank.items():
            self._put(key, notices)

    def _put(self, key: tuple, notices: list) -> None:
        try:
            self._lanes.put_many(key, notices)
        except RuntimeError:
            log.debug("done notices of %s after close: dropped (their leases will expire)",
                      [item[1] for item in notices])

    def _run(self, _key, items: list) -> None:
        """The notices queued for one producer rank's address: those to one link (one engine)
        go in one ``Done`` when the producer reads ``Done.more``, else one each."""
        by_link: dict[int, tuple] = {}
        for link, request_id, epoch in items:
            entry = by_link.setdefault(id(link), (link, [], []))
            entry[1].append(request_id)
            entry[2].append(epoch)
        for link, request_ids, epochs in by_link.values():
            if getattr(link.info, "batch_done", False) and knows_done(link.info):
                for at in range(0, len(request_ids), MAX_BATCH + 1):
                    chunk, marks = request_ids[at:at + MAX_BATCH + 1], epochs[at:at + MAX_BATCH + 1]
                    self._tell(link, chunk[0], Done(chunk[0], self._engine_id, chunk[1:],
                                                    marks if any(marks) else []))
                continue
            for request_id, epoch in zip(request_ids, epochs):
                if self._notify is not None and not knows_done(link.info):
                    self._notify_old(link, request_id)  # an older producer: the notification it expects
                else:
                    self._tell(link, request_id, Done(request_id, self._engine_id, [], [epoch] if epoch else []))

    def _tell(self, link, request_id: str, message: Done) -> None:
        count = 1 + len(message.more)
        what = f"{request_id!r}" + (f" and {count - 1} more" if count > 1 else "")
        try:
            reply = self._ask(link, message)
            if isinstance(reply, Refuse):
                log.info("producer %s refused the done notice of %s: %s", link.engine_id, what, reply.reason)
        except KvxferError as exc:
            log.warning("done notice of %s to %s not delivered (its lease will expire): %s",
                        what, link.engine_id, exc)

    def _notify_old(self, link, request_id: str) -> None:
        try:
            self._notify(link, request_id)
        except KvxferError as exc:
            log.warning("done notice of %r to %s not delivered (its lease will expire): %s",
                        request_id, link.engine_id, exc)

    def close(self, timeout: float = 5.0) -> None:
        self.flush()
        self._lanes.close(timeout)
