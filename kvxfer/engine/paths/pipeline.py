"""The staged GPU pipeline: pack -> move -> unpack in pieces, overlapped (layer: engine: only the engine posts to the backend; imports backend.base and gpu, never nixl/zmq; cupy lazily).

A request's pairs (``kvxfer.layout.pairs``, wire order) are cut into *pieces* that each fit one
*slot* of a ``StagingArea`` (a device buffer allocated and registered once, then reused; its
size bounds the staging memory whatever the request's size). The producer packs piece ``k``
into a slot with one kernel; the piece crosses the link as ONE descriptor; the consumer
unpacks it with one kernel. While piece ``k`` moves, ``k+1`` is being packed and ``k-1``
unpacked.

Two directions, same pieces:

* READ (consumer pulls): producer packs, sends ``READY(k, slot)``; consumer READs the slot
  into one of its own, sends ``FREE(k, slot)`` (the producer may reuse it) and unpacks.
* WRITE (producer pushes): the producer holds one credit per consumer slot; it packs, WRITEs
  into a consumer slot with notification ``DATA(k, slot)``; the consumer unpacks and returns
  the credit with ``FREE(k, slot)``.

Until its FREE, a slot announced READY stays the consumer's to read (``serve_read``'s ``lent``).
A READ that ends early on the consumer (failed, cancelled, timed out) with every READ of the
producer's slots confirmed ended sends ``STOP``: the producer's ``serve_read`` returns and its
slots may be reused at once.

Messages are 20-byte ``PipeMessage`` records carried by a ``Link`` (the engine routes them
through its own channel; the benchmark uses the backend's notifications). Every loop takes a
deadline and raises ``TransferTimeoutError`` past it, ``TransferFailedError`` when the backend
reports a failed move. Deadlines are read on the ``clock`` keyword (the engine passes its
``PathKit.clock``; ``MonotonicClock`` when left out); the polls between reads sleep in real time.
"""

from __future__ import annotations

import collections
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kvxfer.backend.base import Backend, descs
from kvxfer.clock import Clock, MonotonicClock
from kvxfer.errors import ConfigError, ProtocolError, TransferFailedError, TransferTimeoutError
from kvxfer.gpu.ops import PairKernel
from kvxfer.layout.pairs import PairCopy
from kvxfer.types import Direction, MemKind, Region, XferState

__all__ = ["DRAIN_GRACE", "SlotsQuarantined", "drain", "Link", "PipeMessage", "stop_message", "StagingArea", "SlotRange", "split_pieces", "serve_read", "fetch_read",
           "push_write", "receive_write", "host_allocate", "is_pipe_message"]

_FMT = struct.Struct("<3sBBxxxQI")  # magic, version, kind, 3 pad, tag, piece | slot << 20
_MAGIC, _VERSION = b"KXS", 1
READY, FREE, DATA, STOP = 1, 2, 3, 4
_MAX_PIECES = 1 << 20


@dataclass(frozen=True)
class PipeMessage:
    """One pipeline message: ``kind`` READY/FREE/DATA for piece ``piece`` of request ``tag`` in ``slot``;
    STOP (piece and slot 0) ends the transfer ``tag``."""

    kind: int
    tag: int
    piece: int
    slot: int

    def encode(self) -> bytes:
        return _FMT.pack(_MAGIC, _VERSION, self.kind, self.tag, self.piece | (self.slot << 20))

    @classmethod
    def decode(cls, raw: bytes) -> "PipeMessage | None":
        """Parse a message; None when ``raw`` is not a pipeline message (other traffic).

        Raises ProtocolError for a pipeline message of another version or an unknown kind."""
        if len(raw) != _FMT.size or raw[:3] != _MAGIC:
            return None
        magic, version, kind, tag, packed = _FMT.unpack(raw)
        if version != _VERSION or kind not in (READY, FREE, DATA, STOP):
            raise ProtocolError(f"pipeline message: expected version {_VERSION} and kind 1-4; "
                                f"got version {version}, kind {kind}")
        return cls(kind, tag, packed & (_MAX_PIECES - 1), packed >> 20)


def stop_message(tag: int) -> bytes:
    """The STOP of transfer ``tag``: the consumer's READs of the producer's slots have all ended."""
    return PipeMessage(STOP, tag, 0, 0).encode()


def is_pipe_message(raw: bytes) -> bool:
    """Whether ``raw`` is a pipeline message (by its length and magic; not validated further)."""
    return len(raw) == _FMT.size and raw[:3] == _MAGIC


class Link(Protocol):
    """Carries pipeline messages to the one peer of a transfer. A link may also have
    ``wait(timeout)``: block until a message arrives or ``timeout`` seconds pass (see ``_Pacer``)."""

    def send(self, message: bytes) -> None: ...

    def receive(self) -> list[bytes]: ...


#: A pipeline loop that found nothing to do keeps polling (yielding the GIL each turn) for this
#: long, then blocks on its link for up to ``IDLE_WAIT`` seconds at a time.
IDLE_SPIN = 100e-6
IDLE_WAIT = 200e-6


class _Pacer:
    """Paces one pipeline loop so it never holds the GIL while it waits.

    A loop that spins without releasing the GIL keeps every other Python thread of the process
    (the agent's progress loop, which delivers the pipeline's notifications) waiting for the
    interpreter's switch interval, 5 ms, at every hand-off. ``turn(moved)`` after each pass:
    a pass that moved something continues at once; an idle one yields (``time.sleep(0)``), and
    after ``IDLE_SPIN`` of idle passes waits on the link (woken by the next message) or sleeps.
    """

    def __init__(self, link: Link) -> None:
        self._wait = getattr(link, "wait", None)
        self._idle_since: float | None = None

    def turn(self, moved: bool) -> None:
        if moved:
            self._idle_since = None
            return
        now = time.perf_counter()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < IDLE_SPIN:
            time.sleep(0)
        elif self._wait is not None:
            self._wait(IDLE_WAIT)
        else:
            time.sleep(IDLE_WAIT)


class StagingArea:
    """``slots`` x ``slot_bytes`` of device memory, registered with ``backend`` once.

    Args:
        backend: the transfer agent (registration happens here; ``close`` deregisters).
        device: CUDA ordinal.
        slot_bytes: bytes per slot (one piece moves as one descriptor of at most this).
        slots: number of slots (2 or more lets pack, move and unpack overlap).
        allocate: ``(nbytes, device) -> (owner, address)``; defaults to a torch uint8 tensor
            (``host_allocate`` for a host-memory area).
        kind: memory kind of what ``allocate`` returns (``DRAM`` for the host twin).
    """

    def __init__(self, backend: Backend, device: int, slot_bytes: int, slots: int = 4,
                 allocate: Callable[[int, int], tuple[Any, int]] | None = None,
                 kind: MemKind = MemKind.VRAM) -> None:
        if slot_bytes <= 0 or slot_bytes % 256 or slots < 1:
            raise ConfigError(f"slot_bytes must be a positive multiple of 256 and slots >= 1; "
                              f"got {slot_bytes}, {slots}")
        self.backend, self.device, self.kind = backend, int(device), MemKind(kind)
        self.slot_bytes, self.slots = int(slot_bytes), int(slots)
        self._owner, self.addr = (allocate or _torch_allocate)(self.nbytes, self.device)
        self._reg = backend.register([self.region])
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    @property
    def region(self) -> Region:
        return Region(self.addr, self.nbytes, self.device, self.kind)

    def slot_addr(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ConfigError(f"slot must be in [0, {self.slots}); got {slot}")
        return self.addr + slot * self.slot_bytes

    def subset(self, first: int, count: int) -> "SlotRange":
        """Slots ``[first, first + count)`` as an area of their own (one per peer of a transfer)."""
        if first < 0 or count < 1 or first + count > self.slots:
            raise ConfigError(f"slot range [{first}, {first + count}) must lie in [0, {self.slots})")
        return SlotRange(self.slot_addr(first), self.slot_bytes, count, self.device, self.kind)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.deregister(self._reg)
            self._owner = None

    def __enter__(self) -> "StagingArea":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class SlotRange:
    """A run of slots of a ``StagingArea`` (what the pipeline functions need of an area)."""

    addr: int
    slot_bytes: int
    slots: int
    device: int
    kind: MemKind = MemKind.VRAM

    def slot_addr(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ConfigError(f"slot must be in [0, {self.slots}); got {slot}")
        return self.addr + slot * self.slot_bytes


def host_allocate(nbytes: int, device: int = 0) -> tuple[Any, int]:
    """A host-memory staging buffer (zeroed pages come on first touch: an agent that never moves a
    staged read keeps none of it resident)."""
    buf = np.zeros(nbytes, dtype=np.uint8)
    return buf, int(buf.ctypes.data)


def _torch_allocate(nbytes: int, device: int) -> tuple[Any, int]:
    import torch  # noqa: PLC0415 - optional, imported on first GPU use

    t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    return t, int(t.data_ptr())


def split_pieces(copy: PairCopy, slot_bytes: int, min_pieces: int = 1) -> list[tuple[int, int]]:
    """Cut ``copy``'s pairs into contiguous ranges of equal-ish size, each <= ``slot_bytes``."""
    pb = copy.pair_bytes
    if pb > slot_bytes:
        raise ConfigError(f"one pair ({pb} bytes) must fit a slot; got slot_bytes={slot_bytes}")
    count = max(min_pieces, -(-copy.nbytes // slot_bytes), 1)
    count = min(count, max(copy.n, 1), _MAX_PIECES)
    edges = np.linspace(0, copy.n, count + 1).round().astype(np.int64)
    while any((b - a) * pb > slot_bytes for a, b in zip(edges[:-1], edges[1:])):
        count += 1
        edges = np.linspace(0, copy.n, count + 1).round().astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class _Gpu:
    """The pipeline's stream, events and kernel (one per process side of a transfer)."""

    def __init__(self, kernel: PairKernel) -> None:
        self.kernel, self.cp = kernel, kernel.cp
        with self.cp.cuda.Device(kernel.device):
            self.stream = self.cp.cuda.Stream(non_blocking=True)
        self._live: list[tuple[Any, Any]] = []

    def run(self, copy: PairCopy) -> Any:
        """Launch ``copy`` on the pipeline stream; returns an event that completes after it."""
        with self.cp.cuda.Device(self.kernel.device):
            keep = self.kernel.launch(copy, self.stream.ptr)
            event = self.cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        self._live.append((event, keep))
        return event

    def reap(self) -> None:
        self._live = [(e, k) for e, k in self._live if not e.done]


def _split_done(items: list[tuple[Any, Any]]) -> tuple[list, list]:
    """Partition (x, event) pairs by ONE query of each event (it may complete between two)."""
    done, pending = [], []
    for item in items:
        (done if item[1].done else pending).append(item)
    return done, pending


def _check_deadline(clock: Clock, deadline: float, what: str) -> None:
    if clock.now() > deadline:
        raise TransferTimeoutError(f"staged transfer: deadline passed while {what}")


def _messages(link: Link, tag: int, kind: int | tuple[int, ...], pieces: int) -> list[PipeMessage]:
    """This transfer's messages of ``kind`` (one kind or a tuple of them). The link delivers one
    transfer's traffic; anything else on it is ignored. Raises ProtocolError for a piece number
    out of range."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    out = []
    for raw in link.receive():
        msg = PipeMessage.decode(raw)
        if msg is not None and msg.tag == tag and msg.kind in kinds:
            if not 0 <= msg.piece < pieces:
                raise ProtocolError(f"pipeline message for piece {msg.piece}; expected [0, {pieces})")
            out.append(msg)
    return out


def _piece_copy(copy: PairCopy, piece: tuple[int, int], slot_addr: int, staging_side: str) -> PairCopy:
    """Pairs of one piece, with its staging addresses (built from offset 0) moved into a slot."""
    part = copy.slice(*piece)
    delta = slot_addr - piece[0] * copy.pair_bytes
    return part.shifted(dst_delta=delta) if staging_side == "dst" else part.shifted(src_delta=delta)


def serve_read(tag: int, pack: PairCopy, area: StagingArea, kernel: PairKernel, link: Link,
               deadline: float, slot_bytes: int | None = None, *, clock: Clock | None = None,
               lent: set[int] | None = None) -> None:
    """Producer side of a READ: pack every piece (``pack`` built with staging offset 0), announce
    it, and reuse slots as the consumer frees them. Returns once every piece was read, or once
    the consumer sent STOP (its READs of these slots ended). ``deadline`` is on ``clock``
    (``MonotonicClock`` by default).

    ``lent`` (a set, filled here): the pieces announced READY and not yet freed; a READ of their
    slots may still be in flight. Emptied by a STOP; when this raises, what is left in it says
    whether the caller may reuse the slots now (empty) or only once the consumer can no longer
    read them."""
    gpu = _Gpu(kernel)
    pieces = split_pieces(pack, slot_bytes or area.slot_bytes)
    try:
        _serve_pieces(tag, pack, pieces, area, gpu, link, deadline, clock or MonotonicClock(),
                      set() if lent is None else lent)
    finally:  # the slots go back to the caller only once no pack kernel can still write them
        gpu.stream.synchronize()


def _serve_pieces(tag: int, pack: PairCopy, pieces: list[tuple[int, int]], area: StagingArea, gpu: "_Gpu",
                  link: Link, deadline: float, clock: Clock, lent: set[int]) -> None:
    free = collections.deque(range(area.slots))
    packing: collections.deque = collections.deque()
    seen: set[int] = set()   # pieces freed: a peer's duplicate must not end the loop early
    k = freed = 0
    pacer = _Pacer(link)
    while freed < len(pieces):
        moved = False
        if k < len(pieces) and free:  # one launch per turn, so READY k leaves as soon as pack k ends
            slot = free.popleft()
            packing.append((k, slot, gpu.run(_piece_copy(pack, pieces[k], area.slot_addr(slot), "dst"))))
            k += 1
            moved = True
        while packing and packing[0][2].done:
            piece, slot, _ = packing.popleft()
            lent.add(piece)  # before the send: the consumer may READ the slot from then on
            link.send(PipeMessage(READY, tag, piece, slot).encode())
            moved = True
        for msg in _messages(link, tag, (FREE, STOP), len(pieces)):
            if msg.kind == STOP:
                lent.clear()
                return
            if msg.piece >= k or msg.piece in seen:
                raise ProtocolError(f"FREE for piece {msg.piece}: not announced, or freed twice")
            seen.add(msg.piece)
            lent.discard(msg.piece)
            free.append(msg.slot)
            freed += 1
            moved = True
        gpu.reap()
        _check_deadline(clock, deadline, f"serving piece {freed} of {len(pieces)}")
        pacer.turn(moved)


def fetch_read(tag: int, unpack: PairCopy, area: StagingArea, kernel: PairKernel, link: Link,
               backend: Backend, peer: str, remote_slot_addr: Callable[[int], int], remote_device: int,
               deadline: float, slot_bytes: int | None = None, trace: list | None = None,
               remote_kind: MemKind = MemKind.VRAM, *, clock: Clock | None = None) -> None:
    """Consumer side of a READ: pull each announced piece into a local slot, free the remote slot,
    unpack. Returns once every piece is unpacked and the unpack stream has finished.
    A READY for a slot outside the producer's ``remote_slots`` is the caller's to bound
    (``remote_slot_addr`` raises for it).

    ``deadline`` is on ``clock`` (``MonotonicClock`` by default). ``trace`` (a list) receives
    ``(what, piece, perf_counter())`` for every step, for profiling."""
    clock = clock or MonotonicClock()
    note = (lambda what, piece: trace.append((what, piece, time.perf_counter()))) if trace is not None \
        else (lambda what, piece: None)
    gpu = _Gpu(kernel)
    pieces = split_pieces(unpack, slot_bytes or area.slot_bytes)
    moving: list[tuple[int, int, int, int]] = []  # piece, local slot, remote slot, xfer
    try:
        _fetch_pieces(tag, unpack, pieces, area, gpu, link, backend, peer, remote_slot_addr, remote_device,
                      remote_kind, deadline, clock, moving, note)
    finally:
        # Failed or cancelled: nothing may land in a slot after we return. Releasing a pending
        # READ does not stop its bytes (UCX over TCP), so wait for each to end first.
        stuck = drain(backend, [xid for _, _, _, xid in moving], max(deadline, clock.now()) + DRAIN_GRACE,
                      clock=clock)
        gpu.stream.synchronize()
        if stuck:
            raise SlotsQuarantined(f"staged READ (tag {tag}): {len(stuck)} move(s) into this transfer's slots "
                                   "not confirmed ended; the slots are quarantined", stuck)


#: Seconds past a pipeline's deadline that it waits for its NIXL moves to end before giving up.
DRAIN_GRACE = 0.25


class SlotsQuarantined(TransferFailedError):
    """A pipeline ended with moves into its slots still pending: the slots must not be reused
    until every transfer in ``moves`` (backend ids, not released) has ended."""

    def __init__(self, message: str, moves: list[int] | None = None) -> None:
        super().__init__(message)
        self.moves = list(moves or [])


def drain(backend: Backend, xids: list[int], until: float, *, clock: Clock | None = None) -> list[int]:
    """Release each transfer once the backend says it ended (DONE or FAILED), polling until
    ``until`` (on ``clock``, ``MonotonicClock`` by default); returns those still pending then
    (left unreleased: they may still write). An ``until`` already passed looks once."""
    clock = clock or MonotonicClock()
    pending = list(xids)
    while pending:
        still = []
        for xid in pending:
            try:
                ended = backend.state(xid) is not XferState.PENDING
            except TransferFailedError:
                ended = True
            except Exception:  # noqa: BLE001 - a closed backend moves nothing any more
                ended = True
            if ended:
                try:
                    backend.release(xid)
                except Exception:  # noqa: BLE001 - ended already; releasing is bookkeeping
                    pass
            else:
                still.append(xid)
        pending = still
        if pending and clock.now() >= until:
            return pending
        if pending:
            clock.sleep(0.0005)
    return []


def _fetch_pieces(tag, unpack, pieces, area, gpu, link, backend, peer, remote_slot_addr, remote_device,
                  remote_kind, deadline, clock, moving, note) -> None:
    ready: collections.deque = collections.deque()
    announced: set[int] = set()   # a peer's duplicate READY must not count a piece twice
    free = collections.deque(range(area.slots))
    unpacking: list[tuple[int, Any]] = []
    done = 0
    dev = area.device
    pacer = _Pacer(link)
    while done < len(pieces):
        moved = False
        for msg in _messages(link, tag, READY, len(pieces)):
            if msg.piece in announced:
                raise ProtocolError(f"READY for piece {msg.piece} twice")
            announced.add(msg.piece)
            note("ready", msg.piece)
            ready.append(msg)
            moved = True
        while ready and free:
            msg, slot = ready.popleft(), free.popleft()
            n = (pieces[msg.piece][1] - pieces[msg.piece][0]) * unpack.pair_bytes
            xid = backend.post(Direction.READ, descs([area.slot_addr(slot)], n, dev), area.kind,
                               descs([remote_slot_addr(msg.slot)], n, remote_device), remote_kind,
                               peer, b"")
            moving.append((msg.piece, slot, msg.slot, xid))
            note("posted", msg.piece)
            moved = True
        for entry in list(moving):
            piece, slot, rslot, xid = entry
            state = backend.state(xid)
            if state is XferState.PENDING:
                continue
            moving.remove(entry)
            if state is XferState.FAILED:
                backend.release(xid)
                raise TransferFailedError(f"staged READ of piece {piece} (tag {tag}) failed")
            note("moved", piece)
            # Unpack first: releasing the handle and freeing the producer's slot can wait.
            unpacking.append((slot, gpu.run(_piece_copy(unpack, pieces[piece], area.slot_addr(slot), "src"))))
            note("unpack-launched", piece)
            backend.release(xid)
            link.send(PipeMessage(FREE, tag, piece, rslot).encode())
            moved = True
        finished, unpacking = _split_done(unpacking)
        for slot, _ in finished:
            note("unpacked", slot)
            free.append(slot)
            done += 1
            moved = True
        gpu.reap()
        _check_deadline(clock, deadline, f"fetching piece {done} of {len(pieces)}")
        pacer.turn(moved)


def push_write(tag: int, pack: PairCopy, area: StagingArea, kernel: PairKernel, link: Link,
               backend: Backend, peer: str, remote_slot_addr: Callable[[int], int], remote_slots: int,
               remote_device: int, deadline: float, slot_bytes: int | None = None, *,
               clock: Clock | None = None) -> None:
    """Producer side of a WRITE: pack, write each piece into a consumer slot it holds a credit
    for (notification ``DATA``), and return once the consumer has freed every piece.
    ``deadline`` is on ``clock`` (``MonotonicClock`` by default)."""
    clock = clock or MonotonicClock()
    gpu = _Gpu(kernel)
    pieces = split_pieces(pack, slot_bytes or area.slot_bytes)
    free = collections.deque(range(area.slots))
    credits = collections.deque(range(remote_slots))
    packing: collections.deque = collections.deque()
    moving: list[tuple[int, int, int]] = []
    k = freed = 0
    dev = area.device
    pacer = _Pacer(link)
    while freed < len(pieces):
        moved = False
        while k < len(pieces) and free and credits:
            slot, rslot = free.popleft(), credits.popleft()
            event = gpu.run(_piece_copy(pack, pieces[k], area.slot_addr(slot), "dst"))
            packing.append((k, slot, rslot, event))
            k += 1
            moved = True
        while packing and packing[0][3].done:
            piece, slot, rslot, _ = packing.popleft()
            n = (pieces[piece][1] - pieces[piece][0]) * pack.pair_bytes
            xid = backend.post(Direction.WRITE, descs([area.slot_addr(slot)], n, dev), MemKind.VRAM,
                               descs([remote_slot_addr(rslot)], n, remote_device), MemKind.VRAM, peer,
                               PipeMessage(DATA, tag, piece, rslot).encode())
            moving.append((piece, slot, xid))
            moved = True
        still = []
        for piece, slot, xid in moving:
            state = backend.state(xid)
            if state is XferState.PENDING:
                still.append((piece, slot, xid))
                continue
            backend.release(xid)
            if state is XferState.FAILED:
                raise TransferFailedError(f"staged WRITE of piece {piece} (tag {tag}) failed")
            free.append(slot)
            moved = True
        moving = still
        for msg in _messages(link, tag, FREE, len(pieces)):
            credits.append(msg.slot)
            freed += 1
            moved = True
        gpu.reap()
        _check_deadline(clock, deadline, f"pushing piece {freed} of {len(pieces)}")
        pacer.turn(moved)


def receive_write(tag: int, unpack: PairCopy, area: StagingArea, kernel: PairKernel, link: Link,
                  deadline: float, slot_bytes: int | None = None, *, clock: Clock | None = None) -> None:
    """Consumer side of a WRITE: unpack each piece as its ``DATA`` arrives, return its credit.
    Returns once every piece is unpacked. ``deadline`` is on ``clock`` (``MonotonicClock`` by
    default)."""
    clock = clock or MonotonicClock()
    gpu = _Gpu(kernel)
    pieces = split_pieces(unpack, slot_bytes or area.slot_bytes)
    unpacking: list[tuple[PipeMessage, Any]] = []
    done = 0
    pacer = _Pacer(link)
    while done < len(pieces):
        moved = False
        for msg in _messages(link, tag, DATA, len(pieces)):
            copy = _piece_copy(unpack, pieces[msg.piece], area.slot_addr(msg.slot), "src")
            unpacking.append((msg, gpu.run(copy)))
            moved = True
        finished, unpacking = _split_done(unpacking)
        for msg, _ in finished:
            link.send(PipeMessage(FREE, tag, msg.piece, msg.slot).encode())
            done += 1
            moved = True
        gpu.reap()
        _check_deadline(clock, deadline, f"receiving piece {done} of {len(pieces)}")
        pacer.turn(moved)
    gpu.stream.synchronize()
