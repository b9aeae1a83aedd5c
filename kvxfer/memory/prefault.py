"""Fault registered host memory in at registration, not during the first transfer into it (layer: memory; imports only the standard library and types).

Memory that was allocated but never written (``np.zeros`` / ``np.empty`` / ``torch.empty`` of a
large size: the kernel maps it lazily) costs one page fault per 4 KiB page the first time
something writes it. A read into such a cache paid them inside its transfer: across two network
namespaces a new process's first 64 MiB read took +86-89 ms over a warm read with the cache
untouched, +17 ms with it written first (benchmarks/new_process_first_read.py,
docs/benchmarks.md "First contact"). ``prefault(regions)`` asks the kernel to map the pages of
the host-memory regions writable now (Linux ``madvise(MADV_POPULATE_WRITE)``, 5.14+), which
changes no byte: pages already present cost a page-table walk (~0.2 ms per 128 MiB), untouched
ones their fault (~35 ms per 128 MiB on the 2-core CPU host), and they count as used memory from
then on, as memory registered for RDMA (pinned) always does.

Only private, writable, anonymous mappings are populated (the heap and ``mmap`` ed anonymous
memory, where every KV cache of numpy or torch lives); file-backed or shared mappings are left
alone (writing them in would dirty file pages). Best effort: on any other platform, an older
kernel or any error nothing happens and registration goes on. ``KVXFER_PREFAULT=0`` turns it
off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
from typing import Sequence

from kvxfer.types import MemKind, Region

__all__ = ["OPT_OUT", "prefault", "private_anonymous_spans"]

OPT_OUT = "KVXFER_PREFAULT"
_MADV_POPULATE_WRITE = 23
log = logging.getLogger("kvxfer.memory")
_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def private_anonymous_spans(maps_text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the mappings in a ``/proc/<pid>/maps`` text that are readable,
    writable, private and anonymous (no file; ``[heap]`` counts as anonymous, other bracketed
    names such as ``[stack]`` and ``[vvar]`` do not)."""
    spans = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or not parts[1].startswith("rw") or parts[1][3:4] != "p":
            continue
        name = parts[5].strip() if len(parts) == 6 else ""
        if name and name != "[heap]":
            continue
        lo, _, hi = parts[0].partition("-")
        spans.append((int(lo, 16), int(hi, 16)))
    return spans


def prefault(regions: Sequence[Region]) -> float:
    """Map the host-memory (``MemKind.DRAM``) pages of ``regions`` writable now, where they lie
    in private anonymous mappings; returns the seconds it took (0.0 when it did nothing).

    Never raises and changes no byte of the regions; see the module docstring."""
    if os.environ.get(OPT_OUT, "").strip().lower() in ("0", "false", "off", "no"):
        return 0.0
    if not sys.platform.startswith("linux"):
        return 0.0
    host = [r for r in regions if MemKind(r.kind) is MemKind.DRAM and r.length > 0]
    if not host:
        return 0.0
    started = time.perf_counter()
    try:
        with open("/proc/self/maps") as f:
            spans = private_anonymous_spans(f.read())
        madvise, page = _libc_madvise(), mmap.PAGESIZE
        for r in host:
            lo, hi = r.addr // page * page, -(-(r.addr + r.length) // page) * page
            for start, end in spans:
                a, b = max(lo, start), min(hi, end)
                if a < b and madvise(a, b - a, _MADV_POPULATE_WRITE) != 0:
                    log.debug("prefault of %#x+%d skipped (errno %d)", a, b - a, ctypes.get_errno())
                    return time.perf_counter() - started  # unsupported here: the rest would fail too
    except (OSError, AttributeError, ValueError) as exc:
        log.debug("prefault skipped: %s", exc)
    return time.perf_counter() - started
