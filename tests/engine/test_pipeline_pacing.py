"""A staged pipeline loop that waits on its peer sleeps on its link instead of spinning with the GIL.

``kvxfer.engine.paths.pipeline._Pacer`` paces every pipeline loop; ``PipeLink.wait`` is what it
blocks on, woken by the next message (``put``, called by the agent's progress loop) or by
``stop`` (cancellation).
"""

import threading
import time

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.engine.paths import pipeline
from kvxfer.engine.paths.pipes import PipeLink
from kvxfer.errors import TransferFailedError


class _CountingLink:
    def __init__(self):
        self.waits = []

    def wait(self, timeout):
        self.waits.append(timeout)


def test_idle_turns_yield_then_wait_on_the_link_and_a_busy_turn_starts_over():
    link = _CountingLink()
    pacer = pipeline._Pacer(link)
    pacer.turn(False)
    assert link.waits == []                        # the first idle turn only yields
    time.sleep(pipeline.IDLE_SPIN * 2)
    pacer.turn(False)
    assert link.waits == [pipeline.IDLE_WAIT]      # idle for longer than IDLE_SPIN: wait on the link
    pacer.turn(True)
    pacer.turn(False)
    assert len(link.waits) == 1                    # work happened: spinning again, no wait


def _link():
    world = FakeWorld()
    return PipeLink(FakeBackend("me", world), "peer", tag=1, slot_offset=0, slot_count=4)


def test_link_wait_returns_when_a_message_arrives_or_the_link_is_stopped():
    link = _link()
    for wake in (lambda: link.put(b"x"), lambda: link.stop(TransferFailedError("cancelled"))):
        timer = threading.Timer(0.05, wake)
        started = time.perf_counter()
        timer.start()
        link.wait(30)
        assert time.perf_counter() - started < 10   # woken, not timed out
        timer.join()


def test_link_wait_does_not_block_while_a_message_is_waiting():
    link = _link()
    link.put(b"x")
    link.wait(0)        # clears the wake-up
    started = time.perf_counter()
    link.wait(30)       # the message is still in the inbox: return at once
    assert time.perf_counter() - started < 10
