"""Model-shaped caches for ``kvxfer bench``: allocation, seeded random content, the expected result (layer: bench app; torch lazily).

Caches are allocated exactly as ``KVSpec.tensor_shapes()`` (what an engine registers), on the
host or a GPU, filled with seeded random bytes (never zeros). A consumer regenerates each
producer's content from the same seed and computes, with plain tensor indexing (independent of
kvxfer's copy tables), what its cache must hold after a transfer; every timed transfer is
compared byte for byte against that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.layout.spec import CacheGeometry, KVSpec, Layout, Storage
from kvxfer.types import MemKind

__all__ = ["BenchCache", "make_cache", "fill_random", "element_view", "apply_expected"]

_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                 "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "uint8": "uint8", "int8": "int8"}


@dataclass
class BenchCache:
    """A cache's tensors (as registered), a flat uint8 view of each, and its geometry."""

    spec: KVSpec
    tensors: list[Any]
    geometry: CacheGeometry
    device: str

    def byte_views(self) -> list[Any]:
        return [t.view(-1).view(_torch().uint8) for t in self.tensors]


def _torch() -> Any:
    import torch  # noqa: PLC0415 - the bench needs torch; kvxfer's core does not

    return torch


def make_cache(spec: KVSpec, device: str) -> BenchCache:
    """Allocate ``spec``'s tensors on ``device`` ("cpu" or "cuda:N"); content is uninitialised."""
    torch = _torch()
    dtype = getattr(torch, _TORCH_DTYPES[spec.dtype])
    shapes = spec.tensor_shapes()
    tensors = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    offsets = CacheGeometry.contiguous(spec, 0).bases.astype(np.int64)
    bases = np.zeros(offsets.shape, dtype=np.uint64)
    if spec.storage is Storage.CROSS_LAYER:
        bases[...] = tensors[0].data_ptr() + offsets
    else:
        for layer, t in enumerate(tensors):
            bases[layer] = t.data_ptr() + (offsets[layer] - offsets[layer, 0])
    dev = torch.device(device)
    kind = MemKind.VRAM if dev.type == "cuda" else MemKind.DRAM
    geom = CacheGeometry(bases, dev.index or 0, kind)
    return BenchCache(spec, tensors, geom, device)


def fill_random(cache: BenchCache, seed: int) -> None:
    """Seeded random bytes in every tensor (identical for the same seed, spec and device kind)."""
    torch = _torch()
    gen = torch.Generator(device=cache.device)
    gen.manual_seed(seed)
    for view in cache.byte_views():
        view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, device=cache.device, generator=gen))


def element_view(cache: BenchCache) -> list[Any]:
    """Per layer, a ``[kv, blocks, tokens, heads, vector_bytes]`` uint8 view (NHD order of axes)."""
    spec = cache.spec
    out = []
    vb = spec.vector_bytes
    for layer in range(spec.num_layers):
        if spec.storage is Storage.HEAD_PACKED:  # [blocks, heads, kv, tokens, bytes]
            per = cache.byte_views()[layer].view(spec.num_blocks, spec.heads_per_rank, 2, spec.block_size, vb)
            out.append(per.permute(2, 0, 3, 1, 4))
            continue
        if spec.storage is Storage.CROSS_LAYER:
            flat = cache.byte_views()[0]
            per_block = flat.view(spec.num_blocks, spec.num_layers, spec.kv_count, -1)[:, layer]
            blocks = per_block.permute(1, 0, 2)  # [kv, blocks, block bytes]
        elif spec.storage is Storage.PACKED:
            blocks = cache.byte_views()[layer].view(spec.num_blocks, 2, -1).permute(1, 0, 2)
        else:
            blocks = cache.byte_views()[layer].view(spec.kv_count, spec.num_blocks, -1)
        if spec.layout is Layout.NHD:
            v = blocks.unflatten(2, (spec.block_size, spec.heads_per_rank, vb))
        else:
            v = blocks.unflatten(2, (spec.heads_per_rank, spec.block_size, vb)).transpose(2, 3)
        out.append(v)
    return out


def apply_expected(src: BenchCache, src_ids: np.ndarray, dst_views: list[Any], dst: KVSpec,
                   dst_ids: np.ndarray, tokens: int) -> None:
    """Write into ``dst_views`` (``element_view`` of the consumer's expected cache) the
    ``tokens`` tokens a transfer from ``src`` must deliver (heads both ranks hold)."""
    torch = _torch()
    s = src.spec
    lo, hi = max(s.first_head, dst.first_head), min(s.first_head + s.heads_per_rank,
                                                    dst.first_head + dst.heads_per_rank)
    s0, d0 = s.first_head, dst.first_head
    if s.mla:
        lo, hi, s0, d0 = 0, 1, 0, 0
    dev = src.tensors[0].device
    tok = torch.arange(tokens, device=dev)
    sb = torch.as_tensor(src_ids, device=dev)[tok // s.block_size]
    so = tok % s.block_size
    db = torch.as_tensor(dst_ids, device=dev)[tok // dst.block_size]
    do = tok % dst.block_size
    for sv, dv in zip(element_view(src), dst_views):
        # advanced indices [blocks, tokens] then heads slice -> [kv, tokens, heads, bytes]
        dv[:, db, do, lo - d0:hi - d0] = sv[:, sb, so, lo - s0:hi - s0]
