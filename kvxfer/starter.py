"""Starting kvxfer's threads without waiting for them to run (layer: starter; stdlib only).

``Thread.start()`` returns only after the new thread has run its first lines, and for that the
new thread needs the interpreter. With another thread busy in Python (an engine's, or kvxfer's
own), one start costs the caller about a switch interval (5 ms by default) and at times several.
``start_soon`` hands the thread to one starter thread per process instead, so a call on an
engine's thread (a read that needs a peer's lane, a link's first small read, a staged read's
pipeline) only queues it. ``ready()`` starts the starter; an ``Agent`` calls it when it is made,
off any read's path. Before ``ready()`` (or in a forked child, until it calls ``ready()``
again) ``start_soon`` starts the thread itself.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time

__all__ = ["join_started", "ready", "start_soon"]

log = logging.getLogger("kvxfer")

_lock = threading.Lock()
_queue: "queue.SimpleQueue[threading.Thread]" = queue.SimpleQueue()
_starter: threading.Thread | None = None
_pid: int | None = None


def _running() -> bool:
    return _starter is not None and _pid == os.getpid() and _starter.is_alive()


def ready() -> None:
    """Start this process's starter thread, if it does not run yet. Idempotent."""
    global _starter, _pid, _queue
    with _lock:
        if _running():
            return
        if _pid != os.getpid():
            _queue = queue.SimpleQueue()  # a forked child: nothing queued in the parent is its own
        _pid = os.getpid()
        _starter = threading.Thread(target=_run, args=(_queue,), name="kvxfer-starter", daemon=True)
        _starter.start()


def _run(work: "queue.SimpleQueue[threading.Thread]") -> None:
    while True:
        thread = work.get()
        try:
            thread.start()
        except RuntimeError as exc:  # no thread left to start, or the interpreter is ending
            if sys.is_finalizing():
                return
            # what the thread was to do fails by its own deadline (a lane's reads, a pipeline's part)
            log.error("kvxfer starter: thread %s not started: %s", thread.name, exc)


def start_soon(thread: threading.Thread) -> None:
    """Start ``thread`` on the starter thread (at once, in order); on this thread where no
    starter runs. ``thread.ident`` is None until it has started: join it with ``join_started``."""
    if _running():
        _queue.put(thread)
    else:
        thread.start()


def join_started(thread: threading.Thread, timeout: float) -> None:
    """``thread.join(timeout)`` for a thread given to ``start_soon``: waits (within ``timeout``)
    for it to start first, where the starter has not started it yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # not started yet
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)
