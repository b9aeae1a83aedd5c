"""A request's life in the transfer engine: its phases and every transition, in one table (layer: engine; stdlib only, pure).

A read needs two things before it may succeed: its producers' grant (the claim's answer) and its
bytes in place. They come in either order (a direct read is posted after its grant; an IPC
kernel starts before its claim's answer), so the phases name which of the two a request still
waits for. Every path (direct, host-staged, staged pipeline, IPC) goes through the same table;
``TransferEngine`` applies it under the request's lock and does the side effects (posting,
completing the handle, draining). A write is reserved granted.

    RESERVED --grant--> GRANTED --attach--> CLEARED --landed--> DONE
       |                                       ^
       +--attach--> MOVING --grant-------------+
                      |
                      +--landed--> MOVED --grant--> DONE

    any live phase --fail--> DRAINING --ended--> FAILED
                                      --give_up--> QUARANTINED --reclaim--> RECLAIMED

``attach`` gives the request its parts (posted or already running); ``landed`` is every part
done inside the request's window; ``fail`` a failure, cancel or deadline; ``ended`` every part
confirmed unable to write; ``give_up`` the drain grace passed first (the destination blocks stay
out of use; also a request whose poster was still inside a backend call when its deadline and
the grace had passed: what that poster attaches afterwards is confirmed ended before the blocks
come back); ``reclaim`` those parts confirmed ended later. A transition not in the table is a
bug in the engine: ``advance`` raises ``RuntimeError``.
"""

from __future__ import annotations

import enum

__all__ = ["ATTACHED", "ENDED", "Event", "GRANTED", "LIVE", "Phase", "TRANSITIONS", "advance", "live"]


class Phase(enum.Enum):
    RESERVED = "reserved"        # booked: waits for its grant and its parts
    GRANTED = "granted"          # granted: waits for its parts (a direct read about to be posted)
    MOVING = "moving"            # its parts move: waits for its grant (an IPC kernel before the claim's answer)
    CLEARED = "cleared"          # granted and moving: waits only for its bytes
    MOVED = "moved"              # its bytes are in: waits only for its grant
    DONE = "done"                # succeeded: the handle has its stats
    DRAINING = "draining"        # failed: waits until nothing it started can write
    FAILED = "failed"            # the handle has its error; its blocks are the engine's again
    QUARANTINED = "quarantined"  # the handle has its error; its parts are not confirmed ended
    RECLAIMED = "reclaimed"      # a quarantined request's parts ended: its blocks are free

    # Members are singletons: hash by identity (C speed) rather than Enum's hash of the name in
    # Python, since every transition and phase test of every request hashes them.
    __hash__ = object.__hash__


class Event(enum.Enum):
    GRANT = "grant"
    ATTACH = "attach"
    LANDED = "landed"
    FAIL = "fail"
    ENDED = "ended"
    GIVE_UP = "give_up"
    RECLAIM = "reclaim"

    __hash__ = object.__hash__  # as ``Phase``


_LIVE = (Phase.RESERVED, Phase.GRANTED, Phase.MOVING, Phase.CLEARED, Phase.MOVED)

#: (phase, event) -> the next phase. Nothing else may happen to a request.
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.RESERVED, Event.GRANT): Phase.GRANTED,
    (Phase.RESERVED, Event.ATTACH): Phase.MOVING,
    (Phase.GRANTED, Event.ATTACH): Phase.CLEARED,
    (Phase.MOVING, Event.GRANT): Phase.CLEARED,
    (Phase.MOVING, Event.LANDED): Phase.MOVED,
    (Phase.CLEARED, Event.LANDED): Phase.DONE,
    (Phase.MOVED, Event.GRANT): Phase.DONE,
    **{(phase, Event.FAIL): Phase.DRAINING for phase in _LIVE},
    (Phase.DRAINING, Event.ATTACH): Phase.DRAINING,   # parts started before the failure: it ends with them
    (Phase.DRAINING, Event.ENDED): Phase.FAILED,
    (Phase.DRAINING, Event.GIVE_UP): Phase.QUARANTINED,
    (Phase.QUARANTINED, Event.ATTACH): Phase.QUARANTINED,  # its poster outlived its deadline: ends with them
    (Phase.QUARANTINED, Event.RECLAIM): Phase.RECLAIMED,
}

#: Phases in which the request may still succeed (``live``).
LIVE = frozenset(_LIVE)
#: Phases in which the request's handle has completed.
ENDED = frozenset({Phase.DONE, Phase.FAILED, Phase.QUARANTINED, Phase.RECLAIMED})
#: Phases in which the request's producers granted it.
GRANTED = frozenset({Phase.GRANTED, Phase.CLEARED, Phase.DONE})
#: Phases in which the request's parts are attached (posted, launched or running).
ATTACHED = frozenset({Phase.MOVING, Phase.CLEARED, Phase.MOVED, Phase.DONE})


def advance(phase: Phase, event: Event) -> Phase:
    """The phase after ``event``. Raises RuntimeError for a transition the table does not have."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise RuntimeError(f"kvxfer engine: a request in phase {phase.value} cannot take {event.value!r}") from None


def live(phase: Phase) -> bool:
    """Whether the request may still succeed (neither failed nor ended)."""
    return phase in LIVE
