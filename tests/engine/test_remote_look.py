"""The look at a hold word on another host never waits on the polling thread, and binds to the
read's deadline (issue 35 across hosts, issue 34's rule 3).

The look is one small backend READ of the producer's word. It used to be posted and then waited
for (up to 5 s, on the real clock) inside the engine's success path, on whichever thread polled
the read: an engine thread calling ``Agent.poll()`` could stall there, and a read whose producer
froze after the move ended 5 s later whatever its timeout. Now the first poll posts it, later
polls look at it without waiting, and a look still out at the read's deadline fails the read.
"""

import numpy as np

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.clock import ManualClock
from kvxfer.agent.tokens import TokenReads
from kvxfer.engine.remotewords import WordReader
from kvxfer.engine.transfers import Part, TransferEngine
from kvxfer.errors import LeaseExpiredError, TransferTimeoutError
from kvxfer.types import Direction, HoldToken, MemKind, Region


class _Registry:
    def __init__(self, backend):
        self._backend = backend

    def register_buffer(self, array):
        region = Region(array.ctypes.data, array.nbytes, 0, MemKind.DRAM)
        self._backend.register([region])
        return region


def _pair():
    world = FakeWorld()
    me, prod = FakeBackend("me", world), FakeBackend("prod", world)
    me.add_peer(prod.metadata())
    words = np.zeros((8, 2), dtype="<u8")          # the producer's table of hold words
    prod.register([Region(words.ctypes.data, words.nbytes, 0, MemKind.DRAM)])
    reader = WordReader(me, _Registry(me), rows=2)
    view = reader.view("prod", words.ctypes.data, 8, timeout=3600.0)
    return me, words, reader, view


def test_a_look_in_flight_is_reported_pending_not_waited_for():
    me, words, reader, view = _pair()
    token = HoldToken(3, 7, 0xABC)
    words[3] = (7, 0xABC)
    me.hold_transfers(True)                     # the producer does not answer the look yet
    verify = TokenReads.verifier(view, "r", token)
    from kvxfer.engine.transfers import LOOKING
    assert verify() is LOOKING                  # posted, not waited for
    assert verify() is LOOKING                  # still out: polled again, no second READ
    assert me.posted == 1
    me.hold_transfers(False)
    assert verify() is None                     # the word equals the token: the hold covered the move


def test_a_changed_word_fails_the_read_typed():
    me, words, reader, view = _pair()
    words[3] = (8, 0xABC)                       # a later hold of that slot
    error = TokenReads.verifier(view, "r", HoldToken(3, 7, 0xABC))()
    assert isinstance(error, LeaseExpiredError) and "epoch 8" in str(error)


def test_a_given_up_look_keeps_its_row_until_its_read_ended():
    me, words, reader, view = _pair()
    me.hold_transfers(True)
    first = TokenReads.verifier(view, "a", HoldToken(1, 1, 1))
    second = TokenReads.verifier(view, "b", HoldToken(2, 1, 1))
    first(), second()                           # both rows in use
    first.cancel()                              # its READ may still write into its row
    third = TokenReads.verifier(view, "c", HoldToken(3, 1, 1))
    from kvxfer.engine.transfers import LOOKING
    assert third() is LOOKING and me.posted == 2  # no row free yet: nothing posted
    words[3] = (1, 1)
    me.hold_transfers(False)                    # the given-up READ ends: its row comes back
    assert third() is None and me.posted == 3   # posted now (the fake answers at once): the word matches


def test_a_read_whose_look_does_not_come_back_fails_at_its_deadline():
    me, words, reader, view = _pair()
    clock = ManualClock()
    engine = TransferEngine(me, MemKind.DRAM, clock=clock)
    (req,) = engine.reserve_many([("r", clock.now() + 1.0, [0])], Direction.READ, granted=True)
    me.hold_transfers(True)
    req.verify = TokenReads.verifier(view, "r", HoldToken(3, 7, 0xABC))

    class Done:
        num_bytes, descriptors, notifies, moves_itself = 10, 1, False, False

        def poll(self):
            return True

        def cancel(self):
            return True

    with engine.posting([req]):
        engine.attach(req, [Part("prod", None, MemKind.DRAM, b"", job=Done())], started=True)
    engine.progress()
    assert not req.handle.done()                # the bytes are in; the look is out
    clock.advance(1.01)
    engine.progress()
    engine.progress()
    assert req.handle.done()
    error = req.handle.exception()
    assert isinstance(error, TransferTimeoutError) and "hold word" in str(error)
