"""KVSpec and CacheGeometry: what a KV cache looks like (layer: layout, pure; numpy only, no nixl/zmq/torch).

A cache is ``num_layers`` x ``kv_count`` *regions* (K and V per layer; K only for MLA).
Each region is ``num_blocks`` blocks, ``block_stride`` bytes apart. One block of one
region holds ``heads_per_rank x block_size`` vectors of ``head_dim`` elements, ordered

* ``NHD``: token-major, ``[block_size, heads, head_dim]`` (vLLM's LBNHC / BLNHC);
* ``HND``: head-major,  ``[heads, block_size, head_dim]`` (vLLM's LBHNC / BLHNC).

How regions sit in memory is the ``storage``:

* ``split``   each layer is one tensor ``[2, num_blocks, <block>]`` (K half, then V half)
              or two tensors (K, V); ``block_stride`` = one K (or V) block;
* ``packed``  each layer is one tensor ``[num_blocks, 2, <block>]``: a block holds K then V;
* ``cross_layer`` one tensor ``[num_blocks, num_layers, 2, <block>]``: one contiguous row
              per block holding every layer (vLLM's cross-layer blocks);
* ``head_packed`` (HND only) each layer is one tensor ``[num_blocks, heads, 2, block_size, head_dim]``:
              inside a block every head holds its K rows, then its V rows (vLLM's CPU backend).

Inside one head's block (HND only), K may be *dim-major* (``k_dim_chunk`` = c > 0): its
``block_size x head_dim`` elements sit as ``[head_dim // c, block_size, c]``, chunks of ``c``
elements of one token, chunk by chunk (c = 1: K transposed, as vLLM's CPU ``vec``/``vec16``
kernels keep it; c = 16 bytes / itemsize: the classic paged-attention K). V stays token-major.
A head's K block covers the same bytes either way; only the order inside it differs.

A *fused* cache (``kv_fused``) keeps one token's K and V of one head side by side in one vector,
``[K | V]`` (vLLM 0.32's GPU attention caches, ``[blocks, heads, tokens, 2 * head_size]``): it has
one region per layer, as MLA does, but real heads sliced by TP; ``head_dim`` is then the fused
vector's size (twice the model's head size). Only fused caches pair with fused caches.

``CacheGeometry`` adds the addresses: the base of block 0 of every region.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.types import MemKind

__all__ = ["CacheGeometry", "KVSpec", "Layout", "Storage", "DTYPE_SIZES"]

#: Element sizes of the dtypes kvxfer knows (fp8 variants are 1 byte).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class Layout(str, enum.Enum):
    """Order of heads and tokens inside one block of one region."""

    NHD = "NHD"
    HND = "HND"


class Storage(str, enum.Enum):
    """How the regions of a cache sit in memory (see the module docstring)."""

    SPLIT = "split"
    PACKED = "packed"
    CROSS_LAYER = "cross_layer"
    HEAD_PACKED = "head_packed"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{name} must be a positive integer; got {value!r}")


@dataclass(frozen=True)
class KVSpec:
    """The shape of one tensor-parallel rank's KV cache.

    Args:
        num_layers: attention layers in the cache.
        num_kv_heads: KV heads of the *model* (all ranks together), 1 for MLA.
        head_dim: elements per head vector (the latent size for MLA).
        block_size: tokens per block.
        num_blocks: blocks in this rank's cache.
        dtype: element type name, one of ``DTYPE_SIZES``.
        layout: ``NHD`` or ``HND`` inside a block.
        storage: ``split``, ``packed`` or ``cross_layer``.
        mla: the cache is a replicated latent cache: K only, identical on every rank.
        k_dim_chunk: 0 (default): K token-major like V. c > 0: K dim-major in chunks of c
            elements (see the module docstring); needs layout HND, no MLA, c dividing head_dim.
            c == head_dim is token-major and is stored as 0.
        kv_fused: each head vector is one token's K then its V (``head_dim`` = 2 x the model's
            head size, even): one region per layer, heads sliced by TP as usual; storage
            ``split`` (one ``[blocks, <block>]`` tensor per layer) or ``cross_layer``; no MLA,
            no dim-major K.
        tp_rank, tp_size: this rank's place in tensor parallelism.
        model: model identity, compared with the peer's before anything else.

    Raises:
        LayoutError: on any inconsistent value (names the value and what was expected).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "bfloat16"
    layout: Layout = Layout.NHD
    storage: Storage = Storage.SPLIT
    mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    model: str = ""
    k_dim_chunk: int = 0
    kv_fused: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "tp_size", "tp_rank",
                     "k_dim_chunk"):
            value = getattr(self, name)
            if isinstance(value, np.integer):  # numpy ints (e.g. from an id array) count as ints
                object.__setattr__(self, name, int(value))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "tp_size"):
            _positive(name, getattr(self, name))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"dtype must be one of {sorted(DTYPE_SIZES)}; got {self.dtype!r}")
        try:
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError:
            raise LayoutError(f"layout must be 'NHD' or 'HND'; got {self.layout!r}") from None
        try:
            object.__setattr__(self, "storage", Storage(self.storage))
        except ValueError:
            raise LayoutError(
                f"storage must be one of {[s.value for s in Storage]}; got {self.storage!r}"
            ) from None
        if not isinstance(self.model, str):
            raise LayoutError(f"model must be a str (the model's name, or empty); got {self.model!r}")
        if not isinstance(self.mla, (bool, np.bool_)):
            raise LayoutError(f"mla must be True or False; got {self.mla!r}")
        object.__setattr__(self, "mla", bool(self.mla))
        if not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) or not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank must be in [0, {self.tp_size}); got {self.tp_rank!r}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutError(f"an MLA cache has num_kv_heads=1; got {self.num_kv_heads}")
        if self.mla and self.storage in (Storage.PACKED, Storage.HEAD_PACKED):
            raise LayoutError(f"an MLA cache has no V; storage {self.storage.value!r} does not apply")
        if self.storage is Storage.HEAD_PACKED and self.layout is not Layout.HND:
            raise LayoutError(f"storage 'head_packed' is head-major: layout must be 'HND'; got {self.layout.value!r}")
        self._check_k_dim_chunk()
        self._check_kv_fused()
        h, tp = self.num_kv_heads, self.tp_size
        if not self.mla and h % tp and tp % h:
            raise LayoutError(
                f"num_kv_heads ({h}) and tp_size ({tp}) must divide one another"
            )

    def _check_k_dim_chunk(self) -> None:
        c = self.k_dim_chunk
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise LayoutError(f"k_dim_chunk must be a non-negative integer (0: K token-major); got {c!r}")
        if c == self.head_dim:  # [1, block_size, head_dim] is the token-major order itself
            object.__setattr__(self, "k_dim_chunk", 0)
            return
        if c == 0:
            return
        if self.head_dim % c:
            raise LayoutError(f"k_dim_chunk ({c}) must divide head_dim ({self.head_dim})")
        if self.mla:
            raise LayoutError(f"an MLA cache is token-major: k_dim_chunk must be 0; got {c}")
        if self.layout is not Layout.HND:
            raise LayoutError(f"a dim-major K (k_dim_chunk={c}) keeps each head's block whole: layout must be "
                              f"'HND'; got {self.layout.value!r}")

    def _check_kv_fused(self) -> None:
        if not isinstance(self.kv_fused, (bool, np.bool_)):
            raise LayoutError(f"kv_fused must be True or False; got {self.kv_fused!r}")
        object.__setattr__(self, "kv_fused", bool(self.kv_fused))
        if not self.kv_fused:
            return
        if self.mla:
            raise LayoutError("a fused cache (K and V in one vector) has a V: mla must be False")
        if self.storage not in (Storage.SPLIT, Storage.CROSS_LAYER):
            raise LayoutError(f"a fused cache has one region per layer: storage must be 'split' or 'cross_layer'; "
                              f"got {self.storage.value!r}")
        if self.k_dim_chunk:
            raise LayoutError(f"a fused cache keeps K token-major: k_dim_chunk must be 0; got {self.k_dim_chunk}")
        if self.head_dim % 2:
            raise LayoutError(f"a fused cache's head_dim is K's and V's sizes together: it must be even; "
                              f"got {self.head_dim}")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def k_dim_major(self) -> bool:
        """K is stored dim-major inside a head's block (``k_dim_chunk`` > 0)."""
        return self.k_dim_chunk > 0

    def grain(self, kv: int) -> int:
        """Elements of one token's head vector that lie contiguous in region ``kv`` (0 K, 1 V):
        ``head_dim``, or ``k_dim_chunk`` for a dim-major K."""
        return self.k_dim_chunk if kv == 0 and self.k_dim_chunk else self.head_dim

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_count(self) -> int:
        """Regions per layer: 2 (K, V), or 1 for MLA and fused caches."""
        return 1 if self.mla or self.kv_fused else 2

    @property
    def heads_per_rank(self) -> int:
        """Heads stored on each rank (1 when heads are replicated: tp_size > num_kv_heads, or MLA)."""
        if self.mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replication(self) -> int:
        """How many ranks hold each head (1 unless tp_size > num_kv_heads; tp_size for MLA)."""
        if self.mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def first_head(self) -> int:
        """Global index of the first head this rank stores."""
        if self.mla:
            return 0
        return (self.tp_rank // self.replication) * self.heads_per_rank

    @property
    def vector_bytes(self) -> int:
        """Bytes of one head vector of one token."""
        return self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one region (K or V of one layer)."""
        return self.heads_per_rank * self.block_size * self.vector_bytes

    @property
    def block_stride(self) -> int:
        """Bytes between block i and block i+1 of the same region."""
        if self.storage is Storage.SPLIT:
            return self.block_bytes
        if self.storage in (Storage.PACKED, Storage.HEAD_PACKED):
            return self.kv_count * self.block_bytes
        return self.num_layers * self.kv_count * self.block_bytes

    @property
    def token_stride(self) -> int:
        """Vectors between token t and t+1 of one head inside a block."""
        return self.heads_per_rank if self.layout is Layout.NHD else 1

    @property
    def head_stride(self) -> int:
        """Vectors between head h and h+1 of one token inside a block."""
        if self.layout is Layout.NHD:
            return 1
        return self.block_size * (self.kv_count if self.storage is Storage.HEAD_PACKED else 1)

    @property
    def block_span(self) -> int:
        """Bytes from a region's block start to the end of its last vector in that block
        (``block_bytes`` unless heads of K and V interleave, as in ``head_packed``)."""
        last = (self.heads_per_rank - 1) * self.head_stride + (self.block_size - 1) * self.token_stride
        return (last + 1) * self.vector_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes one region spans, from its block 0 to the end of its last vector."""
        return (self.num_blocks - 1) * self.block_stride + self.block_span

    @property
    def cache_bytes(self) -> int:
        """Bytes of the whole cache of this rank."""
        return self.num_layers * self.kv_count * self.num_blocks * self.block_bytes

    def with_rank(self, tp_rank: int) -> "KVSpec":
        """The same spec for another rank of the same instance."""
        return replace(self, tp_rank=tp_rank)

    def tensor_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the tensors ``Agent.register`` expects for this spec (element units).

        split: one ``[2, blocks, <block>]`` per layer (or ``[blocks, <block>]`` for MLA and fused);
        packed: one ``[blocks, 2, <block>]`` per layer; cross_layer: one
        ``[blocks, layers, kv, <block>]``.
        """
        inner = (
            (self.block_size, self.heads_per_rank, self.head_dim)
            if self.layout is Layout.NHD
            else (self.heads_per_rank, self.block_size, self.head_dim)
        )
        n = self.num_blocks
        if self.storage is Storage.CROSS_LAYER:
            return [(n, self.num_layers, self.kv_count, *inner)]
        if self.storage is Storage.PACKED:
            return [(n, 2, *inner)] * self.num_layers
        if self.storage is Storage.HEAD_PACKED:
            return [(n, self.heads_per_rank, 2, self.block_size, self.head_dim)] * self.num_layers
        if self.kv_count == 1:
            return [(n, *inner)] * self.num_layers
        return [(2, n, *inner)] * self.num_layers


@dataclass(frozen=True)
class CacheGeometry:
    """Where a rank's cache lives: ``bases[layer, kv]`` is the address of block 0 of that region.

    Addresses are the owning process's; a peer's geometry arrives in the handshake.
    """

    bases: np.ndarray = field(repr=False)  # uint64 [num_layers, kv_count]
    device: int = 0
    kind: MemKind = MemKind.DRAM

    def __post_init__(self) -> None:
        b = np.asarray(self.bases, dtype=np.uint64)
        if b.ndim != 2:
            raise LayoutError(f"bases must be 2-D [layers, kv]; got shape {b.shape}")
        b.setflags(write=False)
        object.__setattr__(self, "bases", b)

    def check(self, spec: KVSpec) -> None:
        """Raise LayoutError unless these bases fit ``spec``."""
        want = (spec.num_layers, spec.kv_count)
        if self.bases.shape != want:
            raise LayoutError(f"geometry has {self.bases.shape} regions; spec expects {want}")

    @classmethod
    def contiguous(cls, spec: KVSpec, base: int, device: int = 0,
                   kind: MemKind = MemKind.DRAM) -> "CacheGeometry":
        """Geometry of a cache laid out exactly as ``spec.tensor_shapes()`` in one allocation at ``base``."""
        L, K, bb = spec.num_layers, spec.kv_count, spec.block_bytes
        layer = np.arange(L, dtype=np.uint64)[:, None]
        kv = np.arange(K, dtype=np.uint64)[None, :]
        if spec.storage is Storage.CROSS_LAYER:
            off = (layer * K + kv) * bb
        elif spec.storage is Storage.PACKED:
            off = layer * (spec.num_blocks * K * bb) + kv * bb
        elif spec.storage is Storage.HEAD_PACKED:
            off = layer * (spec.num_blocks * K * bb) + kv * (spec.block_size * spec.vector_bytes)
        else:
            off = layer * (K * spec.num_blocks * bb) + kv * (spec.num_blocks * bb)
        return cls(np.uint64(base) + off.astype(np.uint64), device, kind)


def gcd_block(a: KVSpec, b: KVSpec) -> int:
    """Tokens in the largest unit that is whole in both block sizes."""
    return math.gcd(a.block_size, b.block_size)
