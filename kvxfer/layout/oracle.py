"""Byte-level reference for checking layout plans over real numpy buffers (layer: layout, pure; numpy only, no nixl/zmq/torch).

Tests (and the engine's integration tests) use these to execute a ``RequestPlan`` without any
transport and to read back the *logical* KV of a cache:

* ``Arena``: a uint8 buffer standing for the address range ``[base, base + size)``; use
  ``Arena.wrap(array)`` to treat a real numpy array's own addresses that way.
* ``place_cache``: a ``CacheView`` for a spec inside an arena (contiguous or with gaps).
* ``fill_pattern``: random bytes, with a distinct 32-bit code heading every head vector.
* ``logical_kv``: ``[layers, kv, tokens, heads_per_rank, vector_bytes]`` uint8 of given blocks
  (``byte_addresses`` gives where each byte lives, a dim-major K included).
* ``execute``: run a request's descriptors with a reference copier (plus unpack / pack);
  ``fill_staging`` gives the staging image alone, ``region_views`` the callable unpack takes.
* several groups: ``place_hybrid`` lays a ``HybridSpec`` out in one arena (groups may share
  memory), ``read_state`` / ``write_state`` / ``state_byte_addresses`` read and write state
  slots from ``StateSpec``'s definition, ``execute_hybrid`` runs every group's part.
"""

from __future__ import annotations

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.layout.plan import CacheView, SplitKVPlan, TransferPlan
from kvxfer.layout.request import RequestPlan
from kvxfer.layout.spec import CacheGeometry, KVSpec, Storage
from kvxfer.types import Direction

__all__ = [
    "Arena", "byte_addresses", "execute", "execute_hybrid", "fill_pattern", "fill_staging", "logical_kv", "place_cache",
    "place_hybrid", "read_state", "region_views", "state_byte_addresses", "state_mask", "target_mask",
    "vector_addresses", "write_state",
]


class Arena:
    """A uint8 buffer standing for addresses ``[base, base + buf.size)``."""

    def __init__(self, size: int, base: int = 0x10_0000) -> None:
        self.buf = np.zeros(size, dtype=np.uint8)
        self.base = base

    @classmethod
    def wrap(cls, array: np.ndarray) -> "Arena":
        """An arena over an existing contiguous array at its real address (for real-memory tests)."""
        a = cls.__new__(cls)
        a.buf = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        a.base = int(a.buf.ctypes.data)
        return a

    def view(self, addr: int, length: int) -> np.ndarray:
        """Writable uint8 view of ``[addr, addr + length)``; LayoutError when outside the arena."""
        start = int(addr) - self.base
        if start < 0 or start + int(length) > self.buf.size:
            raise LayoutError(
                f"range [{int(addr):#x}, +{int(length)}) is outside the arena "
                f"[{self.base:#x}, +{self.buf.size})"
            )
        return self.buf[start:start + int(length)]


def place_cache(spec: KVSpec, arena_base: int = 0x10_0000, gap: int = 0) -> tuple[CacheView, Arena]:
    """Lay out ``spec``'s cache in a fresh arena; returns its view and the arena.

    ``gap`` = 0 gives ``CacheGeometry.contiguous``. With a gap, every separately allocatable
    tensor (a split region, a packed layer) sits after ``gap`` unused bytes, like tensors from
    separate allocations; cross-layer caches are one tensor either way.
    """
    L, K, bb, n = spec.num_layers, spec.kv_count, spec.block_bytes, spec.num_blocks
    if gap == 0 or spec.storage is Storage.CROSS_LAYER:
        size = spec.cache_bytes
        geo = CacheGeometry.contiguous(spec, arena_base)
    else:
        bases = np.zeros((L, K), dtype=np.uint64)
        pos = arena_base + gap
        for layer in range(L):
            if spec.storage in (Storage.PACKED, Storage.HEAD_PACKED):
                step = bb if spec.storage is Storage.PACKED else spec.block_size * spec.vector_bytes
                bases[layer] = [pos + kv * step for kv in range(K)]
                pos += n * K * bb + gap
            else:
                for kv in range(K):
                    bases[layer, kv] = pos
                    pos += n * bb + gap
        size = pos - arena_base
        geo = CacheGeometry(bases)
    return CacheView(spec, geo), Arena(size, arena_base)


def vector_addresses(view: CacheView, layer: int, kv: int, block_ids: np.ndarray) -> np.ndarray:
    """Addresses ``[tokens, heads_per_rank]`` (int64) of every head vector of the given blocks, token order.

    Raises LayoutError for a dim-major K (its vectors are not contiguous: use ``byte_addresses``).
    """
    s = view.spec
    if kv == 0 and s.k_dim_major:
        raise LayoutError("a dim-major K has no contiguous head vectors; use byte_addresses")
    blocks = np.asarray(block_ids, dtype=np.int64)
    t = np.arange(s.block_size, dtype=np.int64)[:, None]
    h = np.arange(s.heads_per_rank, dtype=np.int64)[None, :]
    off = t * s.token_stride + h * s.head_stride
    base = int(view.geometry.bases[layer, kv])
    addr = base + blocks[:, None, None] * s.block_stride + off[None] * s.vector_bytes
    return addr.reshape(-1, s.heads_per_rank)


def byte_addresses(view: CacheView, layer: int, kv: int, block_ids: np.ndarray) -> np.ndarray:
    """Addresses ``[tokens, heads_per_rank, vector_bytes]`` (int64) of every byte of every head
    vector of the given blocks, token order, element order inside a vector.

    Written from ``KVSpec``'s definition alone (not the translator's sub-vector arithmetic):
    element ``d`` of token ``t``, local head ``h`` sits at ``(t * token_stride + h * head_stride)
    * vector_bytes + d * itemsize`` in a token-major region, and, for a dim-major K of chunk c, at
    ``h * head_stride * vector_bytes + ((d // c) * block_size * c + t * c + d % c) * itemsize``.
    """
    s = view.spec
    blocks = np.asarray(block_ids, dtype=np.int64)
    t = np.arange(s.block_size, dtype=np.int64)[:, None, None]
    h = np.arange(s.heads_per_rank, dtype=np.int64)[None, :, None]
    d = np.arange(s.head_dim, dtype=np.int64)[None, None, :]
    if kv == 0 and s.k_dim_major:
        c = s.k_dim_chunk
        elem = h * s.head_stride * s.vector_bytes + ((d // c) * s.block_size * c + t * c + d % c) * s.itemsize
    else:
        elem = (t * s.token_stride + h * s.head_stride) * s.vector_bytes + d * s.itemsize
    byte = (elem[..., None] + np.arange(s.itemsize, dtype=np.int64)).reshape(s.block_size, s.heads_per_rank, -1)
    base = int(view.geometry.bases[layer, kv])
    addr = base + blocks[:, None, None, None] * s.block_stride + byte[None]
    return addr.reshape(-1, s.heads_per_rank, s.vector_bytes)


def fill_pattern(view: CacheView, arena: Arena, seed: int) -> None:
    """Fill the arena with random bytes, then head every cache vector with a distinct 32-bit code.

    Codes are ``seed * 2**24 + running index`` (little endian, the first ``min(4, vector_bytes)``
    bytes), so two caches filled with different seeds share no vector head.
    """
    s = view.spec
    rng = np.random.default_rng(seed)
    arena.buf[:] = rng.integers(0, 256, arena.buf.size, dtype=np.uint8)
    width = min(4, s.vector_bytes)
    all_blocks = np.arange(s.num_blocks)
    code = seed * (1 << 24)
    for layer in range(s.num_layers):
        for kv in range(s.kv_count):
            addr = byte_addresses(view, layer, kv, all_blocks).reshape(-1, s.vector_bytes)[:, :width] - arena.base
            codes = (np.arange(addr.shape[0], dtype=np.uint64) + np.uint64(code)).astype("<u4")
            arena.buf[addr] = codes.view(np.uint8).reshape(-1, 4)[:, :width]
            code += addr.shape[0]


def logical_kv(view: CacheView, arena: Arena, block_ids) -> np.ndarray:
    """The logical KV of ``block_ids`` (token order): uint8 ``[layers, kv, tokens, heads_per_rank, vector_bytes]``.

    Head axis ``i`` is global head ``view.spec.first_head + i``.
    """
    s = view.spec
    out = np.empty((s.num_layers, s.kv_count, len(block_ids) * s.block_size, s.heads_per_rank,
                    s.vector_bytes), dtype=np.uint8)
    for layer in range(s.num_layers):
        for kv in range(s.kv_count):
            out[layer, kv] = arena.buf[byte_addresses(view, layer, kv, np.asarray(block_ids)) - arena.base]
    return out


def target_mask(view: CacheView, arena: Arena, block_ids, heads: tuple[int, int]) -> np.ndarray:
    """Bool mask over ``arena.buf``: the bytes of ``heads`` of ``block_ids`` (what a plan may write)."""
    s = view.spec
    mask = np.zeros(arena.buf.size, dtype=bool)
    h = slice(heads[0] - s.first_head, heads[1] - s.first_head)
    for layer in range(s.num_layers):
        for kv in range(s.kv_count):
            mask[byte_addresses(view, layer, kv, np.asarray(block_ids))[:, h] - arena.base] = True
    return mask


def _copy_rows(dst: Arena, dst_rows: np.ndarray, src: Arena, src_rows: np.ndarray) -> None:
    """Reference copier: one slice assignment per descriptor row (tests only)."""
    if dst_rows.shape != src_rows.shape or not np.array_equal(dst_rows[:, 1], src_rows[:, 1]):
        raise LayoutError("descriptor tables differ in shape or per-row length")
    for (d, n, _), (s_, _, _) in zip(dst_rows.tolist(), src_rows.tolist()):
        dst.view(d, n)[:] = src.view(s_, n)


def execute(plan: TransferPlan, req: RequestPlan, local: Arena, remote: Arena,
            direction: Direction = Direction.READ) -> None:
    """Run ``req`` between two arenas: READ fills local from remote, WRITE the reverse.

    Staged READ: remote -> staging -> ``unpack_numpy`` into local. Staged WRITE: ``pack_numpy``
    from local -> staging -> remote (LayoutError unless ``plan.reversible``).
    """
    regions = region_views(plan.local, local)
    if plan.mode == "direct":
        if direction is Direction.READ:
            _copy_rows(local, req.local, remote, req.remote)
        else:
            _copy_rows(remote, req.remote, local, req.local)
        return
    staging = Arena(max(req.staging_bytes, 1), base=0)
    if direction is Direction.READ:
        _copy_rows(staging, req.local, remote, req.remote)
        req.unpack_numpy(staging.buf, regions)
        return
    if not plan.reversible:
        raise LayoutError("staged WRITE not supported: this plan over-reads remote blocks")
    req.pack_numpy(staging.buf, regions)
    _copy_rows(remote, req.remote, staging, req.local)


def fill_staging(req: RequestPlan, remote: Arena) -> np.ndarray:
    """The staging image a staged READ's descriptors produce (reference copier); uint8 array."""
    staging = Arena(max(req.staging_bytes, 1), base=0)
    _copy_rows(staging, req.local, remote, req.remote)
    return staging.buf[:req.staging_bytes]


def region_views(view: CacheView, arena: Arena):
    """``region_view(layer, kv)`` callable over an arena, as ``unpack_numpy`` takes it."""
    return lambda layer, kv: arena.view(int(view.geometry.bases[layer, kv]), view.spec.region_bytes)

# ---- several groups: state slots and hybrid caches -----------------------------------------

def state_byte_addresses(view, layer: int, tensor: int, slots) -> list[np.ndarray]:
    """Addresses of every byte of one state tensor's given slots, per segment: int64
    ``[slots, outer, local_units, unit_bytes]`` (``unit_bytes`` = width x inner x itemsize); an
    opaque tensor gives one ``[slots, 1, 1, slot_bytes]`` array.

    Written from ``StateSpec``'s definition alone: element ``(o, segment s, local unit u, w, i)``
    of a slot sits at ``((o * split + sum of earlier segments' local widths + u * width_s + w)
    * inner + i) * itemsize`` from the slot's start, slot ``k`` at ``bases[layer, tensor] + k *
    strides[tensor]``.
    """
    s = view.spec
    t = s.tensors[tensor]
    start = (int(view.geometry.bases[layer, tensor])
             + np.asarray(slots, dtype=np.int64)[:, None, None, None] * s.strides[tensor])
    isz = t.itemsize
    if t.segments is None:
        return [start + np.arange(t.slot_bytes(s.tp_size), dtype=np.int64)[None, None, None, :]]
    split = t.split_elements(s.tp_size)
    out, seg_off = [], 0
    for (units, width), (u0, u1) in zip(t.segments, t.local_units(s.tp_size, s.tp_rank)):
        o = np.arange(t.outer, dtype=np.int64)[:, None, None, None, None]
        u = np.arange(u1 - u0, dtype=np.int64)[None, :, None, None, None]
        w = np.arange(width, dtype=np.int64)[None, None, :, None, None]
        i = np.arange(t.inner, dtype=np.int64)[None, None, None, :, None]
        b = np.arange(isz, dtype=np.int64)[None, None, None, None, :]
        elem = ((o * split + seg_off + u * width + w) * t.inner + i) * isz + b
        out.append(start + elem.reshape(t.outer, u1 - u0, -1)[None])
        seg_off += (u1 - u0) * width
    return out


def read_state(view, arena: Arena, slots) -> list[list[np.ndarray]]:
    """The state of ``slots``: ``[tensor][segment]`` uint8 ``[layers, slots, outer, local_units, unit_bytes]``."""
    s = view.spec
    return [[np.stack([arena.buf[state_byte_addresses(view, layer, t, slots)[k] - arena.base]
                       for layer in range(s.num_layers)])
             for k in range(len(s.tensors[t].segments or (None,)))]
            for t in range(len(s.tensors))]


def write_state(view, arena: Arena, slots, values: list[list[np.ndarray]]) -> None:
    """Write ``values`` (``read_state``'s form, but GLOBAL units: ``[layers, slots, outer, units,
    unit_bytes]``; an opaque tensor: this rank's bytes) into ``slots``: each rank keeps its own units."""
    s = view.spec
    for t, tensor in enumerate(s.tensors):
        ranges = tensor.local_units(s.tp_size, s.tp_rank) if tensor.segments is not None else [(0, 1)]
        for layer in range(s.num_layers):
            for k, (u0, u1) in enumerate(ranges):
                addr = state_byte_addresses(view, layer, t, slots)[k]
                arena.buf[addr - arena.base] = values[t][k][layer][:, :, u0:u1]


def state_mask(view, arena: Arena, slots) -> np.ndarray:
    """Bool mask over ``arena.buf``: every byte of every tensor of ``slots``."""
    mask = np.zeros(arena.buf.size, dtype=bool)
    for layer in range(view.spec.num_layers):
        for t in range(len(view.spec.tensors)):
            for addr in state_byte_addresses(view, layer, t, slots):
                mask[addr - arena.base] = True
    return mask


def place_hybrid(spec, arena_base: int = 0x10_0000, gap: int = 0, share: bool = False):
    """Lay every group of a ``HybridSpec`` out in one fresh arena; returns its ``HybridView`` and the arena.

    Groups follow each other, ``gap`` bytes apart (attention groups placed as ``place_cache``
    places them). ``share``: an attention group whose spec equals an earlier one's uses that
    group's memory (vLLM lets groups of one shape share tensors; their block ids must differ).
    """
    from kvxfer.layout.groups import AttentionGroup, HybridView
    from kvxfer.layout.state import contiguous_state

    geos, pos, seen = [], arena_base, {}
    for g in spec.groups:
        if isinstance(g, AttentionGroup):
            if share and g.spec in seen:
                geos.append(seen[g.spec])
                continue
            view, arena = place_cache(g.spec, arena_base=pos, gap=gap)
            seen.setdefault(g.spec, view.geometry)
            geos.append(view.geometry)
            pos += arena.buf.size + gap
        else:
            geos.append(contiguous_state(g.spec, pos))
            pos += g.spec.cache_bytes + gap
    return HybridView(spec, tuple(geos)), Arena(pos - arena_base + 1, arena_base)


def execute_hybrid(plan, req, local: Arena, remote: Arena, direction: Direction = Direction.READ) -> None:
    """Run every part of a ``HybridRequest`` between two arenas holding the whole hybrid caches
    (``execute`` per attention part; state parts are byte ranges)."""
    for part_plan, part in zip(plan.parts, req.parts):
        if part is None:
            continue
        if isinstance(part_plan, (TransferPlan, SplitKVPlan)):
            execute(part_plan, part, local, remote, direction)
        elif direction is Direction.READ:
            _copy_rows(local, part.local, remote, part.remote)
        else:
            _copy_rows(remote, part.remote, local, part.local)
