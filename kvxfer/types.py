"""Small value types shared by every layer (layer: types; imports nothing but the standard library)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AbortOutcome", "Direction", "HoldToken", "KeepaliveResult", "MemKind", "ReadRequest", "Region", "ReleaseOutcome",
           "ReleaseReason", "RequestState", "SessionState", "TransferPath", "XferState"]


class MemKind(str, enum.Enum):
    """Where memory lives, in NIXL's words."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class Direction(str, enum.Enum):
    """READ: the consumer pulls from the producer (default). WRITE: the producer pushes."""

    READ = "READ"
    WRITE = "WRITE"


class TransferPath(str, enum.Enum):
    """How a request's bytes move (``TransferStats.mode``; ``AgentConfig.transfer_path`` also
    takes AUTO). Members compare equal to their strings.

    DIRECT: NIXL descriptors straight between the two caches. HOST_STAGED: NIXL descriptors
    into the consumer's host staging buffer, unpacked into the cache (a layout change on host
    memory). STAGED: the producer packs into its staging slots, a few large NIXL reads move
    them, the consumer unpacks (pipelined). IPC: one kernel reads the peer's GPU cache through
    CUDA IPC (same host).
    """

    AUTO = "auto"
    DIRECT = "direct"
    HOST_STAGED = "host-staged"
    STAGED = "staged"
    IPC = "ipc"

    def __str__(self) -> str:  # "direct", as in logs, tables and f-strings
        return self.value


class ReleaseReason(str, enum.Enum):
    """Why a producer's hold ended (its blocks are free), as ``Agent.finished()`` sorts it:
    every consumer reported done (SENT, ``Finished.sent``), ``release`` or a consumer's abort
    (ABORTED, ``Finished.aborted``), or its lease or a claim window lapsed without the
    consumer's done (EXPIRED, ``Finished.expired``). Members compare equal to their strings."""

    SENT = "sent"
    ABORTED = "aborted"
    EXPIRED = "expired"

    def __str__(self) -> str:
        return self.value


class ReleaseOutcome(enum.Enum):
    """What ``Agent.release`` did, and so when the engine may reuse the request's blocks.

    FREE_NOW: no consumer was reading; the blocks are free on return (``finished().aborted``
    lists the request too). FREE_WHEN_FINISHED: a consumer's claim window is open, so a read may
    still be moving the blocks: new claims are refused now, and the blocks are free only once
    ``finished()`` lists the request (in ``aborted``, even if that read completes).
    ALREADY_ENDING: an earlier release, abort or expiry already ends the hold and is waiting on
    a window: reuse once ``finished()`` lists it. NOT_HELD: nothing is held under this id
    (never held, or already listed by ``finished()``): the engine owns the blocks.
    """

    FREE_NOW = "free_now"
    FREE_WHEN_FINISHED = "free_when_finished"
    ALREADY_ENDING = "already_ending"
    NOT_HELD = "not_held"

    def __str__(self) -> str:
        return self.value

    def __bool__(self) -> bool:
        """True when this call ended the hold (FREE_NOW, FREE_WHEN_FINISHED): ``release`` returned
        that bool before it returned this enum. It says nothing about reuse: see ``free_now``."""
        return self in (ReleaseOutcome.FREE_NOW, ReleaseOutcome.FREE_WHEN_FINISHED)

    @property
    def free_now(self) -> bool:
        """True when the engine may reuse the blocks on return (FREE_NOW, NOT_HELD); otherwise
        only once ``finished()`` lists the request."""
        return self in (ReleaseOutcome.FREE_NOW, ReleaseOutcome.NOT_HELD)


class AbortOutcome(str, enum.Enum):
    """What ``Agent.abort`` achieved at the producer ranks it told (the worst one counts).

    RELEASED: a producer released its hold (at once, or once the windows of other consumers
    close). NOT_HELD: every producer told answered that it did not hold the request (already
    sent, released, expired, or never held there). NOT_TOLD: no producer was told: this agent
    has no claim for the request and ``abort`` got no ``remote`` to reach one; pass ``remote``
    to release a hold this agent never claimed. REFUSED: a producer refused (its hold names
    other consumer engines). UNREACHABLE: a producer could not be reached even after a fresh
    handshake; its hold ends with its lease.
    """

    RELEASED = "released"
    NOT_HELD = "not_held"
    NOT_TOLD = "not_told"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"

    @classmethod
    def combine(cls, outcomes) -> "AbortOutcome":
        """One outcome for several ranks: unreachable, then refused, then released, then not
        held; NOT_TOLD when there were none."""
        seen = set(outcomes)
        for worst in (cls.UNREACHABLE, cls.REFUSED, cls.RELEASED, cls.NOT_HELD):
            if worst in seen:
                return worst
        return cls.NOT_TOLD


@dataclass(frozen=True)
class KeepaliveResult:
    """What ``Agent.keepalive`` learned from a producer instance's ranks.

    ``gone``: requests some reachable rank no longer holds (sent, released, expired, never held,
    or held for other consumer engines): stop waiting on them. ``unreachable``: ``(host, port)``
    of ranks that could not be reached even after a fresh handshake; their holds were not
    extended and end with their leases unless a later keepalive reaches them. ``ok``: every rank
    answered and none of the requests is gone.
    """

    gone: tuple[str, ...] = ()
    unreachable: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.gone and not self.unreachable


class RequestState(str, enum.Enum):
    """Where one request stands on this agent (``Agent.status``; it drains nothing).

    Producer side: HELD (held, no consumer reading), CLAIMED (a consumer's claim window is
    open), ENDING (released, aborted or expired while a window is open: free once it closes),
    then SENT, ABORTED or EXPIRED (free: the same sets as ``Finished``). Consumer side:
    IN_FLIGHT (a read or write not ended yet, a failed one still draining included), RECEIVED
    (every byte arrived), FAILED (ended with an error; its blocks are the engine's again),
    QUARANTINED (failed and not confirmed ended: keep its blocks out of use) and RECLAIMED
    (a quarantined request's blocks are free again). UNKNOWN: never seen, or forgotten (see
    ``Agent.status`` for how long ended requests are remembered).
    """

    UNKNOWN = "unknown"
    HELD = "held"
    CLAIMED = "claimed"
    ENDING = "ending"
    SENT = "sent"
    ABORTED = "aborted"
    EXPIRED = "expired"
    IN_FLIGHT = "in_flight"
    RECEIVED = "received"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    RECLAIMED = "reclaimed"

    def __str__(self) -> str:
        return self.value


class SessionState(str, enum.Enum):
    """Where a side-channel session stands in its handshake (``kvxfer.protocol.session`` holds
    the transition tables). Members compare equal to their strings and print as them.

    A client session is IDLE, HELLO_SENT, READY or FAILED; a server session is AWAITING_HELLO
    or READY.
    """

    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    AWAITING_HELLO = "awaiting_hello"
    READY = "ready"
    FAILED = "failed"

    def __str__(self) -> str:  # "ready", as in logs and error messages
        return self.value


class XferState(enum.Enum):
    """State of one posted transfer as the backend reports it."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Region:
    """One contiguous registered span of memory.

    ``addr`` is the address in this process, ``length`` in bytes, ``device`` the
    GPU ordinal (0 for host memory), ``kind`` DRAM or VRAM.
    """

    addr: int
    length: int
    device: int
    kind: MemKind

    @property
    def end(self) -> int:
        return self.addr + self.length


@dataclass(frozen=True)
class ReadRequest:
    """One read of a batch (``Agent.read_many``); the fields are ``Agent.read``'s arguments.

    ``remote``: the producer instance's rank-0 side-channel ``(host, port)``; ``local_blocks``
    and ``remote_blocks``: block ids (any integer sequence or array); ``timeout``: seconds for
    the whole read, None for ``AgentConfig.transfer_timeout``; ``same_format``: refuse the read
    (``LayoutError`` on its handle) unless the producer's layout, storage and block size equal
    this agent's, for engines whose cache cannot take a converted layout; ``num_tokens``: the
    tokens the read moves, each list's last block possibly partial (see ``Agent.read``), None
    for every token of both lists (which must then cover the same tokens).
    """

    remote: tuple
    local_blocks: object
    remote_blocks: object
    request_id: str
    timeout: float | None = None
    same_format: bool = False
    num_tokens: int | None = None
    token: "HoldToken | None" = None  # the producer's hold token (``Agent.hold_token``): no claim


@dataclass(frozen=True)
class HoldToken:
    """A producer's proof-of-hold for one request (``Agent.hold_token``): the slot of its hold
    word, the epoch written there at ``hold`` and the tag ``blake2b(request id, held ids)``.

    A consumer that passes it with a read (``ReadRequest.token``) needs no claim: the read moves
    at once and succeeds only if the word still equals ``(epoch, tag)`` after the move completed
    (docs/reliability.md, "hold tokens"). ``wire()``/``from_wire`` give the three integers as they
    travel in ``kv_transfer_params`` (``remote_hold_token``).
    """

    slot: int
    epoch: int
    tag: int

    def wire(self) -> list[int]:
        return [int(self.slot), int(self.epoch), int(self.tag)]

    @classmethod
    def from_wire(cls, value) -> "HoldToken":
        """From ``[slot, epoch, tag]``. Raises ValueError (a ``ConfigError`` is the caller's) when
        it is not three non-negative integers below 2**64 (epoch >= 1)."""
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in value) \
                or value[1] == 0:
            raise ValueError(f"a hold token is [slot, epoch >= 1, tag], three integers below 2**64; got {value!r}")
        return cls(int(value[0]), int(value[1]), int(value[2]))
