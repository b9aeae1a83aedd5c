"""A vLLM Mamba (``MambaSpec``) group's state pages as a kvxfer ``StateGroup`` (layer: vLLM adapter; torch and kvxfer's public API only, never vllm).

vLLM keeps a Mamba layer's state in pages of its block pool: block ``b`` of the layer is one
page of ``page_bytes`` (padded to the attention groups' page size, since every group shares one
pool), holding that layer's state tensors one after the other (Mamba2: the conv state, then the
SSM state). vLLM 0.32's CPU worker hands the connector one byte view per layer,
``[num_blocks, 1, 1, state bytes]``, whose block stride is the page; one view per state tensor,
``[num_blocks, *shape]`` at its offset in the page, is taken too. Such a group is a
``StateSpec`` with one slot per block and ``slot_stride`` the page; kvxfer registers each
layer's pages as one byte array (the memory is the attention layers' too: kvxfer registers it
once). The tensors are described opaque: they move whole, slot to slot, between instances of one
TP size (the connector refuses the others). Only a page's state bytes move, never its padding.
Each tensor's name carries its shape (``state_name``), the one thing an opaque description
would not compare.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvxfer import LayoutError, StateSpec, StateTensor

from kvxfer_vllm.cache import dtype_name

#: names of a layer's state tensors, in page order, by their count (Mamba2 / GDN: conv then SSM)
_NAMES = {1: ("ssm",), 2: ("conv", "ssm")}


def state_name(kind: str, shape: Sequence[int]) -> str:
    """A state tensor's name on the wire: its kind and its per-block shape, e.g. ``conv[3,160]``
    (kvxfer-hf names its slots' tensors the same way): two instances pair a state group only
    where their shapes are equal, so a conv state kept transposed (``VLLM_SSM_CONV_STATE_LAYOUT``
    ``SD`` against ``DS``, as many bytes) is refused typed, naming both, instead of moved."""
    return f"{kind}[{','.join(str(int(d)) for d in shape)}]"


def _views(name: str, entry: Any, info: Any, sizes: list[int], num_blocks: int) -> list[torch.Tensor]:
    """One view per state tensor, ``[num_blocks, *shape]`` at its offset in the page."""
    count = len(info.shapes)
    views = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if isinstance(entry, torch.Tensor) and (count > 1 or entry.dtype != info.dtypes[0]
                                            or tuple(entry.shape[1:]) != tuple(info.shapes[0])):
        views = _split_page(name, entry, info, sizes, num_blocks)   # one byte view of the page
    if len(views) != count or not all(isinstance(v, torch.Tensor) for v in views):
        raise LayoutError(f"state layer {name}: expected {count} state tensors (vLLM's MambaSpec shapes); got "
                          f"{[tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in views]}")
    return views


def _split_page(name: str, page: torch.Tensor, info: Any, sizes: list[int], num_blocks: int) -> list[torch.Tensor]:
    """A layer's byte view ``[num_blocks, ..., state bytes]`` cut into one view per state tensor."""
    content = page[0].numel() * page.element_size() if page.dim() and page.shape[0] else 0
    if page.dim() < 2 or page.shape[0] != num_blocks or content != sum(sizes) or not page[0].is_contiguous():
        raise LayoutError(f"state layer {name}: expected a view [{num_blocks}, ..., {sum(sizes)} bytes] (one dense "
                          f"page of {list(zip(info.shapes, map(str, info.dtypes)))} per block); got "
                          f"{page.dtype} {list(page.shape)} strides {page.stride()}")
    stride = page.stride(0) * page.element_size()
    out, offset = [], 0
    base = page.data_ptr() - page.untyped_storage().data_ptr()
    for shape, dtype, size in zip(info.shapes, info.dtypes, sizes):
        item = torch.empty((), dtype=dtype).element_size()
        if stride % item or (base + offset) % item:
            raise LayoutError(f"state layer {name}: a {dtype} state at byte {base + offset} of pages of {stride} "
                              f"bytes is not aligned to its {item}-byte elements")
        dense = [1] * len(shape)
        for k in range(len(shape) - 2, -1, -1):
            dense[k] = dense[k + 1] * shape[k + 1]
        view = torch.empty(0, dtype=dtype, device=page.device)
        view.set_(page.untyped_storage(), (base + offset) // item, (num_blocks, *shape), (stride // item, *dense))
        out.append(view)
        offset += size
    return out


def describe_state(group: Any, entries: Sequence[Any], *, num_blocks: int, tp_rank: int, tp_size: int,
                   model: str) -> tuple[StateSpec, list[torch.Tensor]]:
    """The ``StateSpec`` of a Mamba group (``GroupInfo`` with ``state``) and, per layer, the byte
    array of its ``num_blocks`` pages (what ``Agent.register`` takes for a paged state group).

    Raises:
        LayoutError: a layer's views that do not match the group's shapes and dtypes, that do
            not sit in one page per block in page order, or whose pages run past their memory
            (names the layer and both values).
    """
    info = group.state
    count = len(info.shapes)
    names = [state_name(n, s) for n, s in zip(_NAMES.get(count, tuple(f"state{i}" for i in range(count))),
                                                info.shapes)]
    sizes = [int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
             for s, d in zip(info.shapes, info.dtypes)]
    pages: list[torch.Tensor] = []
    stride = 0
    for layer, entry in zip(group.layer_names, entries):
        views = _views(layer, entry, info, sizes, num_blocks)
        first = views[0]
        stride = first.stride(0) * first.element_size()
        offset = 0
        for i, (v, shape, dtype, size) in enumerate(zip(views, info.shapes, info.dtypes, sizes)):
            if tuple(v.shape[1:]) != tuple(shape) or v.dtype != dtype or v.shape[0] != num_blocks:
                raise LayoutError(f"state layer {layer} tensor {names[i]!r}: expected {dtype} "
                                  f"[{num_blocks}, {', '.join(map(str, shape))}]; got {v.dtype} {list(v.shape)}")
            if v.stride(0) * v.element_size() != stride or v.data_ptr() - first.data_ptr() != offset:
                raise LayoutError(f"state layer {layer} tensor {names[i]!r}: expected page stride {stride} bytes "
                                  f"at offset {offset} in the page; got stride {v.stride(0) * v.element_size()} "
                                  f"at offset {v.data_ptr() - first.data_ptr()}")
            if not v[0].is_contiguous():
                raise LayoutError(f"state layer {layer} tensor {names[i]!r}: one block's state is not dense "
                                  f"(strides {v.stride()})")
            offset += size
        if stride < offset:
            raise LayoutError(f"state layer {layer}: pages of {stride} bytes cannot hold its state of {offset} bytes")
        storage = first.untyped_storage()
        start = first.data_ptr() - storage.data_ptr()
        if start < 0 or start + num_blocks * stride > storage.nbytes():
            raise LayoutError(f"state layer {layer}: {num_blocks} pages of {stride} bytes from byte {start} run past "
                              f"its memory of {storage.nbytes()} bytes")
        page = torch.empty(0, dtype=torch.uint8, device=first.device)
        page.set_(storage, start, (num_blocks * stride,), (1,))
        pages.append(page)
    tensors = tuple(StateTensor.opaque(n, dtype_name(d), int(torch.Size(s).numel()))
                    for n, s, d in zip(names, info.shapes, info.dtypes))
    spec = StateSpec(num_layers=len(pages), tensors=tensors, num_slots=num_blocks, slot_stride=stride,
                     tp_rank=tp_rank, tp_size=tp_size, model=model)
    return spec, pages
