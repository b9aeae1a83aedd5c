"""Transfer handles (wait, await, callbacks) and the staging allocator."""

import asyncio
import threading

import pytest

from kvxfer.engine.handles import TransferHandle, TransferStats
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import TransferError, TransferFailedError, WaitTimeout


def test_wait_times_out_with_typed_error_naming_request():
    h = TransferHandle("req-7")
    with pytest.raises(WaitTimeout, match="req-7") as info:
        h.wait(0.01)
    assert isinstance(info.value, TimeoutError) and not isinstance(info.value, TransferError)
    assert info.value.request_id == "req-7" and info.value.timeout == 0.01
    assert not h.done()


def test_wait_returns_stats_and_reraises_errors():
    ok = TransferHandle("a")
    ok._finish(stats=TransferStats("a", num_bytes=10))
    assert ok.wait(0).num_bytes == 10
    bad = TransferHandle("b")
    bad._finish(error=TransferFailedError("boom"))
    with pytest.raises(TransferFailedError):
        bad.wait(0)
    assert not bad._finish(stats=TransferStats("b"))  # completes exactly once


def test_await_from_another_thread():
    h = TransferHandle("x")

    async def main():
        threading.Timer(0.02, lambda: h._finish(stats=TransferStats("x", num_bytes=3))).start()
        return await h

    assert asyncio.run(main()).num_bytes == 3


def test_await_raises_transfer_error():
    h = TransferHandle("x")
    h._finish(error=TransferFailedError("nope"))

    async def main():
        return await h

    with pytest.raises(TransferFailedError):
        asyncio.run(main())


def test_staging_allocator_reuses_and_merges_ranges():
    a = StagingAllocator(1024, align=256)
    x, y, z = a.allocate(256), a.allocate(300), a.allocate(256)
    assert (x, y, z) == (0, 256, 768)
    assert a.allocate(1) is None
    a.free(y)
    a.free(z)
    assert a.allocate(768) == 256  # freed neighbours merged into one range
    a.free(x)
    a.free(x)  # freeing twice is harmless
    assert a.in_use == 768
