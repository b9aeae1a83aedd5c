"""Small value types shared by every layer (layer: types; imports nothing but the standard library)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AbortOutcome", "MemKind", "ReadRequest", "Region", "ReleaseReason", "SessionState", "TransferPath", "XferState",
           "Direction"]


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
    """Why a producer's hold ended (its blocks are free): every consumer reported done (SENT),
    ``release``/a consumer's abort (ABORTED), or its lease or a claim window lapsed (EXPIRED)."""

    SENT = "sent"
    ABORTED = "aborted"
    EXPIRED = "expired"

    def __str__(self) -> str:
        return self.value


class AbortOutcome(str, enum.Enum):
    """What ``Agent.abort`` achieved at the producer ranks it told (the worst one counts).

    RELEASED: a producer released its hold. NOT_HELD: no producer held the request (already
    released, expired or never held; or no producer was told). REFUSED: a producer refused
    (its hold names other consumer engines). UNREACHABLE: a producer could not be reached even
    after a fresh handshake; its hold ends with its lease.
    """

    RELEASED = "released"
    NOT_HELD = "not_held"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"

    @classmethod
    def combine(cls, outcomes) -> "AbortOutcome":
        """One outcome for several ranks: unreachable, then refused, then released, else not held."""
        seen = set(outcomes)
        for worst in (cls.UNREACHABLE, cls.REFUSED, cls.RELEASED):
            if worst in seen:
                return worst
        return cls.NOT_HELD


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
    this agent's, for engines whose cache cannot take a converted layout.
    """

    remote: tuple
    local_blocks: object
    remote_blocks: object
    request_id: str
    timeout: float | None = None
    same_format: bool = False
