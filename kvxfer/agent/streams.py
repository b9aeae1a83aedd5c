"""One request pushed in chunks, completed once (layer: agent).

``Agent.open_writes`` returns a ``WriteStream``: each ``write`` posts one chunk (chunks may be in
flight together; each is an ordinary write under an internal id, carrying the request's own id
in its notification), and ``finish`` ends the stream. Once every chunk has completed, a
``WritesDone`` round trip tells the consumer how many writes to count and hands it the aux
payload; the stream's one ``handle`` completes with that answer. The consumer reports the request
received only once it has counted every write and holds the ``WritesDone``, so the aux payload
arrives with the KV, never before it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvxfer.agent.jobs import LaneJob
from kvxfer.agent.args import MAX_BLOCK_ID, deadline_for, payload
from kvxfer.agent.writes import PendingWrite
from kvxfer.engine.handles import TransferHandle, TransferStats, owned_handle
from kvxfer.errors import ConfigError, KvxferError, TransferFailedError
from kvxfer.layout.request import check_block_ids
from kvxfer.protocol import Refuse, WritesDone, encode_notification
from kvxfer.types import Direction

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["WriteStream"]


_CHUNK_SEP = "\x1f"  # internal chunk ids: "<request>\x1f<n>"; never on the wire


class WriteStream:
    """A producer's chunked push of one request to one consumer rank (``Agent.open_writes``).

    ``write(local, remote)`` posts a chunk and returns its handle; ``finish(aux)`` says no chunk
    follows. ``handle`` completes once every chunk completed and the consumer acknowledged the
    end (with ``aux``), or fails with the first chunk's error (later chunks are not sent).
    ``abort(error)`` fails it now. Thread-safe.
    """

    def __init__(self, agent: "AgentParts", remote: tuple[str, int], request_id: str, timeout: float | None) -> None:
        self._agent, self.remote, self.request_id = agent, remote, request_id
        self.handle, self._finish_handle = owned_handle(request_id)
        self._lock = threading.Lock()
        self._chunks: list[TransferHandle] = []
        self._bytes = 0
        self._completed = 0                  # chunks that completed without an error
        self._aux: bytes | None = None       # set by finish
        self._ending = False                 # WritesDone queued
        self._started = time.perf_counter()
        self._deadline = deadline_for(timeout, agent.clock.now())
        agent.announced.opened(request_id, remote, self)  # until it ends: a consumer's abort stops it
        self.handle._add_callback(lambda _: agent.announced.closed(request_id, remote, self))

    @property
    def writes(self) -> int:
        """Chunks posted so far."""
        return len(self._chunks)

    def write(self, local_blocks, remote_blocks) -> TransferHandle:
        """Post one chunk: this rank's ``local_blocks`` into the consumer's ``remote_blocks``.
        Returns at once (the post runs on the consumer's lane).

        Raises (at once): BlockIdError (bad ids, or lists of different lengths), ConfigError
        (after ``finish``), the stream's error once it failed, ClosedError.
        """
        agent = self._agent
        agent.check_open()
        local = check_block_ids("local", local_blocks, agent.spec.num_blocks)
        remote_ids = check_block_ids("remote", remote_blocks, MAX_BLOCK_ID)
        with self._lock:
            if self._aux is not None:
                raise ConfigError(f"write stream of {self.request_id!r} is finished: no chunk may follow")
            error = self.handle.exception()
            if error is not None:
                raise error
            key = f"{self.request_id}{_CHUNK_SEP}{len(self._chunks)}"
            req = agent.engine.reserve(key, Direction.WRITE, deadline=self._deadline)
            self._chunks.append(req.handle)
        note = encode_notification(self.request_id, agent.engine_id, agent.config.auth_key)
        req.handle._add_callback(self._on_chunk)
        agent.lanes.put(self.remote, PendingWrite(req, local, remote_ids, note, self._deadline))
        agent.wake.set()
        return req.handle

    def finish(self, aux: bytes = b"") -> TransferHandle:
        """No chunk follows; deliver ``aux`` (at most ``kvxfer.protocol.MAX_PAYLOAD`` bytes) with the
        KV once every chunk completed. Returns ``handle``. A second call is a ConfigError, and so
        is an ``aux`` that is not bytes."""
        aux = payload(aux, "aux payload")
        with self._lock:
            if self._aux is not None:
                raise ConfigError(f"write stream of {self.request_id!r} is already finished")
            self._aux = aux
        self._maybe_end()
        return self.handle

    def abort(self, error: KvxferError, *, tell: bool = True) -> None:
        """Fail the stream now (chunks already posted still end on their own handles) and, with
        ``tell``, tell the consumer (a ``WritesDone`` naming ``error``): its request fails at once
        instead of waiting for its deadline. Idempotent. ``error`` that is not a ``KvxferError``
        is carried as a ``TransferFailedError`` naming it; one that is not an exception at all is a
        ConfigError (raised before anything changes)."""
        if not isinstance(error, KvxferError):
            if not isinstance(error, BaseException):
                raise ConfigError(f"abort takes the error to fail the stream with; got {error!r}")
            error = TransferFailedError(f"write stream of {self.request_id!r} aborted: {error!r}")
        with self._lock:
            ending, self._ending = self._ending, True
        self._finish_handle(error=error)
        if tell and not ending:
            reason = str(error)[:4000] or "aborted"
            message = WritesDone(self.request_id, self._agent.engine_id, len(self._chunks), b"", error=reason)
            try:
                self._agent.lanes.put(self.remote, _WritesDoneJob(self, message))
            except RuntimeError:
                pass

    def stop(self, error: KvxferError) -> None:
        """The consumer aborted the request: fail the stream (no further chunk may be written) and
        cancel its chunks, so those not yet posted never go; those in flight end on their own
        handles once their transfers have ended. Nothing is told to the consumer (it asked)."""
        self.abort(error, tell=False)
        with self._lock:
            chunks = list(self._chunks)
        for chunk in chunks:
            if not chunk.done():
                self._agent.engine.cancel(chunk.request_id, error)
        self._agent.wake.set()

    def done(self) -> bool:
        return self.handle.done()

    def exception(self) -> KvxferError | None:
        return self.handle.exception()

    # ---- internals -----------------------------------------------------------------
    def _on_chunk(self, chunk: TransferHandle) -> None:  # a done-callback: any thread, maybe inside a poll
        error = chunk.exception()
        if error is not None:
            self._finish_handle(error=error)
            return
        try:
            moved = chunk.wait(0).num_bytes
        except KvxferError:
            moved = 0
        with self._lock:
            self._bytes += moved
            self._completed += 1
        self._maybe_end()

    def _maybe_end(self) -> None:
        # Counts only, never handle.done(): done() polls the engine, which may complete a chunk
        # and run _on_chunk on this very thread (a callback re-entering here under the lock).
        with self._lock:
            if self._ending or self._aux is None or self.handle.done():
                return
            if self._completed < len(self._chunks):
                return
            self._ending = True
        message = WritesDone(self.request_id, self._agent.engine_id, len(self._chunks), self._aux)
        try:
            self._agent.lanes.put(self.remote, _WritesDoneJob(self, message))
        except RuntimeError:  # the agent closed meanwhile
            self._finish_handle(error=TransferFailedError(f"agent closed before {self.request_id!r} ended"))
        self._agent.wake.set()

    def _ended(self, error: KvxferError | None) -> None:
        if error is not None:
            self._finish_handle(error=error)
            return
        total = time.perf_counter() - self._started
        self._finish_handle(TransferStats(self.request_id, num_bytes=self._bytes, peers=1,
                                          total_seconds=total, seconds=total))


class _WritesDoneJob(LaneJob):
    """The producer's ``WritesDone`` round trip, on the consumer's lane."""

    def __init__(self, stream: WriteStream, message: WritesDone) -> None:
        self.stream, self.message = stream, message

    def run(self, agent: "AgentParts") -> None:
        host, port = self.stream.remote
        try:
            reply = agent.peers.call(host, port, lambda link: link.ask(self.message, agent.config.handshake_timeout))
        except KvxferError as exc:
            self.stream._ended(exc)
            return
        if isinstance(reply, Refuse):
            self.stream._ended(TransferFailedError(
                f"consumer at {host}:{port} refused the end of {self.message.request_id!r}: {reply.reason}"))
            return
        self.stream._ended(None)

    def fail(self, error: Exception) -> None:
        self.stream._ended(error if isinstance(error, KvxferError) else TransferFailedError(repr(error)))
