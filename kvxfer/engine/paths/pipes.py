"""Staged-pipeline messages over the backend's notifications, routed by tag (layer: engine; never nixl, zmq or the agent).

The staged pipeline (``kvxfer.engine.paths.pipeline``) talks in 20-byte ``PipeMessage`` records. On
the wire they are typed protocol messages (``kvxfer.protocol.PipeNote`` in the notification
envelope, authenticated with the shared key); a peer of the release before sends bare records,
which are taken only while no key is configured (unsigned, they would get past it). They travel
as backend notifications next to the request-done notifications of ordinary reads; the progress
loop hands every notification to ``PipeRouter.deliver`` first, which claims
the pipeline ones (recognised by their magic prefix) and queues them on the ``PipeLink``
of their (peer, tag), so they are never decoded as, or logged as bad, request-done notes.

A ``PipeLink`` also translates slot numbers: a producer serves from a window of its staging
area but announces absolute slot numbers, and every slot a peer names is checked against
the window before the pipeline sees it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

from kvxfer.backend.base import Backend
from kvxfer.errors import KvxferError, ProtocolError
from kvxfer.engine.paths.pipeline import STOP, PipeMessage, is_pipe_message
from kvxfer.protocol import PipeNote, decode_pipe_note, encode_pipe_note, is_pipe_note

__all__ = ["PipeLink", "PipeRouter"]

log = logging.getLogger("kvxfer.agent")


class PipeLink:
    """``kvxfer.engine.paths.pipeline.Link`` for one transfer with one peer.

    Args:
        backend, peer: where ``send`` goes (the backend's name for the peer).
        tag: the transfer's pipeline tag.
        slot_offset: added to the slot of every message sent, subtracted from every one received.
        slot_count: received slots (after the offset) must lie in ``[0, slot_count)``.
    """

    def __init__(self, backend: Backend, peer: str, tag: int, slot_offset: int, slot_count: int,
                 key: bytes | None = None) -> None:
        self.backend, self.peer, self.tag = backend, peer, tag
        self.slot_offset, self.slot_count = slot_offset, slot_count
        self._key = key
        self._inbox: collections.deque[bytes] = collections.deque()
        self._error: KvxferError | None = None
        self._arrived = threading.Event()

    def send(self, message: bytes) -> None:
        """Send the pipeline's ``message`` to the peer as a typed ``PipeNote`` (authenticated
        with the shared key, like every other notification)."""
        msg = PipeMessage.decode(message)
        if msg is None:
            raise ProtocolError(f"not a pipeline message: {message[:8]!r}")
        note = PipeNote(msg.kind, msg.tag, msg.piece, msg.slot + self.slot_offset)
        self.backend.notify(self.peer, encode_pipe_note(note, self._key))

    def check(self) -> None:
        """Raise the error ``stop`` was given, if it was."""
        if self._error is not None:
            raise self._error

    def receive(self) -> list[bytes]:
        """This transfer's messages since the last call. Raises the error ``stop`` was given."""
        self.check()
        return self.collect()

    def collect(self) -> list[bytes]:
        """``receive`` without the stop check: the messages since the last call, also once the
        pipeline stopped (a serve that ended with slots lent listens for their FREE).
        Raises ProtocolError for a slot outside the window."""
        out = []
        while self._inbox:
            msg = PipeMessage.decode(self._inbox.popleft())
            if msg.kind == STOP:  # names no slot
                out.append(dataclasses.replace(msg, slot=0).encode())
                continue
            slot = msg.slot - self.slot_offset
            if not 0 <= slot < self.slot_count:
                raise ProtocolError(f"pipeline message names slot {msg.slot}; expected "
                                    f"[{self.slot_offset}, {self.slot_offset + self.slot_count})")
            out.append(dataclasses.replace(msg, slot=slot).encode())
        return out

    def put(self, raw: bytes) -> None:
        self._inbox.append(raw)
        self._arrived.set()

    def wait(self, timeout: float) -> None:
        """Block (without the GIL) until a message arrives, ``stop`` is called or ``timeout`` passes."""
        if not self._inbox and self._error is None:
            self._arrived.wait(timeout)
        self._arrived.clear()

    def stop(self, error: KvxferError) -> None:
        """Make the pipeline using this link raise ``error`` at its next receive (cancellation)."""
        self._error = error
        self._arrived.set()


class PipeRouter:
    """Routes pipeline notifications to open links by (peer, tag). Thread-safe.

    Attributes:
        dropped: pipeline messages dropped, by reason: ``bad`` (envelope, key or bounds do not
            check) and ``unsigned`` (a bare record while this agent has a key).
    """

    def __init__(self, backend: Backend, key: bytes | None = None) -> None:
        self._backend, self._key = backend, key
        self._links: dict[tuple[str, int], PipeLink] = {}
        self._parked: set[tuple[str, int]] = set()   # routes whose pipeline ended, still listening
        self._lock = threading.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()

    def open(self, peer: str, tag: int, slot_offset: int = 0, slot_count: int = 1 << 20) -> PipeLink:
        """A link for a new transfer. Raises ProtocolError if (peer, tag) is already in use."""
        link = PipeLink(self._backend, peer, tag, slot_offset, slot_count, self._key)
        with self._lock:
            if (peer, tag) in self._links:
                raise ProtocolError(f"pipeline tag {tag} is already in use with peer {peer!r}")
            self._links[(peer, tag)] = link
        return link

    def close(self, link: PipeLink) -> None:
        with self._lock:
            if self._links.get((link.peer, link.tag)) is link:
                del self._links[(link.peer, link.tag)]
                self._parked.discard((link.peer, link.tag))

    def park(self, link: PipeLink) -> None:
        """Keep routing ``link``'s messages though its pipeline ended (something still waits for
        the peer's word on it) without counting it in ``active``: nobody needs them at once."""
        with self._lock:
            if self._links.get((link.peer, link.tag)) is link:
                self._parked.add((link.peer, link.tag))

    def active(self) -> int:
        """Open links whose pipeline runs (parked ones left out)."""
        with self._lock:
            return len(self._links) - len(self._parked)

    def deliver(self, peer: str, raw: bytes) -> bool:
        """Take ``raw`` if it is a pipeline message (True); False leaves it to the caller.

        A typed ``PipeNote`` (this release) is checked (envelope, key, bounds) and handed to the
        pipeline as its record; a bare record (a peer of the release before) is taken as it is
        only while this agent has no key: it carries no tag, so with a key it is refused (it would
        get past the key). What is dropped is counted in ``dropped`` and logged a bounded number
        of times per reason."""
        try:
            if is_pipe_note(raw):
                note = decode_pipe_note(raw, self._key)
                msg = PipeMessage(note.kind, note.tag, note.piece, note.slot)
                raw = msg.encode()
            elif is_pipe_message(raw):
                if self._key is not None:
                    self._drop("unsigned", peer, "a bare pipeline record carries no tag and this agent "
                                                 "has a shared key (a peer of the release before, or forged)")
                    return True
                msg = PipeMessage.decode(raw)
            else:
                return False
        except KvxferError as exc:
            self._drop("bad", peer, str(exc))
            return True
        with self._lock:
            link = self._links.get((peer, msg.tag))
        if link is None:  # a transfer that already ended (cancelled, failed or done)
            log.debug("pipeline message for closed tag %d from %s", msg.tag, peer)
            return True
        link.put(raw)
        return True

    def _drop(self, reason: str, peer: str, detail: str) -> None:
        """Count one dropped message of ``reason``; log the 1st, 10th, 100th, 1000th and every
        10,000th of each reason (peer input must never write a log line per message)."""
        with self._lock:
            self.dropped[reason] += 1
            count = self.dropped[reason]
        if count in (1, 10, 100, 1000) or count % 10000 == 0:
            log.warning("dropping a pipeline message from %s (%s, %d so far): %s", peer, reason, count, detail)
