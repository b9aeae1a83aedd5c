"""NIXL backend (layer: backend.nixl; the only kvxfer module that imports nixl; imports backend.base, backend.gate, types, errors, numpy).

``NixlBackend`` is one NIXL agent behind the ``Backend`` protocol. Every call into NIXL goes
through ``_Boundary.call``: it turns NIXL's exceptions, ``"ERR"`` strings and ``None`` returns
into kvxfer errors (the original chained), so nothing above this module sees a NIXL type.

NIXL is imported lazily (on the first ``NixlBackend``), so ``import kvxfer`` works without it.

Threads: the agent is created in NIXL's ``NIXL_THREAD_SYNC_RW`` mode, in which NIXL itself
serialises its control calls and lets transfers be created, posted and polled from several
threads at once (UCX's workers then run in their multi-thread mode). kvxfer's side follows the
same split (``backend.gate``): data calls (``post``, ``post_prepared``, ``state``, ``release``,
``notify``, ``notifications``, ``prepare``: NIXL takes only its shared lock to prepare a list)
run side by side, so one peer's slow post holds up no other peer's transfers, and preparing
one link's lists holds up no read; control calls (``register``, ``add_peer``, ``remove_peer``,
``unprepare``, ``close``...) run alone. Polling and releasing one transfer are serialised on that
transfer only. A NIXL build without the RW mode gets one call at a time, as before.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from kvxfer.backend.base import XferId
from kvxfer.backend.gate import Gate
from kvxfer.backend.checks import check_regions, descriptor_table, as_enum, check_indices, check_pair
from kvxfer.backend.ucx_env import apply_ucx_defaults
from kvxfer.errors import (
    BackendError,
    ClosedError,
    ConfigError,
    KvxferError,
    PeerLostError,
    RegistrationError,
    TransferFailedError,
)
from kvxfer.types import Direction, MemKind, Region, XferState

__all__ = ["NixlBackend", "load_nixl_api"]

#: Where the NIXL Python API lives, most common first: the ``nixl`` meta package, the CUDA 13
#: and CUDA 12 wheels alone, and RIXL (ROCm). The first one that imports wins.
_NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api", "nixl_rocm")

#: Backends whose plugin takes a worker-thread count, and the init key it reads.
_THREAD_PARAM = {"UCX": "num_threads", "OBJ": "num_threads", "LIBFABRIC": "num_threads",
                 "GDS_MT": "thread_count", "UCCL": "num_cpus"}

_LOCAL_AGENT = "NIXL_INIT_AGENT"
_PROBE_BYTES = 64          # connect()'s first probe read: wires the endpoint up, never a cost
_PROBE_LARGE_BYTES = 2 << 20  # its second (host memory): past UCX's large-message thresholds, ~2 ms over TCP
_PROBE_POLL_S = 2e-4
log = logging.getLogger("kvxfer.backend")
_STATES = {"DONE": XferState.DONE, "PROC": XferState.PENDING, "ERR": XferState.FAILED}


class _Xfer:
    """One posted transfer: its NIXL handle (None once released), its terminal state once seen,
    and why it failed. ``lock`` serialises polling it against releasing it, and nothing else."""

    __slots__ = ("handle", "lock", "state", "failure")

    def __init__(self, handle: Any, state: XferState | None = None) -> None:
        self.handle = handle
        self.lock = threading.Lock()
        self.state = state
        self.failure: KvxferError | None = None


def load_nixl_api() -> Any:
    """Import and return NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``).

    Raises:
        BackendError: when none of ``_NIXL_MODULES`` imports (each attempt is named).
    """
    failures = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        failures.append(f"{name}: has no nixl_agent")
    raise BackendError("NIXL is not importable; tried " + "; ".join(failures))


_CONFIG_SWAP = threading.Lock()


def _new_agent(api: Any, name: str, config: Any, delay_us: int) -> Any:
    """``api.nixl_agent(name, config)`` whose progress thread sleeps in ``poll()`` for up to
    ``delay_us`` (rounded up to whole ms by NIXL) between rounds instead of spinning.

    NIXL's UCX progress thread progresses its workers, arms them and polls their event fds with a
    timeout of the agent config's ``pthrDelay``; NIXL's Python API sets that to 0 (a busy loop
    taking a whole core) and offers no knob. Here the config class the API instantiates is
    swapped, for this one call, for a subclass that keeps ``pthrDelay`` at ``delay_us``. A NIXL
    whose Python API builds its config otherwise gets NIXL's own behaviour (``delay_us`` ignored).
    """
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    field = vars(base).get("pthrDelay") if isinstance(base, type) else None
    if not delay_us or field is None:
        return api.nixl_agent(name, config)

    class _Delayed(base):  # type: ignore[misc, valid-type]
        pthrDelay = property(lambda self: field.__get__(self, base),
                             lambda self, _ignored: field.__set__(self, int(delay_us)))

    with _CONFIG_SWAP:
        bind.nixlAgentConfig = _Delayed
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


class _Boundary:
    """The one place NIXL failures become kvxfer errors.

    ``call(what, fn, ...)`` runs ``fn``; on an exception it raises ``error`` (or a more precise
    class chosen from the NIXL exception's name: a remote disconnect is PeerLostError, and with
    ``unregistered=True`` NOT_FOUND is RegistrationError) with the original chained; a ``None``
    result is a failure too (NIXL's Python layer logs and returns ``None`` for bad input) unless
    ``allow_none``, and so is the string ``"ERR"``.
    """

    #: NIXL exception class name (the stable part of ~12 unrelated classes) -> kvxfer error.
    _BY_NAME: dict[str, type[KvxferError]] = {
        "nixlRemoteDisconnectError": PeerLostError,
        "nixlCancelledError": TransferFailedError,
    }

    def __init__(self, agent_name: str) -> None:
        self._agent_name = agent_name

    def error(self, what: str, exc: BaseException | None,
              default: type[KvxferError], unregistered: bool = False) -> KvxferError:
        cls = default
        detail = "returned no result"
        if exc is not None:
            cls = self._BY_NAME.get(type(exc).__name__, default)
            if unregistered and type(exc).__name__ == "nixlNotFoundError":
                # Peers are checked before the call, so NOT_FOUND here means no registration
                # covers some descriptor (NIXL: "no backend had the required registrations").
                cls = RegistrationError
            detail = f"{type(exc).__name__}: {exc}"
        err = cls(f"NIXL agent {self._agent_name!r}: {what} failed ({detail})")
        err.__cause__ = exc
        return err

    def call(self, what: str, fn: Callable[..., Any], *args: Any,
             error: type[KvxferError] = BackendError, allow_none: bool = False,
             unregistered: bool = False) -> Any:
        try:
            result = fn(*args)
        except KvxferError:
            raise
        except Exception as exc:  # NIXL raises ~12 unrelated classes, plus builtins
            raise self.error(what, exc, error, unregistered) from exc
        if (result is None and not allow_none) or (isinstance(result, str) and result == "ERR"):
            raise self.error(what, None, error)
        return result


class NixlBackend:
    """One NIXL agent implementing ``kvxfer.backend.base.Backend``, plus prepared lists.

    Args:
        name: agent name, unique among the agents that will talk to each other.
        backends: NIXL plugins to instantiate (``("UCX",)`` by default).
        num_threads: worker threads for plugins that take them (0: the plugin's default).
        progress_thread: NIXL's own progress thread (on by default, as in NIXL; it busy-polls,
            see ``AgentConfig.nixl_progress_thread``, whose default decides by the host's cores).
            Off, the caller's polls (``state``, ``notifications``) drive the transport.

    Raises:
        ConfigError: a backend name this NIXL build does not offer (the message lists those it does),
            or ``num_threads < 0``.
        BackendError: NIXL is missing or the agent/plugin could not be created.

    Thread safety: any method from any thread (see the module doc: data calls run side by side,
    control calls alone). Ids (transfers, prepared lists) are ints unique for this agent's lifetime.
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), num_threads: int = 0,
                 progress_thread: bool = True, progress_delay_us: int = 0) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"agent name must be a non-empty str; got {name!r}")
        if isinstance(backends, str):
            backends = (backends,)
        backends = tuple(backends)
        if not backends:
            raise ConfigError("backends must name at least one NIXL plugin; got none")
        if not isinstance(num_threads, int) or num_threads < 0:
            raise ConfigError(f"num_threads must be an int >= 0; got {num_threads!r}")
        self.name = name
        self.backends = backends
        self.num_threads = num_threads
        if not isinstance(progress_delay_us, int) or progress_delay_us < 0:
            raise ConfigError(f"progress_delay_us must be an int >= 0; got {progress_delay_us!r}")
        self.progress_thread = bool(progress_thread)
        self.progress_delay_us = progress_delay_us
        self._nx = _Boundary(name)
        # UCX reads its environment when the agent below creates its context: fill kvxfer's TCP
        # defaults first (only variables the user left unset; see backend/ucx_env.py).
        apply_ucx_defaults()
        api = load_nixl_api()
        sync = getattr(getattr(api, "nixl_thread_sync_t", None), "NIXL_THREAD_SYNC_RW", None)
        extra = {} if sync is None else {"sync_mode": sync}
        self._gate = Gate(shared=sync is not None)
        self._table = threading.Lock()  # guards only the dicts below against concurrent data calls
        self._scratch_lock = threading.Lock()
        # Plugins are created one by one below, after checking their names against the build.
        config = self._nx.call("agent config",
                               lambda: api.nixl_agent_config(enable_prog_thread=bool(progress_thread),
                                                             backends=[], num_threads=num_threads, **extra))
        self._agent = self._nx.call(f"creating agent {name!r}", _new_agent, api, name, config,
                                    self.progress_delay_us if self.progress_thread else 0)
        available = list(self._nx.call("get_plugin_list", self._agent.get_plugin_list))
        unknown = [b for b in backends if b not in available]
        if unknown:
            raise ConfigError(f"unknown NIXL backend(s) {unknown}; this NIXL build offers {available}")
        for plugin in backends:
            init = {}
            if num_threads and plugin in _THREAD_PARAM:
                init[_THREAD_PARAM[plugin]] = str(num_threads)
            self._nx.call(f"creating backend {plugin}", self._agent.create_backend, plugin, init,
                          allow_none=True)
        self._ids = itertools.count(1)
        self._xfers: dict[int, _Xfer] = {}    # id -> live transfer
        self._preps: dict[int, tuple[str | None, int, Any]] = {}  # id -> (peer, rows, handle)
        self._regs: dict[int, list[Any]] = {}  # id -> nixl reg lists
        self._peers: set[str] = set()
        self._scratch: np.ndarray | None = None  # connect()'s probe lands here
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"NixlBackend {self.name!r} is closed")

    def __enter__(self) -> "NixlBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release transfers and prepared lists, deregister memory, forget peers. Idempotent.

        Cleanup goes on past failures; the first one (a kvxfer error) is raised at the end.
        """
        with self._gate.control:
            if self._closed:
                return
            self._closed = True
            first: KvxferError | None = None
            steps: list[tuple[str, Callable[[], Any]]] = []
            steps += [(f"releasing transfer {i}", x.handle.release) for i, x in self._xfers.items()
                      if x.handle is not None]
            steps += [(f"releasing prepared list {i}", p[2].release) for i, p in self._preps.items()]
            for i, lists in self._regs.items():
                steps += [(f"deregistering {i}", (lambda r=r: self._agent.deregister_memory(r)))
                          for r in lists]
            steps += [(f"removing peer {p!r}", (lambda p=p: self._agent.remove_remote_agent(p)))
                      for p in sorted(self._peers)]
            for what, step in steps:
                try:
                    self._nx.call(what, step, allow_none=True)
                except KvxferError as exc:
                    first = first or exc
            self._xfers.clear()
            self._preps.clear()
            self._regs.clear()
            self._peers.clear()
            self._agent = None
            if first is not None:
                raise first

    # ---- peers ---------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (includes registered memory: fetch it after ``register``)."""
        with self._gate.control:
            self._check_open()
            return bytes(self._nx.call("get_agent_metadata", self._agent.get_agent_metadata))

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. For a restarted peer (same name, new
        metadata) call ``remove_peer`` first, so no stale connection or prepared list survives."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)) or not metadata:
            raise ConfigError(f"peer metadata must be non-empty bytes; got {type(metadata).__name__}")
        with self._gate.control:
            self._check_open()
            name = self._nx.call("add_remote_agent", self._agent.add_remote_agent, bytes(metadata))
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers.add(name)
            return name

    def connect(self, peer: str, probe: Region | None = None, timeout: float = 10.0) -> float:
        """Open the transport to ``peer`` now, so the first transfer does not pay for it.

        NIXL's ``make_connection`` only starts UCX's wire-up: over TCP the endpoint is usable
        once the peer has answered, and a transfer posted before that queues behind it (its
        operations then drain through the progress thread). With ``probe``, memory the peer
        registered, this also reads from it into a scratch buffer of this agent and waits (up
        to ``timeout`` s in all) for each read, in two steps: 64 bytes (the endpoint is then
        wired up and the small-message protocol chosen), then, when the probe is host memory,
        up to 2 MiB as one descriptor, so UCX also picks and sets up the protocol and buffers
        of large reads (rendezvous / zero copy, several segments over TCP) on both sides before
        the first request needs them. GPU probes stop after the first step: a read into host
        scratch would warm a path that GPU-to-GPU reads never take. The probe moves no
        notification, so the peer's application never sees it. Call it again after the
        transport to a peer was lost (a fresh handshake does).

        Returns the seconds spent waiting for the probe (0.0 without one). A probe that fails or
        times out is released and logged, not raised: the first transfer will report a dead peer.

        Raises:
            ConfigError: unknown ``peer``.
        """
        with self._gate.data:
            self._check_peer(peer)
            self._nx.call(f"make_connection to {peer!r}", self._agent.make_connection, peer,
                          allow_none=True)
        if probe is None:
            return 0.0
        started = time.monotonic()
        sizes = [_PROBE_BYTES]
        if as_enum(MemKind, probe.kind, "kind") is MemKind.DRAM and int(probe.length) > _PROBE_BYTES:
            sizes.append(min(int(probe.length), _PROBE_LARGE_BYTES))
        for nbytes in sizes:
            if not self._probe_once(peer, probe, nbytes, started + timeout):
                break
        return time.monotonic() - started

    def _probe_once(self, peer: str, probe: Region, nbytes: int, deadline: float) -> bool:
        """One probe read of ``nbytes`` from the start of ``probe``; True when it completed."""
        try:
            xid = self._post_probe(peer, probe, nbytes)
        except KvxferError as exc:
            log.warning("NIXL agent %r: connection probe to %r not posted: %s", self.name, peer, exc)
            return False
        state = XferState.PENDING
        while state is XferState.PENDING and time.monotonic() < deadline:
            time.sleep(_PROBE_POLL_S)
            state = self.state(xid)
        if state is not XferState.DONE:
            log.warning("NIXL agent %r: connection probe of %d bytes to %r ended %s (%s)", self.name, nbytes,
                        peer, state.name, self.failure(xid))
        self.release(xid)
        return state is XferState.DONE

    def _post_probe(self, peer: str, probe: Region, nbytes: int) -> XferId:
        """Post the READ of ``nbytes`` of ``connect``'s probe into this agent's scratch buffer
        (registered once, its pages touched so the read pays no page faults)."""
        nbytes = min(int(probe.length), nbytes)
        if nbytes <= 0:
            raise ConfigError(f"probe region must have a positive length; got {probe.length}")
        with self._scratch_lock:
            if self._scratch is None:
                scratch = np.ones(_PROBE_LARGE_BYTES, dtype=np.uint8)
                self.register([Region(scratch.ctypes.data, _PROBE_LARGE_BYTES, 0, MemKind.DRAM)])
                self._scratch = scratch
        local = np.array([[self._scratch.ctypes.data, nbytes, 0]], dtype=np.uint64)
        remote = np.array([[int(probe.addr), nbytes, int(probe.device)]], dtype=np.uint64)
        return self.post(Direction.READ, local, MemKind.DRAM, remote, as_enum(MemKind, probe.kind, "kind"),
                         peer, b"")

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and release the prepared lists made for it. Unknown names are ignored."""
        with self._gate.control:
            self._check_open()
            if peer not in self._peers:
                return
            self._peers.discard(peer)
            for pid in [i for i, p in self._preps.items() if p[0] == peer]:
                _, _, handle = self._preps.pop(pid)
                self._nx.call(f"releasing prepared list {pid}", handle.release, allow_none=True)
            self._nx.call(f"remove_remote_agent {peer!r}", self._agent.remove_remote_agent, peer,
                          allow_none=True)

    def peers(self) -> frozenset[str]:
        with self._gate.data:
            return frozenset(self._peers)

    def _check_peer(self, peer: str) -> None:
        self._check_open()
        if peer not in self._peers:
            raise ConfigError(f"unknown peer {peer!r}; known peers: {sorted(self._peers)}")

    # ---- memory --------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> int:
        """Register ``regions`` (grouped by memory kind); returns a handle for ``deregister``."""
        regions = check_regions(regions)
        with self._gate.control:
            self._check_open()
            lists = []
            try:
                for kind in (MemKind.DRAM, MemKind.VRAM):
                    rows = [(r.addr, r.length, r.device, "") for r in regions
                            if as_enum(MemKind, r.kind, "Region.kind") is kind]
                    if rows:
                        lists.append(self._nx.call(f"registering {len(rows)} {kind.value} region(s)",
                                                   self._agent.register_memory, rows, kind.value,
                                                   error=RegistrationError))
            except KvxferError:
                for reg in lists:
                    self._nx.call("rollback deregister", self._agent.deregister_memory, reg,
                                  allow_none=True)
                raise
            hid = next(self._ids)
            self._regs[hid] = lists
            return hid

    def deregister(self, handle: object) -> None:
        """Deregister what ``register`` returned ``handle`` for. Raises ConfigError for an unknown handle."""
        with self._gate.control:
            self._check_open()
            lists = self._regs.pop(handle, None) if isinstance(handle, int) else None
            if lists is None:
                raise ConfigError(f"unknown registration handle {handle!r}; live: {sorted(self._regs)}")
            for reg in lists:
                self._nx.call(f"deregistering {handle}", self._agent.deregister_memory, reg,
                              allow_none=True)

    # ---- transfers -----------------------------------------------------------------
    def post(self, direction: Direction, local: np.ndarray, local_kind: MemKind,
             remote: np.ndarray, remote_kind: MemKind, peer: str, notification: bytes) -> XferId:
        """Build descriptor lists for this request and start it (``initialize_xfer`` + ``transfer``).

        Raises:
            ConfigError: malformed descriptors, unequal lengths, unknown peer.
            RegistrationError: a descriptor outside the memory registered on its side.
            PeerLostError: NIXL reports the peer disconnected.
            TransferFailedError: NIXL refused or failed to start the transfer.
        """
        local, remote = check_pair(local, remote)
        op = as_enum(Direction, direction, "direction").value
        lkind = as_enum(MemKind, local_kind, "local_kind").value
        rkind = as_enum(MemKind, remote_kind, "remote_kind").value
        with self._gate.data:
            self._check_peer(peer)
            a = self._agent
            ldl = self._nx.call("local descriptors", a.get_xfer_descs, local, lkind)
            rdl = self._nx.call("remote descriptors", a.get_xfer_descs, remote, rkind)
            handle = self._nx.call(f"initialize_xfer {op} with {peer!r}", a.initialize_xfer, op, ldl,
                                   rdl, peer, bytes(notification), error=TransferFailedError,
                                   unregistered=True)
            return self._start(handle, op, peer)

    def prepare(self, peer: str | None, table: np.ndarray, kind: MemKind) -> int:
        """Prepare a descriptor list once (``prep_xfer_dlist``); returns an id for ``post_prepared``.

        ``peer=None`` prepares local descriptors; a peer name prepares that peer's. Released by
        ``unprepare``, ``remove_peer(peer)`` or ``close``.

        Raises:
            ConfigError: malformed table or unknown peer.
            RegistrationError: a descriptor outside the registered memory of that side.
        """
        arr = descriptor_table(table, "prepared")
        kind = as_enum(MemKind, kind, "kind")
        # A data call: NIXL prepares under its shared lock, so transfers go on meanwhile (a
        # control call here would stop every read of the agent until the list is ready).
        with self._gate.data:
            if peer is None:
                self._check_open()
            else:
                self._check_peer(peer)
            where = _LOCAL_AGENT if peer is None else peer
            handle = self._nx.call(f"prep_xfer_dlist for {where!r} ({arr.shape[0]} rows)",
                                   self._agent.prep_xfer_dlist, where, arr, kind.value,
                                   error=BackendError, unregistered=True)
            with self._table:
                pid = next(self._ids)
                self._preps[pid] = (peer, int(arr.shape[0]), handle)
            return pid

    def unprepare(self, prep: int) -> None:
        """Release a prepared list. Unknown (or already released) ids are ignored."""
        with self._gate.control:
            self._check_open()
            entry = self._preps.pop(prep, None)
            if entry is not None:
                self._nx.call(f"releasing prepared list {prep}", entry[2].release, allow_none=True)

    def post_prepared(self, direction: Direction, local_prep: int, local_idx: np.ndarray,
                      remote_prep: int, remote_idx: np.ndarray, peer: str,
                      notification: bytes) -> XferId:
        """Start moving ``local[local_idx[i]] <-> remote[remote_idx[i]]`` (``make_prepped_xfer``).

        Raises:
            ConfigError: unknown prepared ids, a remote list not made for ``peer``, a local list that
                is not local, indices out of range or of unequal counts.
            PeerLostError / TransferFailedError: as for ``post``.
        """
        op = as_enum(Direction, direction, "direction").value
        with self._gate.data:
            self._check_peer(peer)
            lp, rp = self._prep(local_prep), self._prep(remote_prep)
            if lp[0] is not None:
                raise ConfigError(f"local_prep {local_prep} was prepared for peer {lp[0]!r}; expected a local list")
            if rp[0] != peer:
                raise ConfigError(f"remote_prep {remote_prep} was prepared for {rp[0]!r}; expected {peer!r}")
            li = check_indices(local_idx, lp[1], "local")
            ri = check_indices(remote_idx, rp[1], "remote")
            if li.size != ri.size:
                raise ConfigError(f"local and remote index counts must match; got {li.size} and {ri.size}")
            handle = self._nx.call(f"make_prepped_xfer {op} with {peer!r}", self._agent.make_prepped_xfer,
                                   op, lp[2], li, rp[2], ri, bytes(notification),
                                   error=TransferFailedError)
            return self._start(handle, op, peer)

    def _prep(self, pid: int) -> tuple[str | None, int, Any]:
        with self._table:  # another thread may be adding a list (``prepare`` is a data call)
            entry, live = self._preps.get(pid), None
            if entry is None:
                live = sorted(self._preps)
        if entry is None:
            raise ConfigError(f"unknown prepared list {pid!r}; live: {live}")
        return entry

    def _start(self, handle: Any, op: str, peer: str) -> XferId:
        try:
            status = self._nx.call(f"posting {op} with {peer!r}", self._agent.transfer, handle,
                                   error=TransferFailedError)
        except KvxferError:
            self._nx.call("releasing a failed transfer", handle.release, allow_none=True)
            raise
        xid = next(self._ids)
        with self._table:
            self._xfers[xid] = _Xfer(handle, XferState.DONE if status == "DONE" else None)
        return xid

    def _xfer(self, xfer: XferId) -> _Xfer:
        self._check_open()
        with self._table:
            entry = self._xfers.get(xfer)
        if entry is None:
            raise ConfigError(f"unknown transfer id {xfer!r}")
        return entry

    def state(self, xfer: XferId) -> XferState:
        """Poll one transfer. NIXL's "ERR" (or an exception while polling) reads as FAILED;
        the cause is kept and returned by ``failure(xfer)``."""
        with self._gate.data:
            entry = self._xfer(xfer)
            if entry.state is not None:
                return entry.state
            with entry.lock:  # released meanwhile by another thread: it is no longer known
                if entry.state is not None:
                    return entry.state
                if entry.handle is None:
                    raise ConfigError(f"unknown transfer id {xfer!r} (released)")
                try:
                    status = self._agent.check_xfer_state(entry.handle)
                except Exception as exc:
                    entry.failure = self._nx.error(f"polling transfer {xfer}", exc, TransferFailedError)
                    status = "ERR"
                result = _STATES.get(status, XferState.FAILED)
                if result is XferState.FAILED and entry.failure is None:
                    entry.failure = self._nx.error(f"transfer {xfer} (state {status!r})", None, TransferFailedError)
                if result is not XferState.PENDING:
                    entry.state = result
                return result

    def failure(self, xfer: XferId) -> KvxferError | None:
        """Why a FAILED transfer failed (a kvxfer error chaining NIXL's), or None."""
        with self._table:
            entry = self._xfers.get(xfer)
        return None if entry is None else entry.failure

    def release(self, xfer: XferId) -> None:
        """Free a transfer's handle; NIXL cancels a pending one. Releasing twice is harmless."""
        with self._gate.data:
            self._check_open()
            with self._table:
                entry = self._xfers.pop(xfer, None)
            if entry is None:
                return
            with entry.lock:  # waits only for a poll of this same transfer
                handle, entry.handle = entry.handle, None
                if handle is not None:
                    self._nx.call(f"releasing transfer {xfer}", handle.release, allow_none=True)

    # ---- notifications ---------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` through NIXL's notification channel."""
        with self._gate.data:
            self._check_peer(peer)
            self._nx.call(f"send_notif to {peer!r}", self._agent.send_notif, peer, bytes(message),
                          allow_none=True)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender agent name, bytes)."""
        with self._gate.data:
            self._check_open()
            got = self._nx.call("get_new_notifs", self._agent.get_new_notifs)
        out = []
        for sender, messages in got.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in messages)
        return out
