"""The staged paths' slot wait reads the ``PathKit``'s clock, never ``time.monotonic`` (issue 12)."""

import pytest

from kvxfer.clock import ManualClock, MonotonicClock
from kvxfer.engine.paths.kit import PathKit
from kvxfer.errors import TransferTimeoutError

from agent_helpers import spec

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=4 << 10, pipeline_slots=2)


def test_a_kit_keeps_the_clock_it_is_given_and_defaults_to_the_real_one(harness):
    agent, _ = harness.agent(spec(), listen=False, **STAGED)
    clock = ManualClock()
    kit = PathKit(agent._backend, agent.config, agent.cache, clock=clock)
    try:
        assert kit.clock is clock
    finally:
        kit.close()
    assert isinstance(agent._paths.kit.clock, MonotonicClock)


def test_the_slot_wait_gives_up_when_the_kits_clock_passes_the_deadline(harness):
    agent, _ = harness.agent(spec(), listen=False, **STAGED)
    # Far before time.monotonic(): a wait that read the real clock would give up at the first poll.
    clock = ManualClock(start=-1e6)
    kit = PathKit(agent._backend, agent.config, agent.cache, clock=clock)
    polls = []

    def stopped():  # called once per poll: one second of the kit's clock passes between polls
        polls.append(clock.now())
        clock.advance(1.0)

    try:
        every = kit.take_slots(2, clock.now() + 5, stopped)
        with pytest.raises(TransferTimeoutError, match="no 1 free staging slots"):
            kit.take_slots(1, clock.now() + 5, stopped)
        assert len(polls) == 6  # 5 s of the kit's clock passed, and then some
        kit.give_slots(every)
        one = kit.take_slots(1, clock.now() - 1, stopped)
        assert one.slots == 1  # free slots: no wait, no deadline
        kit.give_slots(one)    # (close waits for slots still taken: a pipeline may write them)
    finally:
        kit.close()
