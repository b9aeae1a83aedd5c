"""One worker thread per peer: a slow, frozen or dead peer delays only its own work (layer: agent).

``PeerLanes`` runs work keyed by peer address on that peer's own thread, started on demand and
ended after it has been idle a while. Work queued for one peer while its lane is busy is handed
over as one batch at the next turn (an engine step's reads to one producer become one claim
message and one launch). No lock of one lane is held while another lane's work runs, so the
handshake, claim or post that waits on one peer never stalls another.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Hashable

from kvxfer.errors import ClosedError
from kvxfer.starter import join_started, start_soon

__all__ = ["LanesClosed", "PeerLanes"]

log = logging.getLogger("kvxfer.agent")


class LanesClosed(ClosedError, RuntimeError):
    """Work queued after the lanes closed (the agent closed under the call that queued it)."""


class _Lane:
    def __init__(self, lock: threading.Lock) -> None:
        self.items: list = []
        self.running = False   # a batch of this lane is being run now
        self.thread: threading.Thread | None = None
        self.cond = threading.Condition(lock)  # this lane's own wake-up: work for another lane leaves it asleep


class PeerLanes:
    """Serial work per key (a peer's address), each key on its own thread.

    Args:
        name: thread name prefix.
        run: ``run(key, items)`` does one batch of a key's work, in submission order. It must
            complete or fail every item itself; an exception it lets out is logged and passed to
            ``crashed(items, exc)``.
        crashed: what to do with the items of a batch whose ``run`` raised.
        idle: seconds a lane's thread waits for more work before it ends (a later ``put``
            starts a new one).
    """

    def __init__(self, name: str, run: Callable[[Hashable, list], None],
                 crashed: Callable[[list, BaseException], None] | None = None, idle: float = 10.0) -> None:
        self._name, self._run, self._crashed, self._idle = name, run, crashed, idle
        self._lanes: dict[Hashable, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def put(self, key: Hashable, item) -> None:
        """Queue ``item`` on ``key``'s lane (never blocks on any peer).

        Raises:
            LanesClosed: after ``close`` (a ``ClosedError`` for the public calls that queue
                work here, and a ``RuntimeError`` for kvxfer's own callers that drop it).
        """
        self.put_many(key, [item])

    def put_many(self, key: Hashable, items: list) -> None:
        """Queue ``items`` on ``key``'s lane together: they reach ``run`` in one batch (or in
        the batch that is about to start, with anything queued before them)."""
        with self._lock:
            if self._closed:
                raise LanesClosed("the agent is closed: its peer lanes take no more work")
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(self._lock)
            lane.items.extend(items)
            if lane.thread is None:
                lane.thread = threading.Thread(target=self._serve, args=(key, lane),
                                               name=f"{self._name}-{_label(key)}", daemon=True)
                start_soon(lane.thread)  # the caller (an engine's thread) does not wait for it to run
            else:
                lane.cond.notify()

    def _serve(self, key: Hashable, lane: _Lane) -> None:
        while True:
            with self._lock:
                if not lane.items and not self._closed:
                    lane.cond.wait_for(lambda: lane.items or self._closed, timeout=self._idle)
                if not lane.items:  # idle (or closed): this lane's thread ends
                    lane.thread = None
                    if self._lanes.get(key) is lane:
                        del self._lanes[key]
                    return
                batch, lane.items = lane.items, []
                lane.running = True
            try:
                self._run(key, batch)
            except BaseException as exc:  # noqa: BLE001 - the lane must outlive any one batch
                log.exception("kvxfer lane %s", _label(key))
                if self._crashed is not None:
                    try:
                        self._crashed(batch, exc)
                    except Exception:  # noqa: BLE001
                        log.exception("kvxfer lane %s: failing its batch", _label(key))
            finally:
                with self._lock:
                    lane.running = False

    def idle(self, key: Hashable) -> bool:
        """Whether ``key``'s lane has nothing queued and runs nothing now: work done elsewhere for
        that peer cannot overtake work queued on the lane before it."""
        with self._lock:
            lane = self._lanes.get(key)
            return lane is None or (not lane.items and not lane.running)

    def busy(self) -> int:
        """Lanes with a thread now."""
        with self._lock:
            return sum(1 for lane in self._lanes.values() if lane.thread is not None)

    def close(self, timeout: float = 2.0) -> None:
        """Let every lane finish the batch it runs and end; queued items still run once.
        Idempotent."""
        with self._lock:
            self._closed = True
            threads = [lane.thread for lane in self._lanes.values() if lane.thread is not None]
            for lane in self._lanes.values():
                lane.cond.notify_all()
        for thread in threads:
            if thread is not threading.current_thread():
                join_started(thread, timeout)


def _label(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) == 2:
        return f"{key[0]}:{key[1]}"
    return str(key)
