"""The one table of a request's phases (``kvxfer.engine.lifecycle``): every path through it, and
nothing outside it."""

import pytest

from kvxfer.engine.lifecycle import ATTACHED, ENDED, GRANTED, TRANSITIONS, Event, Phase, advance, live


def walk(start: Phase, *events: Event) -> Phase:
    phase = start
    for event in events:
        phase = advance(phase, event)
    return phase


@pytest.mark.parametrize("start,events,end", [
    (Phase.RESERVED, (Event.GRANT, Event.ATTACH, Event.LANDED), Phase.DONE),       # a direct read
    (Phase.RESERVED, (Event.ATTACH, Event.GRANT, Event.LANDED), Phase.DONE),       # IPC, answer first
    (Phase.RESERVED, (Event.ATTACH, Event.LANDED, Event.GRANT), Phase.DONE),       # IPC, kernel first
    (Phase.GRANTED, (Event.ATTACH, Event.LANDED), Phase.DONE),                     # a write
    (Phase.RESERVED, (Event.FAIL, Event.ENDED), Phase.FAILED),                     # refused claim
    (Phase.MOVED, (Event.FAIL, Event.ATTACH, Event.GIVE_UP, Event.RECLAIM), Phase.RECLAIMED),
])
def test_every_path_a_request_takes_is_in_the_table(start, events, end):
    assert walk(start, *events) is end


def test_a_request_never_succeeds_without_both_its_grant_and_its_bytes():
    for (phase, event), nxt in TRANSITIONS.items():
        if nxt is Phase.DONE:  # the only ways in: granted and moving, then landed; landed, then granted
            assert (phase, event) in {(Phase.CLEARED, Event.LANDED), (Phase.MOVED, Event.GRANT)}


def test_ended_phases_take_nothing_but_a_reclaim_and_live_ones_can_always_fail():
    for phase in Phase:
        exits = {event for (p, event) in TRANSITIONS if p is phase}
        if phase in ENDED:
            # a quarantined request still takes what its stuck poster attaches, then its reclaim
            assert exits == ({Event.ATTACH, Event.RECLAIM} if phase is Phase.QUARANTINED else set()), phase
        if live(phase):
            assert Event.FAIL in exits
    with pytest.raises(RuntimeError, match="phase done cannot take 'fail'"):
        advance(Phase.DONE, Event.FAIL)
    with pytest.raises(RuntimeError, match="phase granted cannot take 'grant'"):
        advance(Phase.GRANTED, Event.GRANT)


def test_the_phase_questions_agree_with_the_table():
    assert GRANTED == {p for p in Phase if p in (Phase.GRANTED, Phase.CLEARED, Phase.DONE)}
    assert Phase.DRAINING not in ATTACHED | ENDED | GRANTED  # a failing request is none of them
    reachable = {Phase.RESERVED, Phase.GRANTED} | set(TRANSITIONS.values())
    assert reachable == set(Phase)
