"""Registering host memory faults its untouched pages in (kvxfer.memory.prefault), changing no byte,
and a prefault that cannot happen never fails the registration."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from kvxfer.memory import MemoryRegistry, prefault as pf
from kvxfer.testing import FakeBackend, FakeWorld

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
SIZE = 4 << 20


def _resident_pages(arr: np.ndarray) -> int:
    """How many of ``arr``'s pages are in memory (``mincore``)."""
    pages = -(-arr.nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(arr.ctypes.data), arr.nbytes, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def _untouched() -> tuple[mmap.mmap, np.ndarray]:
    """A private anonymous mapping nothing has written yet (page-aligned, so mincore takes it)."""
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE)
    return m, np.frombuffer(m, dtype=np.uint8)


@pytest.fixture
def registry():
    backend = FakeBackend("prefault", FakeWorld())
    reg = MemoryRegistry(backend)
    yield reg
    reg.close()
    backend.close()


def test_register_faults_untouched_pages_in_and_changes_no_byte(registry):
    m, arr = _untouched()
    pattern = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    written = np.frombuffer(mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE), dtype=np.uint8)
    written[:] = pattern
    assert _resident_pages(arr) == 0
    registry.register_buffer(arr)
    registry.register_buffer(written)
    assert _resident_pages(arr) == SIZE // mmap.PAGESIZE
    assert not arr.any() and np.array_equal(written, pattern)


def test_opt_out_leaves_pages_untouched(registry, monkeypatch):
    monkeypatch.setenv(pf.OPT_OUT, "0")
    m, arr = _untouched()
    registry.register_buffer(arr)
    assert _resident_pages(arr) == 0


def test_a_failing_prefault_does_not_fail_registration(registry, monkeypatch):
    monkeypatch.setattr(pf, "_madvise", lambda *a: -1)  # e.g. a kernel older than 5.14 (EINVAL)
    m, arr = _untouched()
    region = registry.register_buffer(arr)
    assert registry.contains(region.addr, region.length) and _resident_pages(arr) == 0


def test_only_private_anonymous_writable_mappings_are_populated():
    maps = "\n".join([
        "7f0000000000-7f0000100000 rw-p 00000000 00:00 0 ",
        "7f0000100000-7f0000200000 rw-s 00000000 00:01 42                         /dev/shm/x",
        "7f0000200000-7f0000300000 rw-p 00000000 08:01 77                         /data/cache.bin",
        "7f0000300000-7f0000400000 r--p 00000000 00:00 0 ",
        "55d000000000-55d000100000 rw-p 00000000 00:00 0                          [heap]",
        "7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0                          [stack]",
    ])
    assert pf.private_anonymous_spans(maps) == [(0x7F0000000000, 0x7F0000100000), (0x55D000000000, 0x55D000100000)]
