"""A grant taken after its read's deadline never completes the read, even when the bytes had
landed in time (the kernel path moves before its grant): the read fails with
``TransferTimeoutError``, as a poll past the deadline fails it. Before, ``grant`` completed such a
read at once, reporting success after its deadline."""

import pytest

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import TransferTimeoutError
from kvxfer.types import Direction, MemKind


class Landed:
    num_bytes, descriptors, notifies, moves_itself = 100, 1, False, True

    def poll(self) -> bool:
        return True

    def cancel(self) -> bool:
        return True


def _landed_read(clock: ManualClock):
    world = FakeWorld()
    me, peer = FakeBackend("me", world), FakeBackend("peer", world)
    me.add_peer(peer.metadata())
    engine = TransferEngine(me, MemKind.VRAM, clock=clock)
    (req,) = engine.reserve_many([("r", clock.now() + 1.0, [1])], Direction.READ, granted=False)
    with engine.posting([req]):
        engine.attach(req, [Part("peer", None, MemKind.VRAM, b"", job=Landed())], started=True)
    engine.progress()                 # its bytes are in; it waits for its grant
    assert not req.handle.done()
    return engine, req


def test_a_grant_after_the_deadline_fails_a_landed_read():
    clock = ManualClock()
    engine, req = _landed_read(clock)
    clock.advance(1.5)                # the claim's answer comes after the read's deadline
    engine.grant(req)
    with pytest.raises(TransferTimeoutError, match="had not granted the claim when its deadline passed"):
        req.handle.wait(0)


def test_a_grant_in_time_completes_a_landed_read():
    clock = ManualClock()
    engine, req = _landed_read(clock)
    clock.advance(0.5)
    engine.grant(req)
    assert req.handle.wait(0).num_bytes == 100
