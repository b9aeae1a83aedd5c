"""What starting a thread costs the calling thread while another thread runs Python (kvxfer.starter).

``Thread.start()`` returns once the new thread has run, and that needs the interpreter; handing
the thread to ``kvxfer.starter`` (one starter thread per process) costs the caller a queue put.
Prints p50 / max over 50 starts, idle and with one thread spinning in Python, for both.

    .venv/bin/python benchmarks/thread_start_cost.py
"""

from __future__ import annotations

import statistics
import threading
import time

from kvxfer import starter


def _timed(start, n: int = 50) -> tuple[float, float]:
    took = []
    for _ in range(n):
        thread = threading.Thread(target=lambda: None, daemon=True)
        began = time.perf_counter()
        start(thread)
        took.append(time.perf_counter() - began)
        starter.join_started(thread, 5)
    return statistics.median(took) * 1e3, max(took) * 1e3


def main() -> None:
    starter.ready()
    spinning = threading.Event()
    for busy in (False, True):
        if busy:
            def spin() -> None:
                while spinning.is_set():
                    pass
            spinning.set()
            threading.Thread(target=spin, daemon=True).start()
        for label, start in (("Thread.start()", threading.Thread.start), ("starter.start_soon", starter.start_soon)):
            p50, top = _timed(start)
            print(f"{'one thread spinning' if busy else 'idle':20s} {label:20s} p50 {p50:.3f} ms, max {top:.3f} ms")
    spinning.clear()


if __name__ == "__main__":
    main()
