"""The producer half of a staged read: check a ``PackRequest``, then pack and serve it (layer: engine; never nixl, zmq or the agent).

Everything in a ``PackRequest`` comes from a peer, so it is checked before anything changes:
block ids inside both caches, the head range equal to the heads the two ranks share, the
piece size between one pair and one staging slot, the tag unused, and the request held and
claimed by this consumer. A bad value raises a typed error naming it and the allowed range
(the side channel turns it into a ``Reject`` and the consumer's ``ProtocolError``); a request
that is simply not held any more gets a ``Refuse``. Accepted requests are served by a worker
running ``serve_read`` in a window of the staging slots until the end of the claim window this
consumer was granted (the consumer's read fails once that passed); the job stops earlier when
the consumer aborts, the hold ends, or the agent closes. A serve that stops with slots announced
to the consumer and not freed keeps them out of the pool (``PathKit.park_slots``) until the
consumer frees them, sends STOP (its READs ended), or its window has passed: its READ of them
may still be in flight.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from kvxfer.errors import BlockIdError, LayoutError, LeaseExpiredError, ProtocolError
from kvxfer.engine.leases import LeaseTable
from kvxfer.layout.pairs import pack_pairs
from kvxfer.engine.paths.pipeline import FREE, STOP, PipeMessage, serve_read
from kvxfer.engine.paths.pipes import PipeLink
from kvxfer.layout import CacheView
from kvxfer.layout.request import check_block_ids
from kvxfer.protocol import PackReady, PeerInfo, Refuse, spec_from_wire
from kvxfer.protocol.messages import PackRequest

from kvxfer.engine.paths.kit import PathKit
from kvxfer.engine.paths.jobs import PipelineJob
from kvxfer.engine.paths.reading import shared_heads

__all__ = ["PackServer"]

log = logging.getLogger("kvxfer.agent")


def _check_ids(ids: list[int], bound: int, side: str) -> np.ndarray:
    """A PackRequest's ids through the one validator, and at least one of them."""
    arr = check_block_ids(f"PackRequest {side}", ids, bound)
    if arr.size == 0:
        raise BlockIdError(f"PackRequest {side} block ids: expected at least one id in [0, {bound})")
    return arr


class _Lent:
    """``ready`` of a serve's slots parked with pieces still lent (``PathKit.park_slots``): True
    once the consumer freed every one of them, sent STOP (its READs ended), or its claim window
    ``until`` has passed (its read fails after that, whatever it reads); the route closes then."""

    def __init__(self, kit: PathKit, pipe: PipeLink, lent: set[int], until: float) -> None:
        self._kit, self._pipe, self._lent, self._until = kit, pipe, lent, until

    def __call__(self) -> bool:
        try:
            for raw in self._pipe.collect():
                msg = PipeMessage.decode(raw)
                if msg.kind == FREE:
                    self._lent.discard(msg.piece)
                elif msg.kind == STOP:
                    self._lent.clear()
        except ProtocolError as exc:  # a peer's bad slot: only the window can end the wait now
            log.debug("staged serve %d: %s", self._pipe.tag, exc)
        ready = not self._lent or self._kit.clock.now() > self._until
        if ready:
            self._kit.router.close(self._pipe)
        return ready


class PackServer:
    """Serves ``PackRequest``s for one producer agent. Thread-safe."""

    def __init__(self, kit: PathKit, view: CacheView, leases: LeaseTable) -> None:
        self._kit, self._view, self._leases = kit, view, leases
        self._jobs: dict[str, list[PipelineJob]] = {}
        self._peers: dict[str, str] = {}   # consumer agent name -> the backend's name for it
        self._lock = threading.Lock()

    def handle(self, msg: PackRequest, peer: PeerInfo) -> PackReady | Refuse:
        """Check ``msg`` from handshaken ``peer``; start serving it. Raises typed errors for bad input."""
        kit = self._kit
        if kit.area is None:
            return Refuse(msg.request_id, f"staged reads are not served here: {kit.area_why}")
        spec, consumer = self._view.spec, spec_from_wire(peer.spec)
        p_ids = _check_ids(msg.block_ids, spec.num_blocks, "producer")
        c_ids = _check_ids(msg.consumer_ids, consumer.num_blocks, "consumer")
        start, stop = shared_heads(spec, consumer)
        if (msg.head_start, msg.head_stop) != (start, stop):
            raise LayoutError(f"PackRequest heads [{msg.head_start}, {msg.head_stop}): expected [{start}, {stop}) "
                              f"(the heads rank {spec.tp_rank}/{spec.tp_size} shares with consumer rank "
                              f"{consumer.tp_rank}/{consumer.tp_size})")
        if p_ids.size * spec.block_size != c_ids.size * consumer.block_size:
            raise BlockIdError(f"PackRequest ids must cover the same tokens: producer {p_ids.size} x "
                               f"{spec.block_size}, consumer {c_ids.size} x {consumer.block_size}")
        pack = pack_pairs(spec, self._view.geometry, p_ids, consumer, c_ids, 0)
        if not pack.pair_bytes <= msg.piece_bytes <= kit.area.slot_bytes:
            raise ProtocolError(f"PackRequest piece_bytes {msg.piece_bytes} outside "
                                f"[{pack.pair_bytes}, {kit.area.slot_bytes}]")
        refusal, window_end = self._leases.claimed_until(msg.request_id, peer.engine_id, p_ids)
        if refusal:
            return Refuse(msg.request_id, refusal)
        pipe = kit.router.open(self._backend_name(peer), msg.tag, 0, 0)  # ProtocolError: tag in use
        # Serve for the window granted (a read the consumer may still complete), or less if it asked.
        deadline = window_end if msg.timeout <= 0 else min(window_end, kit.clock.now() + msg.timeout)
        count = kit.slots_per_transfer(1)
        held: list = []
        lent: set[int] = set()

        def body() -> None:
            slots = kit.take_slots(count, deadline, pipe.check)
            held.append(slots)
            pipe.slot_offset = (slots.addr - kit.area.addr) // kit.area.slot_bytes
            pipe.slot_count = slots.slots
            serve_read(msg.tag, pack, slots, kit.kernel, pipe, deadline, msg.piece_bytes, clock=kit.clock,
                       lent=lent)

        def cleanup() -> None:
            if held and lent:  # the consumer may still be reading them
                kit.router.park(pipe)
                kit.park_slots(held[0], _Lent(kit, pipe, lent, window_end))
                return
            kit.router.close(pipe)
            for slots in held:
                kit.give_slots(slots)

        job = PipelineJob(f"kvxfer-serve-{msg.request_id}", body, pipe, cleanup, pack.nbytes, 0)
        with self._lock:
            self._jobs.setdefault(msg.request_id, []).append(job)
        return PackReady(msg.request_id, 0, pack.nbytes)

    def _backend_name(self, peer: PeerInfo) -> str:
        """The backend's name for the consumer (loading its metadata once: we notify it)."""
        with self._lock:
            name = self._peers.get(peer.agent_name)
        if name is None:
            name = self._kit.backend.add_peer(peer.backend_metadata)
            with self._lock:
                self._peers[peer.agent_name] = name
        return name

    def cancel(self, request_id: str, why: str) -> None:
        """Stop serving ``request_id`` (consumer abort, hold released or expired)."""
        with self._lock:
            jobs = self._jobs.pop(request_id, [])
        for job in jobs:
            if not job.done():
                job.cancel(LeaseExpiredError(f"request {request_id!r} {why} while being served"))

    def reap(self) -> None:
        """Forget finished jobs, logging failures that were not cancellations."""
        with self._lock:
            for rid in list(self._jobs):
                live = []
                for job in self._jobs[rid]:
                    if not job.done():
                        live.append(job)
                    elif job.error is not None and not job.cancelled:
                        log.warning("staged read of %r failed on the producer: %s", rid, job.error)
                if live:
                    self._jobs[rid] = live
                else:
                    del self._jobs[rid]

    def serving(self) -> int:
        with self._lock:
            return sum(not job.done() for jobs in self._jobs.values() for job in jobs)

    def close(self) -> None:
        with self._lock:
            rids = list(self._jobs)
        for rid in rids:
            self.cancel(rid, "closed")
