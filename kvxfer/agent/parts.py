"""The parts of one Agent, as the modules doing its work use them (layer: agent; imports no other kvxfer.agent module).

``Agent`` builds one ``AgentParts`` and hands it, not itself, to the modules that do its work
(``reads``, ``tokens``, ``submit``, ``service``, ``announce``, ``heartbeats``, ``streams``,
``writes``, ``progress``): each reads the parts it needs here by name, so no module reaches into
the Agent's private attributes and none imports ``core`` (the package has no import circle).

Parts that exist only once a cache is registered (``view``, ``paths``, ``engine``, ``words``)
are None before ``register``; ``address``, ``closed`` and ``expired_at`` change over the agent's
life; the Agent reads and writes the same objects here (its private attributes are views of
these). The hooks are the Agent's own checks and callbacks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["AgentParts", "ReadRemotes", "Submitting"]


class ReadRemotes:
    """The producer of each read in flight, by request id (``abort`` without a ``remote`` tells it;
    idle links to its host are kept). An entry leaves with its own read: a read that ends does not
    take the entry of a newer read of the same id, submitted since."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[tuple[str, int], object]] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, remote: tuple[str, int], handle: object) -> None:
        with self._lock:
            self._by_id[request_id] = (remote, handle)

    def get(self, request_id: str) -> tuple[str, int] | None:
        entry = self._by_id.get(request_id)
        return None if entry is None else entry[0]

    def forget(self, handles: list) -> None:
        """The reads of ``handles`` ended: drop their own entries."""
        with self._lock:
            by_id = self._by_id
            for handle in handles:
                entry = by_id.get(handle.request_id)
                if entry is not None and entry[1] is handle:
                    del by_id[handle.request_id]

    def hosts(self) -> set[str]:
        with self._lock:
            return {remote[0] for remote, _ in self._by_id.values()}


class Submitting:
    """How many calls are submitting reads right now (``Submissions.reads``, from booking to the
    last launch or post): kvxfer's own thread defers its done-notice flush while one is
    (``kvxfer.agent.progress``). True while any is."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1

    def __bool__(self) -> bool:
        return self._count > 0


class AgentParts:
    """What an Agent is made of (see the module doc). Every attribute is set by ``Agent``."""

    def __init__(self, spec: Any, config: Any, engine_id: str, clock: Any, backend: Any) -> None:
        self.spec = spec                  # this rank's KVSpec
        self.config = config              # its AgentConfig
        self.engine_id = engine_id
        self.clock = clock                # every deadline and wait (kvxfer.clock)
        self.backend = backend            # the transport agent (NIXL)
        self.wake = threading.Event()     # wakes the progress thread
        # built by the Agent right after this object
        self.codec: Any = None            # side-channel messages (kvxfer.protocol.Codec)
        self.registry: Any = None         # registered memory (kvxfer.memory.MemoryRegistry)
        self.reports: Any = None          # finished() and status() (agent.reports.Reports)
        self.announced: Any = None        # announcements received (agent.announce.AnnouncementBook)
        self.leases: Any = None           # this producer's holds (engine.leases.LeaseTable)
        self.service: Any = None          # answers consumers (agent.service.ProducerService)
        self.peers: Any = None            # handshaken producers (agent.peers.PeerDirectory)
        self.claims: Any = None           # claims and their give-backs (agent.claims.Claims)
        self.done: Any = None             # done notices (agent.notices.DoneSender)
        self.reads: Any = None            # the read flow (agent.reads.ReadFlow)
        self.tokens: Any = None           # hold-token reads (agent.tokens.TokenReads)
        self.submit: Any = None           # read/write submission (agent.submit.Submissions)
        self.lanes: Any = None            # one thread per producer (agent.lanes.PeerLanes)
        self.metrics: Any = None          # the Prometheus endpoint, or None
        self.read_remotes = ReadRemotes()  # reads in flight -> their producer
        # set by register()
        self.view: Any = None             # the registered cache (layout.CacheView)
        self.paths: Any = None            # transfer paths and the staged reads' packer (engine.readpaths)
        self.engine: Any = None           # the transfer engine (engine.transfers.TransferEngine)
        self.words: Any = None            # this producer's hold words (engine.holdwords.HoldWords)
        # the agent's life
        self.address: tuple[str, int] | None = None  # the side channel's (host, port) once listening
        self.closed = False
        self.expired_at = 0.0             # when leases were last expired (progress.drive_once)
        self.driven_at = 0.0              # the driver's last whole pass (``time.monotonic``; progress.drive_once)
        self.flushed_at = 0.0             # the done notices' last flush (``time.monotonic``; progress.drive_once)
        self.submitting = Submitting()    # calls submitting reads now (submit.Submissions.reads)
        self.idle_swept_at = 0.0          # when idle peers were last looked for (``peer_idle_ttl``)
        # the Agent's hooks
        self.check_open: Callable[[], None] = _unset
        self.require_cache: Callable[[], Any] = _unset
        self.links_for: Callable[..., Any] = _unset
        self.peer_info: Callable[[], Any] = _unset
        self.on_reads_done: Callable[[list], None] = _unset


def _unset(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("kvxfer: an AgentParts hook was called before the Agent set it")
