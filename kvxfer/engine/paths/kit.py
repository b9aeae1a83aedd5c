"""One agent's resources for the IPC and staged paths (layer: engine; never nixl, zmq or the agent).

``PathKit`` is built when the cache is registered: the pair-copy kernel (``PairKernel`` on a
GPU, ``HostPairKernel`` on host memory), the staging area that serves and receives staged
reads (with a pool of its slots), this cache's CUDA IPC export, the host and network
identities (``host_identity``, ``network_identity``), the CUDA
stream IPC reads run on, the router of pipeline notifications, and the clock the staged
paths' deadlines are measured on. It also maps peers' caches (once per ``PeerLink``; unmapped
when the link closes) and says, per peer, why a path is not available.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvxfer.backend.base import Backend
from kvxfer.clock import Clock, MonotonicClock
from kvxfer.config import AgentConfig
from kvxfer.engine.staging import StagingAllocator
from kvxfer.errors import ClosedError, ConfigError, KvxferError, RegistrationError, TransferTimeoutError
from kvxfer.gpu.host import HostPairKernel
from kvxfer.gpu.ops import cupy_missing
from kvxfer.gpu.ipc import IpcExport, IpcPeerCache, export_cache, host_identity
from kvxfer.engine.paths.pipeline import SlotRange, StagingArea, host_allocate
from kvxfer.engine.paths.prepared import PreparedBlocks, prepare_blocks
from kvxfer.layout import CacheView
from kvxfer.layout.pairs import DirectTemplate, pair_copy_why
from kvxfer.protocol.messages import IpcWire, StagingWire
from kvxfer.starter import start_soon
from kvxfer.types import MemKind

from kvxfer.engine.paths.pipes import PipeRouter

__all__ = ["PathKit", "network_identity"]

log = logging.getLogger("kvxfer.agent")

#: Seconds ``PathKit.close`` waits (real time) for the staged pipelines and moves still writing
#: into the staging area to end before it gives up and keeps the area.
CLOSE_WAIT = 2.0

#: Staging areas a close could not free (a pipeline or a move might still write into them):
#: allocated and registered for the life of the process. A leak, never a use after free.
_KEPT: list[StagingArea] = []


def network_identity() -> str:
    """This process's network stack: host identity + network namespace.

    Two agents with different values reach each other through a network device (another
    machine, or another container's namespace), not through one kernel's loopback; the staged
    path's rule for host memory (``choose``) depends on it. Empty when ``/proc`` cannot say.
    """
    try:
        ns = os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
    return f"{host_identity()}/{ns}"


@dataclass
class _Parked:
    """Staging slots kept out of the pool: ``ready()`` says when nobody can read or write them
    any more (asked on every sweep, it may look at the backend or a pipe's messages); ``writes``:
    a move may still write into them (a peer's READ of them only reads)."""

    slots: SlotRange
    ready: Callable[[], bool]
    writes: bool = False


class PathKit:
    """GPU-path resources of one agent. ``close`` releases them (idempotent).

    ``clock`` (the agent's; ``MonotonicClock`` by default) measures every staged-path deadline:
    the slot wait here, the producer's ``PackRequest`` window and the pipeline loops.

    ``closing`` is True once ``close`` began: ``take_slots`` refuses from then on.
    """

    def __init__(self, backend: Backend, config: AgentConfig, view: CacheView,
                 clock: Clock | None = None) -> None:
        self.backend, self.config, self.view = backend, config, view
        self.clock: Clock = clock or MonotonicClock()
        geometry = view.geometry
        self.vram = geometry.kind is MemKind.VRAM
        self.device = int(geometry.device)
        self.host_id = host_identity()
        self.net_id = network_identity()
        self.router = PipeRouter(backend, key=config.auth_key)
        self.area: StagingArea | None = None
        self.area_why = ""
        self._slots: StagingAllocator | None = None
        self._slot_lock = threading.Lock()
        self._parked: list[_Parked] = []   # taken out under _slot_lock; asked outside it
        self.closing = False
        self._kernel: Any = None
        self._kernel_lock = threading.Lock()
        self._prep_lock = threading.Lock()
        self._stream: Any = None
        self.ipc: IpcWire | None = None
        path = config.transfer_path
        no_kernel = self.no_kernel = cupy_missing() if self.vram else ""
        if no_kernel:  # without the kernel neither GPU path works here: peers see none offered
            self.area_why = f"this agent cannot run the GPU paths: {no_kernel}"
            log.info("GPU paths disabled: %s", no_kernel)
        elif path != "direct" and (self.vram or path in ("staged", "auto")):
            self._make_area()
        elif path == "direct":
            self.area_why = "this agent's transfer_path is 'direct'"
        else:
            self.area_why = (f"this agent's cache is host memory and transfer_path is {path!r} "
                             "(staged reads of host memory are served with transfer_path 'auto' or 'staged')")
        if self.vram and not no_kernel and path in ("auto", "ipc"):
            try:
                export = export_cache(geometry, self.host_id)
                self.ipc = IpcWire(export.device, list(export.handles), export.alloc_index.tolist(),
                                   export.offsets.tolist())
            except KvxferError as exc:
                log.info("CUDA IPC export of the cache failed (same-host peers use another path): %s", exc)

    def _make_area(self) -> None:
        cfg = self.config
        try:
            self.area = StagingArea(self.backend, self.device, cfg.pipeline_slot_bytes, cfg.pipeline_slots,
                                    allocate=None if self.vram else host_allocate,
                                    kind=MemKind.VRAM if self.vram else MemKind.DRAM)
            self._slots = StagingAllocator(self.area.slots, align=1)
        except (KvxferError, ImportError) as exc:
            self.area_why = f"no staging area on this agent: {exc}"
            log.warning("staged pipeline disabled: %s", self.area_why)

    # ---- handshake -------------------------------------------------------------------
    def peer_fields(self) -> dict:
        """The ``PeerInfo`` fields this agent announces for the GPU paths."""
        staging = None
        if self.area is not None:
            staging = StagingWire(self.area.addr, self.area.slot_bytes, self.area.slots, self.area.device,
                                  self.area.kind.value)
        return {"host_id": self.host_id, "net_id": self.net_id, "ipc": self.ipc, "staging": staging}

    # ---- executors -------------------------------------------------------------------
    @property
    def kernel(self) -> Any:
        """The pair-copy executor for this cache's memory (ConfigError without cupy on a GPU)."""
        with self._kernel_lock:
            if self._kernel is None:
                if self.vram:
                    from kvxfer.gpu.ops import PairKernel  # noqa: PLC0415 - needs cupy

                    self._kernel = PairKernel(self.device)
                else:
                    self._kernel = HostPairKernel(self.device)
            return self._kernel

    def launch_and_record(self, copies: list) -> tuple[list, Any]:
        """Enqueue ``copies`` on this agent's CUDA stream, then an event; returns (launches, event).

        The event's ``done`` turns True once the stream has passed every copy."""
        kernel = self.kernel
        with self._kernel_lock:  # one uploader at a time: the kernel's caches are not thread-safe
            cp = kernel.cp
            with cp.cuda.Device(self.device):
                if self._stream is None:
                    self._stream = cp.cuda.Stream(non_blocking=True)
                launches = [kernel.launch(copy, self._stream.ptr) for copy in copies]
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(self._stream)
        return launches, event

    # ---- staging slots ---------------------------------------------------------------
    def slots_per_transfer(self, parts: int) -> int:
        return max(1, min(4, self.area.slots // max(1, parts))) if self.area is not None else 0

    def take_slots(self, count: int, deadline: float, stopped) -> SlotRange:
        """Wait for ``count`` consecutive free slots until ``deadline`` (on ``self.clock``);
        ``stopped()`` raising aborts the wait.

        Raises:
            TransferTimeoutError: the deadline passed first.
            ClosedError: ``close`` began (the area is about to go).
        """
        while True:
            self.sweep_slots()
            with self._slot_lock:
                if self.closing:
                    raise ClosedError("the staging area is closing")
                first = self._slots.allocate(count)
            if first is not None:
                return self.area.subset(first, count)
            stopped()
            if self.clock.now() > deadline:
                raise TransferTimeoutError(f"no {count} free staging slots before the deadline")
            self.clock.sleep(0.001)

    def give_slots(self, slots: SlotRange) -> None:
        with self._slot_lock:
            self._slots.free((slots.addr - self.area.addr) // self.area.slot_bytes)

    def park_slots(self, slots: SlotRange, ready: Callable[[], bool], *, writes: bool = False) -> None:
        """Keep ``slots`` (taken with ``take_slots``) out of the pool until ``ready()`` is True:
        a peer may still read them, or (``writes``) a move still write into them, which also
        keeps ``close`` from freeing the area. ``ready`` is asked now, on every sweep (each turn
        of a ``take_slots`` wait, every ``slots_in_use``, ``close``), never under a lock; the
        slots go back with the first True."""
        with self._slot_lock:
            self._parked.append(_Parked(slots, ready, writes))
        self.sweep_slots()

    def sweep_slots(self) -> None:
        """Give back every parked range whose ``ready()`` is now True. A ``ready`` that raises
        keeps its range parked (logged)."""
        with self._slot_lock:
            parked, self._parked = self._parked, []
        if not parked:
            return
        keep = []
        for entry in parked:
            try:
                ready = entry.ready()
            except Exception:  # noqa: BLE001 - a bug must not hand slots back that may be in use
                log.exception("staging slots: a parked range's check failed; it stays parked")
                ready = False
            if ready:
                self.give_slots(entry.slots)
            else:
                keep.append(entry)
        with self._slot_lock:
            self._parked.extend(keep)

    @property
    def slots_in_use(self) -> int:
        """Slots taken and not back in the pool, parked ones included (parked ranges that are
        ready go back first)."""
        self.sweep_slots()
        return self._slots.in_use if self._slots is not None else 0

    # ---- peers -----------------------------------------------------------------------
    def ipc_why(self, link) -> str | None:
        """None when ``link``'s cache is mapped here (mapping it on first use), else why not."""
        if (why := pair_copy_why(link.spec, self.view.spec)) is not None:
            return why
        state = link.paths.get("ipc")
        if state is None:
            state = link.paths["ipc"] = self._map(link)
        return None if isinstance(state, IpcPeerCache) else state

    def mapped(self, link) -> IpcPeerCache:
        return link.paths["ipc"]

    def direct_template(self, link, view) -> DirectTemplate:
        """The IPC read's tables from ``link``'s mapped cache into ``view`` (built on first use;
        again if the local cache was registered anew)."""
        held = link.paths.get("ipc-direct")
        if held is None or held[0] is not view:
            template = DirectTemplate(link.spec, self.mapped(link).geometry, view.spec, view.geometry)
            held = link.paths["ipc-direct"] = (view, template)
        return held[1]

    def prepared(self, link, view, plan) -> PreparedBlocks | None:
        """Both caches' per-block lists prepared in the backend for small direct reads from
        ``link`` into ``view`` along ``plan`` (``kvxfer.engine.paths.prepared``), or None: not
        ready yet, or they do not apply (a GPU cache, a plan that is not whole blocks, a large
        cache, a backend that cannot prepare). Never prepares on the calling thread (building and
        preparing both caches' rows takes ~1 ms a side for 65,536 rows): the first call for a
        link starts it on a thread of its own, and reads post rows until it is done. Preparing
        is a backend data call, so reads go on meanwhile.
        Released when the link closes."""
        held = link.paths.get("prepared")
        if held is not None and held[0] is view:
            return held[1]
        with self._prep_lock:
            held = link.paths.get("prepared")
            if held is None or held[0] is not view:
                link.paths["prepared"] = (view, None)
                if not self.vram:
                    old = held[1] if held is not None else None
                    start_soon(threading.Thread(target=self._prepare, args=(link, view, plan, old), daemon=True,
                                                name=f"kvxfer-prepare-{link.engine_id}"))
                return None
        return held[1]

    def _prepare(self, link, view, plan, old: PreparedBlocks | None) -> None:
        """``prepared``'s thread: release the lists of an earlier registration, prepare these."""
        if old is not None:
            old.close()
        try:
            blocks = prepare_blocks(self.backend, plan, view, link.view, link.agent_name)
        except KvxferError as exc:
            log.info("peer %s: descriptor lists not prepared, posting rows: %s", link.engine_id, exc)
            return
        if blocks is None:
            return
        with self._prep_lock:
            held = link.paths.get("prepared")
            if link.closed or held is None or held[0] is not view:
                blocks.close()
                return
            link.paths["prepared"] = (view, blocks)
            link.on_close.append(blocks.close)

    def _map(self, link) -> "IpcPeerCache | str":
        info = link.info
        if not self.vram:
            return "the local cache is host memory"
        if self.no_kernel:
            return self.area_why
        if info.mem_kind != MemKind.VRAM.value:
            return f"peer {info.engine_id}'s cache is host memory"
        if not info.host_id or info.host_id != self.host_id:
            return f"peer {info.engine_id} is on another host"
        if info.ipc is None:
            return f"peer {info.engine_id} exported no CUDA IPC handles"
        want = (link.spec.num_layers, link.spec.kv_count)
        if (len(info.ipc.alloc_index), *{len(r) for r in info.ipc.alloc_index}) != want:
            return f"peer {info.engine_id}'s IPC export does not cover its {want} regions"
        try:
            export = IpcExport.from_wire({"device": info.ipc.device, "handles": info.ipc.handles,
                                          "alloc_index": info.ipc.alloc_index, "offsets": info.ipc.offsets})
            mapping = IpcPeerCache(export, self.device)
        except (ConfigError, RegistrationError) as exc:
            log.info("peer %s: CUDA IPC mapping failed, using another path: %s", info.engine_id, exc)
            return f"mapping peer {info.engine_id}'s cache failed: {exc}"
        link.on_close.append(lambda: self._unmap(mapping))
        return mapping

    def _unmap(self, mapping: IpcPeerCache) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # no kernel may still read the peer's memory
        mapping.close()

    def remote(self, link) -> bool:
        """True when ``link``'s peer announced another network stack than this agent's."""
        return bool(link.info.net_id) and bool(self.net_id) and link.info.net_id != self.net_id

    def staged_why(self, link) -> str | None:
        """None when staged reads from ``link`` are possible, else why not."""
        if (why := pair_copy_why(link.spec, self.view.spec)) is not None:
            return why
        if self.area is None:
            return self.area_why
        staging = link.info.staging
        if staging is None:
            return f"peer {link.engine_id} serves no staged reads (no staging area announced)"
        if staging.mem_kind not in (MemKind.DRAM.value, MemKind.VRAM.value):
            return f"peer {link.engine_id} announced staging of kind {staging.mem_kind!r}"
        return None

    def _slots_written(self) -> int:
        """Slots a pipeline or a move may still write: taken and not back, less those parked
        only for a peer to read."""
        self.sweep_slots()
        with self._slot_lock:
            read_only = sum(p.slots.slots for p in self._parked if not p.writes)
            return (self._slots.in_use if self._slots is not None else 0) - read_only

    def close(self) -> None:
        """Refuse new slots, wait up to ``CLOSE_WAIT`` seconds (real time) for the pipelines and
        moves writing into the staging area to end (a cancelled pipeline ends at its next turn,
        its stream synchronized), then deregister and free it. If some still may write, the
        area stays allocated and registered for the life of the process (logged): a leak, never
        memory freed under a write."""
        with self._slot_lock:
            if self.closing:
                return
            self.closing = True
        end = time.monotonic() + CLOSE_WAIT
        while self._slots_written() and time.monotonic() < end:
            time.sleep(0.001)
        if self._stream is not None:
            self._stream.synchronize()
        if self.area is None:
            return
        if self._slots_written():
            log.warning("closing: %d staging slot(s) may still be written by a pipeline or a move; the "
                        "staging area (%d bytes) stays allocated and registered", self._slots_written(),
                        self.area.nbytes)
            _KEPT.append(self.area)
            return
        self.area.close()
