"""Hold words: a table in shared memory whose slot says whether a hold still stands (layer: engine;
imports no agent, transport, nixl or torch).

The producer (``HoldWords``) gives each hold a slot and writes ``(epoch, tag)`` there; before the
hold's blocks go back to the engine it stores 0 into the epoch (``retire``). A consumer on the
same host maps the same file read-only (``WordView``) and, once its move has completed, compares
the slot with its ``HoldToken``: equal means the hold had not ended when the move completed
(docs/reliability.md, "hold tokens"). The table is a file under ``/dev/shm`` so another process
can map it by path; its name carries the engine id, so a restarted producer has a new table and
an old token never matches a later hold, and the pid, so the next table made on the host removes
those of processes that died without closing theirs (``sweep_stale``). Each slot is two little-endian uint64: ``epoch``
(0: no hold) and ``tag``.
"""

from __future__ import annotations

import collections
import hashlib
import mmap
import os
import re
import secrets
import threading

import numpy as np

from kvxfer.errors import ConfigError
from kvxfer.types import HoldToken

__all__ = ["HoldWords", "TokenBook", "WordView", "hold_tag", "sweep_stale", "DEFAULT_SLOTS", "MAX_EPOCH", "epoch_base"]

#: Slots of a producer's table (16 bytes each: 1 MiB). A hold that finds none free gets no token.
DEFAULT_SLOTS = 65_536

_DIR = "/dev/shm"
_INT64 = np.dtype(np.int64)


#: Epochs stay below this (a caller's token above it is refused): a table counts up from a random
#: base below 2**62, so it never reaches 2**64, which the word cannot store.
MAX_EPOCH = 1 << 63


def epoch_base() -> int:
    """Where a new table (or ``TokenBook``) starts counting epochs: a random 62-bit number, so a
    restarted producer (slot 0 again, the same request ids and block ids) never writes the word a
    token of its previous incarnation holds."""
    return secrets.randbits(62)


def hold_tag(request_id: str, block_ids) -> int:
    """``blake2b(request id, block ids as int64)`` as a uint64: what a token's tag must equal for
    a read of ``block_ids`` of ``request_id`` (the ids in the order ``hold`` got them)."""
    h = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8)
    h.update(b"\0")
    if type(block_ids) is not np.ndarray or block_ids.dtype != _INT64 or not block_ids.flags.c_contiguous:
        block_ids = np.ascontiguousarray(np.asarray(block_ids, dtype=np.int64).reshape(-1))
    h.update(block_ids)  # its bytes, as a buffer (a read's checked ids are int64 already: no copy)
    return int.from_bytes(h.digest(), "little")


def sweep_stale(directory: str = _DIR) -> int:
    """Remove the tables of processes that are gone (a SIGKILLed producer cannot remove its own);
    returns how many. A table whose pid is alive (or reused) is left alone."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith("kvxfer-holds-"):
            continue
        pid = name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
        except OSError:  # alive, another user's: not ours to judge
            pass
    return removed


class HoldWords:
    """The producer's table. ``issue`` at hold time, ``retire`` before the blocks go back.

    Thread-safe (one lock around the free list and the epoch counter). ``path`` is where a
    same-host consumer maps it; ``array`` is the ``(slots, 2)`` uint64 view (its buffer may also
    be registered with NIXL for consumers on other hosts)."""

    def __init__(self, engine_id: str, slots: int = DEFAULT_SLOTS, directory: str = _DIR) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"hold word slots must be an integer >= 1; got {slots!r}")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:200]
        sweep_stale(directory)
        self.path = os.path.join(directory, f"kvxfer-holds-{safe}-{os.getpid()}")
        self.slots = slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, slots * 16)
            self._map = mmap.mmap(fd, slots * 16)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype="<u8").reshape(slots, 2)
        self._free = list(range(slots - 1, -1, -1))  # may also list slots taken by ``reserve`` (skipped)
        self._listed = np.ones(slots, dtype=bool)    # in ``_free`` (each slot at most once: no growth)
        self._slot: dict[str, int] = {}   # request id -> its slot
        self._taken = np.zeros(slots, dtype=bool)
        self._last = np.zeros(slots, dtype=np.uint64)  # the last epoch written to each slot
        self._wanted: dict[str, tuple[HoldToken, bool]] = {}  # ``reserve``d tokens (and: it took the slot)
        self._epoch = epoch_base()  # a restarted producer's table never repeats an old token
        self._lock = threading.Lock()
        self._closed = False

    def issue(self, request_id: str, block_ids) -> HoldToken | None:
        """Give ``request_id`` a slot (its old one, if it has one: a replaced hold) and a fresh
        epoch; write ``tag`` then ``epoch``. None when no slot is free (the read then claims)."""
        tag = hold_tag(request_id, block_ids)
        with self._lock:
            if self._closed:
                return None
            wanted = self._wanted.pop(request_id, (None, False))[0]
            if wanted is not None and wanted.tag == tag:  # ``reserve`` took its slot and checked its epoch
                slot, epoch = wanted.slot, wanted.epoch
            else:
                slot = self._slot.get(request_id)
                if slot is None:
                    slot = self._pop_free()
                    if slot is None:
                        return None
                    self._slot[request_id] = slot
                self._epoch += 1
                epoch = self._epoch
            self._last[slot] = epoch
            row = self.array[slot]
            row[0] = 0        # the old hold of this slot (a replace) ends first
            row[1] = tag
            row[0] = epoch    # one aligned 8-byte store: the token is valid from here
        return HoldToken(slot, epoch, tag)

    def _pop_free(self) -> int | None:
        while self._free:
            slot = self._free.pop()
            self._listed[slot] = False
            if not self._taken[slot]:
                self._taken[slot] = True
                return slot
        return None

    def reserve(self, request_id: str, token: HoldToken, block_ids) -> None:
        """Let the next ``issue`` for ``request_id`` write the caller's ``token`` (an engine whose
        answer leaves before its hold is made chooses the token itself: ``TokenBook``). Checks,
        changing nothing when it raises: the tag is ``hold_tag(request_id, block_ids)``, the slot
        is in the table and held by no other request (a request that has a slot keeps it), the
        epoch is above every epoch written to that slot.

        Raises:
            ConfigError: naming the token's value and what the table expected.
        """
        if not isinstance(token, HoldToken):
            raise ConfigError(f"a hold's token must be a HoldToken; got {type(token).__name__} {token!r}")
        tag = hold_tag(request_id, block_ids)
        if token.tag != tag:
            raise ConfigError(f"request {request_id!r}: the hold token's tag {token.tag:#x} is not this request's "
                              f"for these {len(block_ids)} blocks (expected {tag:#x}, kvxfer.hold_tag)")
        with self._lock:
            if self._closed:
                raise ConfigError(f"request {request_id!r}: the hold-word table {self.path!r} is closed")
            slot, epoch = token.slot, token.epoch
            if not 0 <= slot < self.slots:
                raise ConfigError(f"request {request_id!r}: hold token slot {slot} is past the table "
                                  f"({self.slots} slots)")
            own = self._slot.get(request_id)
            if own is not None and own != slot:
                raise ConfigError(f"request {request_id!r} holds slot {own}; its new token names slot {slot}")
            if own is None and self._taken[slot]:
                raise ConfigError(f"request {request_id!r}: hold token slot {slot} is another hold's")
            if not isinstance(epoch, int) or not 0 < epoch < MAX_EPOCH or epoch <= int(self._last[slot]):
                raise ConfigError(f"request {request_id!r}: hold token epoch {epoch!r} must be an integer below "
                                  f"2**63 and above the last epoch of slot {slot} ({int(self._last[slot])})")
            if own is None:
                self._taken[slot] = True
                self._slot[request_id] = slot
            self._wanted[request_id] = (token, own is None)
            self._epoch = max(self._epoch, epoch)

    def unreserve(self, request_id: str) -> None:
        """Undo a ``reserve`` whose hold was refused: a slot it took is free again."""
        with self._lock:
            token, took = self._wanted.pop(request_id, (None, False))
            if token is not None and took and self._slot.get(request_id) == token.slot:
                del self._slot[request_id]
                self._taken[token.slot] = False
                self._list_free(token.slot)

    def token(self, request_id: str) -> HoldToken | None:
        """The token of ``request_id``'s current hold, or None (no hold, or none was given)."""
        with self._lock:
            slot = self._slot.get(request_id)
            if slot is None:
                return None
            epoch, tag = (int(v) for v in self.array[slot])
        return HoldToken(slot, epoch, tag) if epoch else None

    def retire(self, request_id: str) -> None:
        """The hold of ``request_id`` ends: store 0 into its epoch (before anything reports it
        free) and free the slot. Idempotent; a request without a slot is ignored."""
        with self._lock:
            self._wanted.pop(request_id, None)
            slot = self._slot.pop(request_id, None)
            if slot is None:
                return
            self.array[slot, 0] = 0
            self._taken[slot] = False
            self._list_free(slot)

    def _list_free(self, slot: int) -> None:
        """Put ``slot`` on the free list unless it is there already (a slot ``reserve`` took stays
        listed, skipped when popped): the list never holds more than ``slots`` entries."""
        if not self._listed[slot]:
            self._listed[slot] = True
            self._free.append(slot)

    def close(self) -> None:
        """Retire every word, then remove the file (a consumer's mapping stays readable: zeros)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.array[:, 0] = 0
            self._slot.clear()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class TokenBook:
    """Tokens chosen before the hold is made, for an engine whose answer (with the token) leaves
    another process than the one that holds (vLLM: the scheduler answers, its workers hold). It
    mirrors the workers' tables: ``issue`` gives a slot no live hold of this book has and an
    epoch above every one it gave; each worker passes the token to ``Agent.hold(..., token=)``,
    which writes it into its own table (every TP rank the same token). ``retire`` once the
    workers reported the hold ended. Slots are reused oldest-retired first, so a slot comes back
    only after every other free slot was used (a hold a worker is still ending when its slot comes
    back refuses the new token: that hold is made without it, and its token reads fail typed).
    Not thread-safe (one scheduler thread)."""

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ConfigError(f"hold word slots must be an integer >= 1; got {slots!r}")
        self.slots = slots
        self._free = collections.deque(range(slots))
        self._slot: dict[str, int] = {}
        self._epoch = epoch_base()

    def issue(self, request_id: str, block_ids) -> HoldToken | None:
        """A token for holding ``block_ids`` of ``request_id`` (its slot kept if it has one; a new
        epoch). None when every slot is taken (the hold gets no token; its reads claim)."""
        slot = self._slot.get(request_id)
        if slot is None:
            if not self._free:
                return None
            slot = self._slot[request_id] = self._free.popleft()
        self._epoch += 1
        return HoldToken(slot, self._epoch, hold_tag(request_id, block_ids))

    def retire(self, request_id: str) -> None:
        """The hold of ``request_id`` ended at the workers: its slot may be given again (last)."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._slot)


class WordView:
    """A consumer's read-only map of a producer's table on this host."""

    def __init__(self, path: str, slots: int) -> None:
        if not isinstance(path, str) or not path.startswith(_DIR + "/kvxfer-holds-") or "/.." in path:
            raise ConfigError(f"a hold-word table lives under {_DIR}/kvxfer-holds-*; got {path!r}")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < slots * 16 or slots < 1:
                raise ConfigError(f"hold-word table {path!r} has {size} bytes; the producer announced {slots} slots")
            self._map = mmap.mmap(fd, slots * 16, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.slots = slots
        self.array = np.frombuffer(self._map, dtype="<u8").reshape(slots, 2)

    def check(self, token: HoldToken) -> str:
        """"" when the slot still holds ``token``'s word, else why not. Read once after the move."""
        if token.slot >= self.slots:
            return f"hold token slot {token.slot} is past the producer's table ({self.slots} slots)"
        epoch = int(self.array[token.slot, 0])   # the epoch first: a retire stores 0 there
        tag = int(self.array[token.slot, 1])
        return _why(token, epoch, tag)

    def check_many(self, tokens: list) -> list[str]:
        """``check`` of many tokens at once (a step's reads): one gather of their slots' epochs,
        then one of their tags; "" or why not, per token."""
        slots = np.fromiter((t.slot for t in tokens), dtype=np.int64, count=len(tokens))
        if not slots.size or int(slots.max()) >= self.slots:
            return [self.check(t) for t in tokens]  # (a slot past the table: named one by one)
        epochs = self.array[slots, 0]   # the epochs first, as ``check`` reads them
        tags = self.array[slots, 1]
        want = np.fromiter((t.epoch for t in tokens), dtype=np.uint64, count=len(tokens))
        wrong = want != epochs
        wrong |= np.fromiter((t.tag for t in tokens), dtype=np.uint64, count=len(tokens)) != tags
        if not wrong.any():
            return [""] * len(tokens)
        return [_why(t, int(e), int(g)) if bad else "" for t, e, g, bad in zip(tokens, epochs, tags, wrong.tolist())]


def _why(token: HoldToken, epoch: int, tag: int) -> str:
    """"" when the word read (``epoch``, ``tag``) is ``token``'s, else why the read fails."""
    if epoch != token.epoch or tag != token.tag:
        now = "no hold" if epoch == 0 else f"a later hold (epoch {epoch})"
        return (f"the producer's hold ended before the read's move completed (its slot {token.slot} now "
                f"holds {now}; the token had epoch {token.epoch})")
    return ""
