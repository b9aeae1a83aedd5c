"""The staged pipeline's protocol (pieces, slots, credits, READ and WRITE) over FakeBackend, on host memory.

A host stand-in for the CUDA kernel executes the same copy tables with numpy, so these run
everywhere; the GPU group runs the same pipeline with the real kernel and NIXL.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from kvxfer.backend.base import descs
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.errors import ProtocolError, TransferTimeoutError
from kvxfer.gpu.ops import pair_copy_numpy
from kvxfer.layout.pairs import pack_pairs, unpack_pairs
from kvxfer.engine.paths.pipeline import (DATA, PipeMessage, StagingArea, drain, fetch_read, push_write,
                                          receive_write, serve_read, split_pieces)
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.types import Direction, MemKind

from .oracle import element_view, expected_move


class _Event:
    done = True

    def record(self, stream):
        pass


class _Stream:
    ptr = 0

    def synchronize(self):
        pass


class _Device:
    def __init__(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class HostKernel:
    """Executes copy tables at once on host memory (events are always done)."""

    def __init__(self, memory: np.ndarray):
        self.memory, self.device, self.launches = memory, 0, 0
        cuda = types.SimpleNamespace(Device=_Device, Stream=lambda non_blocking: _Stream(),
                                     Event=lambda block, disable_timing: _Event())
        self.cp = types.SimpleNamespace(cuda=cuda)

    def launch(self, copy, stream=None):
        self.launches += 1
        pair_copy_numpy(copy, self.memory)


class Link:
    def __init__(self, me: FakeBackend, peer: str):
        self.me, self.peer = me, peer

    def send(self, message: bytes) -> None:
        self.me.notify(self.peer, message)

    def receive(self) -> list[bytes]:
        return [m for sender, m in self.me.notifications() if sender == self.peer]


def _setup(direction: str, slots: int, slot_bytes: int):
    p = KVSpec(num_layers=3, num_kv_heads=4, head_dim=16, block_size=4, num_blocks=40, layout="HND")
    d = KVSpec(num_layers=3, num_kv_heads=4, head_dim=16, block_size=8, num_blocks=20, tp_size=2, tp_rank=1)
    rng = np.random.default_rng(3)
    staging = 2 * slots * slot_bytes
    mem = rng.integers(0, 256, p.cache_bytes + 2 * d.cache_bytes + staging, dtype=np.uint8)
    base = int(mem.ctypes.data)
    pg, dg = CacheGeometry.contiguous(p, base), CacheGeometry.contiguous(d, base + p.cache_bytes)
    wg = CacheGeometry.contiguous(d, base + p.cache_bytes + d.cache_bytes)
    want = element_view(d, mem, wg)
    want[...] = element_view(d, mem, dg)
    p_ids, d_ids = rng.permutation(40)[:24], rng.permutation(20)[:12]
    expected_move(p, element_view(p, mem, pg), p_ids, d, want, d_ids, 96)
    world = FakeWorld()
    pb, cb = FakeBackend("prod", world), FakeBackend("cons", world)
    pb.add_peer(cb.metadata())
    cb.add_peer(pb.metadata())
    spare = [base + p.cache_bytes + 2 * d.cache_bytes + i * slots * slot_bytes for i in range(2)]
    alloc = iter(spare)
    p_area = StagingArea(pb, 0, slot_bytes, slots, allocate=lambda n, dev: (None, next(alloc)))
    c_area = StagingArea(cb, 0, slot_bytes, slots, allocate=lambda n, dev: (None, next(alloc)))
    for backend, spec, geom in ((pb, p, pg), (cb, d, dg)):
        from kvxfer.types import MemKind, Region
        backend.register([Region(int(geom.bases.min()), spec.cache_bytes, 0, MemKind.VRAM)])
    kernel = HostKernel(mem)
    pack = pack_pairs(p, pg, p_ids, d, d_ids, 0)
    unpack = unpack_pairs(p, p_ids, d, dg, d_ids, 0)
    return locals()


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("slots,slot_kib", [(1, 4), (2, 4), (4, 16), (3, 8)])
def test_pipeline_moves_every_byte(direction, slots, slot_kib):
    s = _setup(direction, slots, slot_kib << 10)
    deadline = time.monotonic() + 20
    pieces = len(split_pieces(s["pack"], slot_kib << 10))
    plink, clink = Link(s["pb"], "cons"), Link(s["cb"], "prod")
    if direction == "read":
        prod = lambda: serve_read(7, s["pack"], s["p_area"], s["kernel"], plink, deadline)  # noqa: E731
        cons = lambda: fetch_read(7, s["unpack"], s["c_area"], s["kernel"], clink, s["cb"], "prod",  # noqa: E731
                                  s["p_area"].slot_addr, 0, deadline)
    else:
        prod = lambda: push_write(7, s["pack"], s["p_area"], s["kernel"], plink, s["pb"], "cons",  # noqa: E731
                                  s["c_area"].slot_addr, s["c_area"].slots, 0, deadline)
        cons = lambda: receive_write(7, s["unpack"], s["c_area"], s["kernel"], clink, deadline)  # noqa: E731
    errors = []
    t = threading.Thread(target=lambda: _catch(prod, errors))
    t.start()
    _catch(cons, errors)
    t.join()
    assert not errors, errors
    assert s["kernel"].launches == 2 * pieces and pieces >= 2
    d = s["d"]
    got = element_view(d, s["mem"], s["dg"])
    assert np.array_equal(got, s["want"])


def _waits_for_the_clock(clock: ManualClock, fn) -> list:
    """Run ``fn`` in a thread: it must still be waiting after 50 ms of real time and end once
    ``clock`` moves 10 s. Returns what it raised (or ``[]``)."""
    errors: list = []
    t = threading.Thread(target=lambda: _catch(fn, errors))
    t.start()
    t.join(0.05)
    waiting = t.is_alive()
    clock.advance(10.0)
    t.join(5.0)
    assert waiting, f"gave up on the real clock: {errors}"
    assert not t.is_alive()
    return errors


@pytest.mark.parametrize("side", ["fetch_read", "receive_write"])
def test_a_consumer_with_no_producer_times_out_on_the_clock_it_is_given(side):
    s = _setup("read", 2, 4 << 10)
    # Far before time.monotonic(): a loop that read the real clock would give up at once.
    clock = ManualClock(start=-1e6)
    deadline = clock.now() + 5
    link = Link(s["cb"], "prod")  # no producer runs: nothing ever arrives
    if side == "fetch_read":
        run = lambda: fetch_read(7, s["unpack"], s["c_area"], s["kernel"], link, s["cb"], "prod",  # noqa: E731
                                 s["p_area"].slot_addr, 0, deadline, clock=clock)
    else:
        run = lambda: receive_write(7, s["unpack"], s["c_area"], s["kernel"], link, deadline,  # noqa: E731
                                    clock=clock)
    errors = _waits_for_the_clock(clock, run)
    assert len(errors) == 1 and isinstance(errors[0], TransferTimeoutError), errors
    assert "deadline passed" in str(errors[0])


def test_drain_waits_for_a_pending_move_until_its_clock_says_so():
    s = _setup("read", 2, 4 << 10)
    clock = ManualClock(start=-1e6)
    cb, area = s["cb"], s["c_area"]
    cb.hold_transfers(True)  # the move stays PENDING
    xid = cb.post(Direction.READ, descs([area.slot_addr(0)], 256, 0), MemKind.VRAM,
                  descs([s["p_area"].slot_addr(0)], 256, 0), MemKind.VRAM, "prod", b"")
    stuck: list = []
    errors = _waits_for_the_clock(clock, lambda: stuck.append(drain(cb, [xid], clock.now() + 1, clock=clock)))
    assert not errors and stuck == [[xid]]  # still pending when the clock passed: left unreleased
    cb.hold_transfers(False)
    assert drain(cb, [xid], clock.now(), clock=clock) == []


def _catch(fn, errors):
    try:
        fn()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_messages_round_trip_and_refuse_bad_versions():
    msg = PipeMessage(DATA, 2**40, 1234, 3)
    assert PipeMessage.decode(msg.encode()) == msg
    assert PipeMessage.decode(b"other traffic") is None
    raw = bytearray(msg.encode())
    raw[3] = 9
    with pytest.raises(ProtocolError, match="version"):
        PipeMessage.decode(bytes(raw))
