"""Transfer parts that move their own bytes: an IPC kernel, a staged pipeline half (layer: engine; never nixl, zmq or the agent).

Both satisfy ``kvxfer.engine.transfers.Job``: ``poll`` never blocks (the progress thread
calls it), ``cancel`` returns True once nothing the job started can still write memory; the
engine sends the part's notification when ``poll`` first returns True (``notifies`` False).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from kvxfer.errors import KvxferError, TransferFailedError
from kvxfer.starter import start_soon

from kvxfer.engine.paths.pipes import PipeLink

__all__ = ["IpcJob", "PipelineJob"]

log = logging.getLogger("kvxfer.agent")


class IpcJob:
    """Pair-copy kernels already enqueued on a CUDA stream, followed by ``event``."""

    notifies = False
    moves_itself = True  # the GPU moves the bytes: polling only observes the event

    def __init__(self, launches: list, event: Any, num_bytes: int, descriptors: int) -> None:
        self._launches, self._event = launches, event  # launches keep the uploaded tables alive
        self.num_bytes, self.descriptors = num_bytes, descriptors

    def poll(self) -> bool:
        if self._event.done:  # cudaEventQuery: never blocks
            self._launches = []
            return True
        return False

    def cancel(self) -> bool:
        # A launched kernel cannot be recalled: it has ended once its event has (the engine asks
        # again until then; never a blocking synchronize on whichever thread drains it).
        if self._event.done:
            self._launches = []
            return True
        return False


class PipelineJob:
    """Runs ``body()`` (one staged pipeline half) in a worker thread.

    ``cancel`` stops the pipeline at its next receive on ``link`` and joins the thread;
    ``cleanup`` (return slots, close the route) runs on the worker once ``body`` ended.
    """

    notifies = False
    moves_itself = True  # its own thread drives the pipeline

    def __init__(self, name: str, body: Callable[[], None], link: PipeLink, cleanup: Callable[[], None],
                 num_bytes: int, descriptors: int) -> None:
        self.name, self._body, self.link, self._cleanup = name, body, link, cleanup
        self.num_bytes, self.descriptors = num_bytes, descriptors
        self.error: KvxferError | None = None
        self.cancelled = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        start_soon(self._thread)  # the caller (an engine's thread) does not wait for it to run

    def _main(self) -> None:
        try:
            self._body()
        except KvxferError as exc:
            self.error = exc
        except Exception as exc:  # a bug must fail the transfer, not vanish with the thread
            log.exception("%s", self.name)
            self.error = TransferFailedError(f"{self.name}: {type(exc).__name__}: {exc}")
        finally:
            try:
                self._cleanup()
            finally:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def poll(self) -> bool:
        if not self._done.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True

    def cancel(self, error: KvxferError | None = None) -> bool:
        """Stop the pipeline; True once its worker ended (its last transfer confirmed ended).
        Never waits: the engine asks again until then."""
        first, self.cancelled = not self.cancelled, True
        if first:
            self.link.stop(error or TransferFailedError(f"{self.name}: cancelled"))
        return self._done.is_set()
