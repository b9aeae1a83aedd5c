"""FakeBackend really moves bytes, refuses unregistered memory and injects faults."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.backend.base import Backend, descs
from kvxfer.errors import ClosedError, ConfigError, PeerLostError, RegistrationError, TransferFailedError
from kvxfer.testing import FakeBackend, FakeWorld
from kvxfer.types import Direction, MemKind, Region, XferState

DRAM = MemKind.DRAM


def region(buf: np.ndarray) -> Region:
    return Region(buf.ctypes.data, buf.nbytes, 0, DRAM)


@pytest.fixture
def pair():
    """Two agents that know each other, each with a registered 64 KiB buffer."""
    world = FakeWorld()
    a, b = FakeBackend("a", world), FakeBackend("b", world)
    buf_a = np.zeros(1 << 16, np.uint8)
    buf_b = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    a.register([region(buf_a)])
    b.register([region(buf_b)])
    assert a.add_peer(b.metadata()) == "b" and b.add_peer(a.metadata()) == "a"
    yield a, b, buf_a, buf_b
    a.close()
    b.close()


def rows(buf: np.ndarray, offsets, length: int) -> np.ndarray:
    return descs(buf.ctypes.data + np.asarray(offsets, np.uint64), length, 0)


def test_fake_is_a_backend(pair):
    assert isinstance(pair[0], Backend)


def test_read_copies_remote_bytes_and_notifies(pair):
    a, b, buf_a, buf_b = pair
    x = a.post(Direction.READ, rows(buf_a, [0, 4096], 1024), DRAM,
               rows(buf_b, [8192, 100], 1024), DRAM, "b", b"req-1")
    assert a.state(x) is XferState.DONE
    assert np.array_equal(buf_a[:1024], buf_b[8192:9216])
    assert np.array_equal(buf_a[4096:5120], buf_b[100:1124])
    assert not buf_a[1024:4096].any()
    assert b.notifications() == [("a", b"req-1")]
    assert b.notifications() == []


def test_write_pushes_local_bytes(pair):
    a, b, buf_a, buf_b = pair
    buf_a[:] = 7
    x = a.post(Direction.WRITE, rows(buf_a, [0], 512), DRAM, rows(buf_b, [512], 512), DRAM, "b", b"")
    assert a.state(x) is XferState.DONE
    assert (buf_b[512:1024] == 7).all() and not (buf_b[:512] == 7).all()
    assert b.notifications() == []  # empty notification: nothing delivered


def test_prepared_path_picks_rows(pair):
    a, b, buf_a, buf_b = pair
    lp = a.prepare(None, rows(buf_a, np.arange(8) * 256, 256), DRAM)
    rp = a.prepare("b", rows(buf_b, np.arange(8) * 256, 256), DRAM)
    x = a.post_prepared(Direction.READ, lp, np.array([0, 1]), rp, np.array([7, 3]), "b", b"p")
    assert a.state(x) is XferState.DONE
    assert np.array_equal(buf_a[:256], buf_b[1792:2048])
    assert np.array_equal(buf_a[256:512], buf_b[768:1024])
    with pytest.raises(ConfigError, match=r"\[0, 8\)"):
        a.post_prepared(Direction.READ, lp, np.array([8]), rp, np.array([0]), "b", b"")
    with pytest.raises(ConfigError, match="expected a local list"):
        a.post_prepared(Direction.READ, rp, np.array([0]), rp, np.array([0]), "b", b"")


def test_unregistered_memory_is_refused_with_address(pair):
    a, b, buf_a, buf_b = pair
    stray = np.zeros(4096, np.uint8)
    with pytest.raises(RegistrationError, match=hex(stray.ctypes.data)):
        a.post(Direction.READ, rows(stray, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"")
    # a range that starts inside the peer's buffer but runs past its end
    with pytest.raises(RegistrationError, match="remote range"):
        a.post(Direction.READ, rows(buf_a, [0], 128), DRAM, rows(buf_b, [buf_b.nbytes - 64], 128),
               DRAM, "b", b"")
    assert not stray.any() and not buf_a[:128].any()


def test_bad_descriptors_are_config_errors(pair):
    a, b, buf_a, buf_b = pair
    with pytest.raises(ConfigError, match="local length 64 != remote length 32"):
        a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 32), DRAM, "b", b"")
    with pytest.raises(ConfigError, match="counts must match; got 1 and 2"):
        a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0, 64], 64), DRAM, "b", b"")
    with pytest.raises(ConfigError, match=r"local_kind must be one of \['DRAM', 'VRAM'\]; got 'SSD'"):
        a.post(Direction.READ, rows(buf_a, [0], 64), "SSD", rows(buf_b, [0], 64), DRAM, "b", b"")
    with pytest.raises(ConfigError, match="unknown peer 'zz'"):
        a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "zz", b"")


def test_fail_next_fails_without_copying(pair):
    a, b, buf_a, buf_b = pair
    a.fail_next(1)
    x = a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"n")
    assert a.state(x) is XferState.FAILED
    assert isinstance(a.failure(x), TransferFailedError)
    assert not buf_a[:64].any() and b.notifications() == []
    y = a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"n")
    assert a.state(y) is XferState.DONE and np.array_equal(buf_a[:64], buf_b[:64])


def test_held_transfers_stay_pending_until_released(pair):
    a, b, buf_a, buf_b = pair
    a.hold_transfers(True)
    x = a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"x")
    y = a.post(Direction.READ, rows(buf_a, [64], 64), DRAM, rows(buf_b, [64], 64), DRAM, "b", b"y")
    assert a.state(x) is XferState.PENDING and not buf_a[:128].any()
    a.release(y)  # cancelled while held: never copied
    a.hold_transfers(False)
    assert a.state(x) is XferState.DONE and np.array_equal(buf_a[:64], buf_b[:64])
    assert not buf_a[64:128].any()
    assert b.notifications() == [("a", b"x")]


def test_killed_peer_is_lost(pair):
    a, b, buf_a, buf_b = pair
    a.hold_transfers(True)
    x = a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"")
    b.kill()
    a.hold_transfers(False)
    assert a.state(x) is XferState.FAILED and isinstance(a.failure(x), PeerLostError)
    with pytest.raises(PeerLostError):
        a.post(Direction.READ, rows(buf_a, [0], 64), DRAM, rows(buf_b, [0], 64), DRAM, "b", b"")
    with pytest.raises(PeerLostError):
        a.notify("b", b"hello")
    with pytest.raises(ClosedError):
        b.notifications()
    assert not buf_a[:64].any()


def test_notify_and_close(pair):
    a, b, *_ = pair
    a.notify("b", b"m1")
    b.notify("a", b"m2")
    assert b.notifications() == [("a", b"m1")] and a.notifications() == [("b", b"m2")]
    a.close()
    a.close()
    with pytest.raises(ClosedError):
        a.metadata()


def test_deregistered_memory_is_refused(pair):
    a, b, buf_a, buf_b = pair
    extra = np.ones(256, np.uint8)
    h = b.register([region(extra)])
    x = a.post(Direction.READ, rows(buf_a, [0], 256), DRAM, rows(extra, [0], 256), DRAM, "b", b"")
    assert a.state(x) is XferState.DONE and (buf_a[:256] == 1).all()
    b.deregister(h)
    with pytest.raises(RegistrationError):
        a.post(Direction.READ, rows(buf_a, [0], 256), DRAM, rows(extra, [0], 256), DRAM, "b", b"")
    with pytest.raises(ConfigError, match="unknown registration handle"):
        b.deregister(h)


def test_duplicate_name_and_bad_metadata():
    world = FakeWorld()
    a = FakeBackend("a", world)
    with pytest.raises(ConfigError, match="already live"):
        FakeBackend("a", world)
    with pytest.raises(ConfigError, match="expected FakeBackend metadata"):
        a.add_peer(b"garbage")
    a.close()
    FakeBackend("a", world).close()  # the name is free again after close
