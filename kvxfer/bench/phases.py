"""A timeline of the read flow across kvxfer's threads, for the benchmarks (layer: bench).

``Timeline.installed()`` wraps the steps of a read (``STEPS``, where they exist in this version)
to record when each begins and ends and on which thread (the caller, a lane, the progress loop,
the done lane). Each wrapper costs about a microsecond. ``benchmarks/read_phases.py`` prints the
timeline of its own reads; ``kvxfer bench`` prints the one of its ``kvxfer-agent`` and
``kvxfer-token`` consumers when ``KVXFER_BENCH_PHASES=1`` is set (to the worker's stderr).
"""

from __future__ import annotations

import importlib
import statistics
import threading
import time

__all__ = ["STEPS", "Timeline"]

# (module, class, method): the steps of a read, wrapped where they exist in this version
STEPS = [
    ("kvxfer.agent.core", "Agent", "read_many"),
    ("kvxfer.agent.submit", "Submissions", "run_lane"),
    ("kvxfer.agent.reads", "ReadFlow", "_route"),
    ("kvxfer.agent.reads", "ReadFlow", "_claim"),
    ("kvxfer.agent.reads", "ReadFlow", "_launch_ipc"),
    ("kvxfer.agent.reads", "ReadFlow", "_settle"),
    ("kvxfer.agent.reads", "ReadFlow", "_post_direct_many"),
    ("kvxfer.agent.claims", "Claims", "answers"),
    ("kvxfer.engine.paths.kit", "PathKit", "launch_and_record"),
    ("kvxfer.engine.transfers", "TransferEngine", "grant"),
    ("kvxfer.engine.transfers", "TransferEngine", "attach"),
    ("kvxfer.engine.handles", "TransferHandle", "_finish"),
    ("kvxfer.engine.handles", "TransferHandle", "wait"),
    ("kvxfer.agent.claims", "Claims", "send_many"),
    ("kvxfer.engine.transfers", "TransferEngine", "reserve_many"),
    ("kvxfer.gpu.ops", "PairKernel", "launch"),
    ("kvxfer.engine.posted", "DirectJob", "__init__"),
    ("kvxfer.agent.notices", "DoneSender", "_run"),
    # the caller's share of a step, finer (module functions are wrapped where the caller imports them)
    ("kvxfer.agent.submit", "Submissions", "_pending_reads"),
    ("kvxfer.agent.submit", None, "check_block_id_lists"),
    ("kvxfer.agent.submit", None, "ready_links"),
    ("kvxfer.agent.reads", "ReadFlow", "start_here"),
    ("kvxfer.agent.reads", "ReadFlow", "_route_step"),
    ("kvxfer.agent.reads", "ReadFlow", "_start_tokened"),
    ("kvxfer.engine.readpaths", "ReadPaths", "launch_ipc"),
    ("kvxfer.engine.transfers", "TransferEngine", "_succeed"),
]


_INSTALLED: list["Timeline"] = []  # the process's one installed timeline (wrapping twice would nest)


def _thread(name: str) -> str:
    if name == "MainThread":
        return "caller"
    if name.startswith("kvxfer-peer"):
        return "lane"
    if name.startswith("kvxfer-done"):
        return "done-lane"
    if name == "kvxfer-consumer":
        return "progress"
    return name[:12]


class Timeline:
    """Marks of one step at a time (``start``, then the wrapped steps mark themselves, then
    ``record``); ``lines`` gives each mark's median offset from the steps' calls."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.offsets: dict[tuple[str, str], list[float]] = {}

    @classmethod
    def installed(cls) -> "Timeline":
        """The process's timeline, its steps wrapped (once)."""
        if not _INSTALLED:
            timeline = cls()
            for step in STEPS:
                timeline._wrap(*step)
            _INSTALLED.append(timeline)
        return _INSTALLED[0]

    def mark(self, label: str) -> None:
        self.events.append((time.perf_counter(), threading.current_thread().name, label))

    def start(self) -> float:
        """A step begins: forget the last one's marks; returns the step's clock reading."""
        self.events.clear()
        return time.perf_counter()

    def record(self, t0: float, batch: bool) -> None:
        """Keep the step's marks as offsets from ``t0``: each mark's first occurrence, and with
        ``batch`` (a step of several reads) its last too."""
        first: dict = {}
        last: dict = {}
        for t, thread, label in list(self.events):
            key = (label, _thread(thread))
            first.setdefault(key, t - t0)
            last[key] = t - t0
        for key, t in first.items():
            self.offsets.setdefault(key, []).append(t)
            if batch and last[key] != t:
                self.offsets.setdefault((key[0] + " (last)", key[1]), []).append(last[key])

    def lines(self) -> list[str]:
        med = statistics.median
        out = [f"  {'us after the call':>18}  {'thread':9} step (> begins, < ends; first occurrence per step, and last)"]
        for (label, thread), times in sorted(self.offsets.items(), key=lambda kv: med(kv[1])):
            out.append(f"  {med(times) * 1e6:18.0f}  {thread:9} {label}  (seen in {len(times)})")
        return out

    def _wrap(self, module: str, cls: str | None, name: str) -> None:
        owner = importlib.import_module(module) if cls is None else getattr(importlib.import_module(module), cls, None)
        fn = getattr(owner, name, None)
        if fn is None:
            return
        label = f"{cls or module.rsplit('.', 1)[-1]}.{name}"
        mark = self.mark

        def wrapper(*args, **kwargs):
            mark(label + " >")
            try:
                return fn(*args, **kwargs)
            finally:
                mark(label + " <")
        setattr(owner, name, wrapper)
