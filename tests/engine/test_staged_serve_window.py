"""A staged producer keeps a slot it announced to a consumer until that consumer can no longer read it.

Before (audit R1): the producer served a ``PackRequest`` for at most its own ``lease_timeout``,
though the claim window it had granted the consumer could be far longer (up to ``max_window``).
When that shorter deadline passed while the consumer's READ of an announced slot was still in
flight, the serve ended and handed its slots back; another read packed its bytes into them, the
first READ then copied those bytes, and the first read SUCCEEDED with another request's bytes.
A serve that ended early (the hold freed under it) also handed back slots a READ might still be
reading. Now the serve runs until the claim window it granted ends, and a serve that stops with
slots announced and not freed keeps them out of the pool until they are freed or the window has
passed.

The producer runs on a ``ManualClock``: its lease passes when the test says so, never during the
test's own waits. FakeBackend copies when a transfer completes, so a transfer held with
``hold_transfers`` is a READ still in flight.
"""

import collections
import threading

import numpy as np
import pytest

from kvxfer.clock import ManualClock
from kvxfer.errors import KvxferError

from agent_helpers import spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


class _MarkedClock(ManualClock):
    """A ManualClock that counts, per thread name, the reads of it at or after its last ``jump``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()
        self._mark = float("inf")

    def now(self) -> float:
        t = super().now()
        if t >= self._mark:
            self.reads[threading.current_thread().name] += 1
        return t

    def jump(self, seconds: float) -> None:
        self.advance(seconds)
        self._mark = super().now()


def _thread_alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def _holds(cache, want, local, remote) -> bool:
    return all(np.array_equal(got[:, local], w[:, remote]) for got, w in zip(cache, want))


def test_a_serve_outlives_the_producers_lease_inside_the_window_it_granted(harness):
    clock = _MarkedClock()
    s = spec()
    prod, pcache = harness.agent(s, seed=1, clock=clock, lease_timeout=1.0, **STAGED)
    c1, cache1 = harness.agent(s, seed=2, listen=False, **STAGED)
    c2, cache2 = harness.agent(s, seed=3, listen=False, **STAGED)
    c1.connect(*prod.address)
    c2.connect(*prod.address)
    packer, kit = prod._paths.packer, prod._paths.kit
    prod.hold("A", [1, 2])
    c1._backend.hold_transfers(True)                       # c1's READ of the slot stays in flight
    ha = c1.read(prod.address, [3, 4], [1, 2], "A", timeout=30)   # a 30 s window granted
    assert wait_for(lambda: len(c1._backend._held) >= 1, 10), "no READ posted"

    clock.jump(2.0)                                        # past the lease (1 s), inside the window
    # The serve either ended at its deadline (before the fix) or went on past the jump: a second
    # look at the clock after it, still serving.
    assert wait_for(lambda: packer.serving() == 0 or clock.reads["kvxfer-serve-A"] >= 2, 10)

    prod.hold("B", [5, 6])
    hb = c2.read(prod.address, [3, 4], [5, 6], "B", timeout=30)
    # Before the fix B got A's slots and completed here; now it waits for them behind A's READ.
    assert wait_for(lambda: hb.done() or packer.serving() == 2, 10)

    c1._backend.hold_transfers(False)                      # A's READ ends: it reads the slot as it is now
    try:
        ha.wait(10)
        a_exact = _holds(cache1, pcache, [3, 4], [1, 2])
        assert a_exact, "read A succeeded with bytes that are not A's"
    except KvxferError:
        pass                                               # a typed failure keeps the promise too
    hb.wait(10)
    assert _holds(cache2, pcache, [3, 4], [5, 6])
    assert wait_for(lambda: kit.slots_in_use == 0, 10)


def test_a_serve_that_stops_with_a_slot_lent_keeps_it_until_the_window_passes(harness):
    clock = ManualClock()
    s = spec()
    prod, _ = harness.agent(s, seed=1, clock=clock, **STAGED)
    cons, _ = harness.agent(s, seed=2, listen=False, **STAGED)
    cons.connect(*prod.address)
    kit = prod._paths.kit
    prod.hold("A", [1, 2])
    cons._backend.hold_transfers(True)                     # the READ of the announced slot stays in flight
    ha = cons.read(prod.address, [3, 4], [1, 2], "A", timeout=30)
    assert wait_for(lambda: len(cons._backend._held) >= 1, 10), "no READ posted"

    cons.abort("A")                                        # the producer frees the hold: its serve is cancelled
    assert wait_for(lambda: not _thread_alive("kvxfer-serve-A"), 10)   # ended, its cleanup done
    assert kit.slots_in_use == kit.slots_per_transfer(1), "slots handed back while a READ of one may be in flight"

    clock.advance(31.0)                                    # the window granted has passed
    assert wait_for(lambda: kit.slots_in_use == 0, 10)
    assert kit.router.active() == 0
    cons._backend.hold_transfers(False)
    with pytest.raises(KvxferError):
        ha.wait(10)                                        # aborted: typed, once its READ has ended
