"""A readers-writer gate for one NIXL agent (layer: backend.gate; stdlib only).

NIXL's agent, created in its ``NIXL_THREAD_SYNC_RW`` mode, lets transfers be created, posted,
polled and released from several threads at once, and needs control calls (registering memory,
loading or removing a peer, releasing a prepared list, closing) to run alone. ``Gate`` gives
kvxfer's side the same shape: ``gate.data`` is entered by any number of threads together,
``gate.control`` by one thread while no data call is inside. A waiting control call goes first:
no data call enters after it asks, so a steady stream of polls cannot starve it. Neither side
is re-entrant: a thread inside ``data`` must not enter ``data`` or ``control`` again.

``Gate(shared=False)`` makes ``data`` exclusive too: one call at a time, for a NIXL build
without the RW mode.
"""

from __future__ import annotations

import threading

__all__ = ["Gate"]


class _Side:
    __slots__ = ("_enter", "_exit")

    def __init__(self, enter, exit_) -> None:
        self._enter, self._exit = enter, exit_

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        self._exit()


class Gate:
    """Data calls together, control calls alone (see the module doc)."""

    def __init__(self, shared: bool = True) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0      # data calls inside
        self._writer = False   # a control call inside
        self._asking = 0       # control calls waiting to enter
        self.shared = bool(shared)
        self.control = _Side(self._enter_control, self._exit_control)
        self.data = _Side(self._enter_data, self._exit_data) if shared else self.control

    # A data call (every post and poll) takes the plain lock only: it waits on the condition
    # only while a control call is inside or asking, and wakes it only when one asks.
    def _enter_data(self) -> None:
        with self._mutex:
            if not (self._writer or self._asking):
                self._readers += 1
                return
            while self._writer or self._asking:
                self._cond.wait()
            self._readers += 1

    def _exit_data(self) -> None:
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._asking:
                self._cond.notify_all()

    def _enter_control(self) -> None:
        with self._cond:
            self._asking += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._asking -= 1
            self._writer = True

    def _exit_control(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()
