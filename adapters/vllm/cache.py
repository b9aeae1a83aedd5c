"""Turn the KV-cache tensors vLLM hands a worker into a kvxfer ``KVSpec`` plus the tensors ``Agent.register`` takes.

vLLM gives one tensor per attention layer; their logical shape depends on the attention
backend and their memory order on the KV-cache layout (LBHNC, LBNHC, BLHNC, ...). This
module reads the strides to find where K/V, blocks, heads and tokens sit in memory, and
describes that with kvxfer's vocabulary (layout NHD/HND, storage split/packed/cross_layer/
head_packed, and a dim-major K where the CPU kernel keeps one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvxfer import KVSpec, LayoutError

#: vLLM CPU attention ISAs whose kernels keep each head's K block transposed (``[head_dim,
#: block_size]``, kvxfer ``k_dim_chunk=1``) and its V block token-major (vLLM 0.32's
#: ``cpu_attn_vec.hpp``; ``vec16`` inherits its ``reshape_and_cache``).
_TRANSPOSED_K_ISAS = frozenset({"vec", "vec16"})


@dataclass(frozen=True)
class CacheDescription:
    """A worker's cache in kvxfer's terms.

    ``head_slices_exact`` is False when the spec reproduces whole blocks byte for byte but
    not the position of single heads inside a block: transfers are then exact only with a
    peer of the same TP size and layout (the worker refuses the others). ``same_format_only``:
    whole heads are placed exactly but not every element inside one, so only a peer of the
    same layout, storage and block size (any TP size) is exact (the worker refuses the others).
    """

    spec: KVSpec
    tensors: list[torch.Tensor]
    head_slices_exact: bool = True
    same_format_only: bool = False  # only peers of the same layout, storage and block size are exact
    note: str = ""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flat(t: torch.Tensor, numel: int, offset_elems: int = 0) -> torch.Tensor:
    """A 1-D dense view of ``numel`` elements starting ``offset_elems`` after ``t``'s first element."""
    return t.as_strided((numel,), (1,), t.storage_offset() + offset_elems)


def cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    """The kernel vLLM's CPU attention picks for this cache (``vec``, ``vec16``, ``amx``, ``neon``,
    ...), asked of vLLM itself; None when this vLLM cannot say (not a CPU build, another version)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        return str(_get_attn_isa(dtype, block_size, head_size))
    except (ImportError, AttributeError, NotImplementedError, RuntimeError, TypeError):
        return None


def describe_cache(kv_caches: Sequence[torch.Tensor], *, num_blocks: int, block_size: int,
                   num_kv_heads: int, head_size: int, tp_rank: int, tp_size: int,
                   model: str, mla: bool = False, cpu_isa: str | None = None,
                   cpu_kernel: bool | None = None) -> CacheDescription:
    """Describe vLLM's per-layer KV tensors (in layer order).

    Args:
        num_kv_heads: KV heads of the whole model (kvxfer slices them by ``tp_size``).
        head_size: elements per head vector (the latent size for MLA).
        cpu_isa: for the CPU backend's cache, the attention kernel that writes it (its K order
            depends on it); None: ask vLLM (``cpu_attention_isa``).
        cpu_kernel: whether vLLM's CPU attention backend owns the cache (its kernels give the
            ``[blocks, heads, tokens, 2 * head_size]`` tensor their own inner order); None: the
            tensors' device says (CPU memory: yes). The GPU backends (FlashAttention, FlashInfer,
            Triton, FlexAttention) keep each token's K and V side by side in that tensor.

    Raises:
        LayoutError: a shape or memory order this adapter does not know (names both).
    """
    tensors = list(kv_caches)
    if not tensors:
        raise LayoutError("expected at least one KV-cache tensor; got none")
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise LayoutError("expected every layer's KV tensor to share one shape and dtype; got "
                          f"{sorted({(tuple(t.shape), str(t.dtype)) for t in tensors})}")
    common = dict(num_layers=len(tensors), num_kv_heads=1 if mla else num_kv_heads,
                  head_dim=head_size, block_size=block_size, num_blocks=num_blocks,
                  dtype=dtype_name(first.dtype), tp_rank=tp_rank, tp_size=tp_size, model=model)
    heads = 1 if mla else max(1, num_kv_heads // tp_size)
    shape = tuple(first.shape)
    if mla:
        return _mla(tensors, shape, common, heads)
    if shape == (num_blocks, heads, block_size, 2 * head_size):
        if cpu_kernel if cpu_kernel is not None else first.device.type == "cpu":
            isa = cpu_isa or cpu_attention_isa(first.dtype, block_size, head_size)
            return _cpu_interleaved(tensors, common, isa)
        return describe_fused(tensors, common)
    if len(shape) == 5:
        return _five_dim(tensors, shape, common, heads)
    raise LayoutError(f"unknown KV-cache tensor shape {shape} (blocks={num_blocks}, heads={heads}, "
                      f"block_size={block_size}, head_size={head_size})")


def _mla(tensors: list[torch.Tensor], shape: tuple[int, ...], common: dict[str, Any],
         heads: int) -> CacheDescription:
    """``[blocks, tokens, latent]`` per layer, or vLLM 0.32's ``[blocks, 1, tokens, latent]`` view:
    dense per layer (layer-outer layouts), or one row per block holding every layer (block-outer)."""
    n, bs, d, L = common["num_blocks"], common["block_size"], common["head_dim"], common["num_layers"]
    if shape == (n, 1, bs, d):
        tensors = [t[:, 0] for t in tensors]
    elif shape != (n, bs, d):
        raise LayoutError(f"expected an MLA cache [{n}, {bs}, {d}] or [{n}, 1, {bs}, {d}] per layer; got {shape}")
    st = tensors[0].stride()
    if st[1:] != (d, 1):
        raise LayoutError(f"expected each MLA block's tokens dense; got strides {st} for {tuple(tensors[0].shape)}")
    if st[0] == bs * d:
        spec = KVSpec(**common, mla=True, layout="NHD", storage="split")
        return CacheDescription(spec, [_flat(t, n * bs * d) for t in tensors])
    if st[0] == L * bs * d and _consecutive(tensors, bs * d):
        spec = KVSpec(**common, mla=True, layout="NHD", storage="cross_layer")
        return CacheDescription(spec, [_flat(tensors[0], n * L * bs * d)])
    raise LayoutError(f"unknown MLA block placement: block stride {st[0]} elements, expected {bs * d} "
                      f"(layer-outer) or {L * bs * d} (block-outer)")


def _consecutive(tensors: list[torch.Tensor], elems: int) -> bool:
    """Layer i's block 0 starts ``i * elems`` elements after layer 0's (one block row holds every layer)."""
    base, item = tensors[0].data_ptr(), tensors[0].element_size()
    return all(t.data_ptr() - base == i * elems * item for i, t in enumerate(tensors))


def describe_fused(tensors: list[torch.Tensor], common: dict[str, Any]) -> CacheDescription:
    """vLLM 0.32's GPU attention caches: per layer the logical ``[blocks, heads, tokens, 2 * head_size]``
    tensor of ``allocate_kv_cache``, each head vector holding the token's K then its V (FlashAttention,
    Triton and FlexAttention split the last axis; FlashInfer too, NVFP4 aside), in the memory order of
    the KV-cache layout (``VLLM_KV_CACHE_LAYOUT``).

    kvxfer describes that exactly as a fused cache (``KVSpec.kv_fused``: one region per layer of
    ``[K | V]`` vectors of ``2 * head_size``): ``LBHNC`` -> HND ``split``, ``LBNHC`` -> NHD ``split``,
    ``BLHNC``/``BLNHC`` (cross-layer blocks) -> ``cross_layer``. Every element is placed, so such a
    cache converts to and from any other fused cache: the other layout, TP size or block size.
    Layouts with heads outside blocks (``LHBNC``, ``BHLNC``) are refused.
    """
    t = tensors[0]
    n, h, bs, c = t.shape
    L = common["num_layers"]
    st = t.stride()
    vec = h * bs * c  # elements of one block of one layer
    if st[3] != 1:
        raise LayoutError(f"expected each head vector dense (stride 1); got strides {st}")
    if st[2] == c and st[1] == bs * c:
        layout = "HND"
    elif st[1] == c and st[2] == h * c:
        layout = "NHD"
    else:
        raise LayoutError(f"vLLM KV-cache layout with heads outside blocks (strides {st} for shape {tuple(t.shape)}; "
                          "LHBNC or BHLNC) is not supported; use LBHNC (the connector's default) or LBNHC")
    fused = {**common, "head_dim": c, "layout": layout, "kv_fused": True}
    if st[0] == vec:
        return CacheDescription(KVSpec(**fused, storage="split"), [_flat(x, n * vec) for x in tensors])
    if st[0] == L * vec and _consecutive(tensors, vec):
        return CacheDescription(KVSpec(**fused, storage="cross_layer"), [_flat(t, n * L * vec)])
    raise LayoutError(f"unknown block placement: block stride {st[0]} elements for blocks of {vec} "
                      f"elements and {L} layers")


def _cpu_interleaved(tensors: list[torch.Tensor], common: dict[str, Any], isa: str | None) -> CacheDescription:
    """vLLM's CPU backend: per layer ``[blocks, heads, tokens, 2*head_dim]``, in memory
    ``[blocks, heads, 2, <block_size x head_dim>]``: each head keeps its K block, then its V block.

    V is token-major. K's order is the kernel's (``isa``): ``vec``/``vec16`` keep it transposed,
    which kvxfer describes exactly (``k_dim_chunk=1``) and converts to any layout. Other kernels
    (``amx`` packs K in token groups of 16, and fp8 caches) have no KVSpec: whole heads still move
    exactly between two caches of one format, so only such peers are taken (``same_format_only``).
    """
    if not all(t.is_contiguous() for t in tensors):
        raise LayoutError("expected dense CPU KV-cache tensors; got a strided view")
    flat = [t.view(-1) for t in tensors]
    if isa in _TRANSPOSED_K_ISAS and tensors[0].element_size() > 1:
        return CacheDescription(KVSpec(**common, layout="HND", storage="head_packed", k_dim_chunk=1), flat)
    return CacheDescription(KVSpec(**common, layout="HND", storage="head_packed"), flat, same_format_only=True,
                            note=f"vLLM's CPU kernel {isa or '(unknown)'} keeps K in an order kvxfer cannot describe")


def _five_dim(tensors: list[torch.Tensor], shape: tuple[int, ...], common: dict[str, Any],
              heads: int) -> CacheDescription:
    """``(2, blocks, tokens, heads, dim)`` (flash-attn family) or ``(blocks, 2, tokens, heads, dim)``
    (flashinfer), in any memory order vLLM's KV-cache layouts give them."""
    n, bs, d, L = common["num_blocks"], common["block_size"], common["head_dim"], common["num_layers"]
    if shape == (2, n, bs, heads, d):
        kv, blk, tok, head = 0, 1, 2, 3
    elif shape == (n, 2, bs, heads, d):
        kv, blk, tok, head = 1, 0, 2, 3
    else:
        raise LayoutError(f"unknown 5-D KV-cache shape {shape}; expected (2, {n}, {bs}, {heads}, {d}) "
                          f"or ({n}, 2, {bs}, {heads}, {d})")
    t = tensors[0]
    st = t.stride()
    if st[4] != 1:
        raise LayoutError(f"expected head vectors dense (stride 1); got strides {st}")
    vec = heads * bs * d  # elements of one block of one region
    if st[head] == d and st[tok] == heads * d:
        layout = "NHD"
    elif st[tok] == d and st[head] == bs * d:
        layout = "HND"
    else:
        raise LayoutError(f"block interior is neither NHD nor HND dense; strides {st}")
    item = t.element_size()
    if st[kv] == n * st[blk] and st[blk] == vec:
        storage, per_layer = "split", 2 * n * vec
    elif st[blk] == 2 * vec and st[kv] == vec:
        storage, per_layer = "packed", 2 * n * vec
    elif st[kv] == vec and st[blk] == L * 2 * vec:
        bases = [x.data_ptr() for x in tensors]
        if any(b - bases[0] != i * 2 * vec * item for i, b in enumerate(bases)):
            raise LayoutError("cross-layer KV tensors are not consecutive layers of one block row")
        spec = KVSpec(**common, layout=layout, storage="cross_layer")
        return CacheDescription(spec, [_flat(t, n * L * 2 * vec)])
    else:
        raise LayoutError(f"unknown K/V and block placement: strides {st} for shape {shape}")
    spec = KVSpec(**common, layout=layout, storage=storage)
    return CacheDescription(spec, [_flat(x, per_layer) for x in tensors])
