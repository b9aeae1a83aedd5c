"""Completion notices sent over the side channel (layer: agent).

Reads that move bytes without a NIXL transfer (CUDA IPC, the staged pipeline) have no NIXL
completion notification to carry "this consumer is done" to the producer; a NIXL notification
sent on its own would also need a UCX connection the transfer never made (and on a one-GPU
host UCX's TCP wire-up of that connection was seen to fail). ``DoneSender`` instead sends a
``Done`` message on the producer rank's side channel, from its own thread so the progress loop
never waits on a round trip. A notice that cannot be delivered is logged; the producer then
frees the blocks when its lease expires (the bytes have already arrived).
"""

from __future__ import annotations

import logging
import queue
import threading

from kvxfer.errors import KvxferError
from kvxfer.protocol import Done, Refuse

__all__ = ["DoneSender"]

log = logging.getLogger("kvxfer.agent")


class DoneSender:
    """Delivers ``Done`` notices in order on one background thread. ``close`` drains and stops."""

    def __init__(self, engine_id: str, timeout: float) -> None:
        self._engine_id, self._timeout = engine_id, timeout
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvxfer-done", daemon=True)
        self._thread.start()

    def send(self, link, request_id: str) -> None:
        """Queue a notice to ``link``'s producer rank (never blocks)."""
        self._queue.put((link, request_id))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            link, request_id = item
            try:
                reply = link.ask(Done(request_id, self._engine_id), self._timeout)
                if isinstance(reply, Refuse):
                    log.info("producer %s refused the done notice of %r: %s", link.engine_id, request_id,
                             reply.reason)
            except KvxferError as exc:
                log.warning("done notice of %r to %s not delivered (its lease will expire): %s",
                            request_id, link.engine_id, exc)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
