"""SGLang's KV pool and metadata rows in kvxfer's terms (pure: numpy, msgspec and kvxfer's public API;
no SGLang import, so the main test suite checks it without SGLang installed).

SGLang describes a rank's cache as flat buffers (``KVArgs.kv_data_ptrs``: every layer's K buffer,
then every layer's V buffer for MHA; one latent buffer per layer for MLA), each a row of pages
of ``kv_item_lens`` bytes, tokens outermost inside a page. kvxfer sees that as an NHD, split
``KVSpec`` whose element is a byte (``uint8``): the bytes of one token's head are its "head_dim",
so any dtype moves unchanged and both sides must name the same SGLang KV dtype (the ``model``
string carries it, so a mismatch is an ``IncompatiblePeerError`` at the handshake).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import msgspec

from kvxfer import KVSpec, LayoutError

__all__ = ["AnnouncePayload", "AuxRows", "CacheDescription", "decode_payload", "describe_cache",
           "encode_payload", "HostBuffer"]


@dataclass(frozen=True)
class CacheDescription:
    """What ``describe_cache`` found: the spec and, per layer, the K (and V) buffer addresses."""

    spec: KVSpec
    layers: list[tuple[int, ...]]   # per layer: (k_ptr, v_ptr) for MHA, (ptr,) for MLA
    layer_bytes: int


def describe_cache(*, kv_data_ptrs, kv_data_lens, kv_item_lens, page_size: int, kv_head_num: int | None,
                   total_kv_head_num: int | None, is_mla: bool, tp_rank: int, tp_size: int, kv_dtype: str,
                   model: str, num_draft_entries: int = 0) -> CacheDescription:
    """The ``KVSpec`` of one SGLang rank's KV pool.

    Raises:
        LayoutError: a pool kvxfer cannot describe (draft/speculative entries, buffers of unequal
            size, a page that does not split into heads), naming the values.
    """
    ptrs, lens, items = list(kv_data_ptrs), list(kv_data_lens), list(kv_item_lens)
    if num_draft_entries:
        raise LayoutError(f"SGLang KV pool with {num_draft_entries} draft (speculative) buffers: the kvxfer "
                          f"backend moves the target model's cache only")
    if not (len(ptrs) == len(lens) == len(items)) or not ptrs:
        raise LayoutError(f"SGLang KVArgs: expected as many kv_data_ptrs, kv_data_lens and kv_item_lens; got "
                          f"{len(ptrs)}, {len(lens)} and {len(items)}")
    if len(set(items)) != 1 or len(set(lens)) != 1:
        raise LayoutError(f"SGLang KV buffers of unequal shape: item lens {sorted(set(items))}, "
                          f"buffer lens {sorted(set(lens))} (hybrid or sliding-window pools are not supported)")
    item, length = items[0], lens[0]
    if length % item:
        raise LayoutError(f"SGLang KV buffer of {length} bytes is not a whole number of {item}-byte pages")
    # Each rank's heads are one opaque "head": SGLang fills kv_head_num on one role and not the
    # other (only its own heterogeneous-TP staging sets it on decode), and equal attention TP on
    # both sides, which this backend requires for MHA, needs no finer description.
    kv_head_num = total_kv_head_num = None
    heads = 1
    if page_size < 1 or heads < 1 or item % (page_size * heads):
        raise LayoutError(f"SGLang KV page of {item} bytes does not split into {page_size} tokens x {heads} heads")
    if is_mla:
        layers = [(p,) for p in ptrs]
    else:
        if len(ptrs) % 2:
            raise LayoutError(f"SGLang MHA KVArgs: expected K and V buffers per layer; got {len(ptrs)} buffers")
        half = len(ptrs) // 2
        layers = list(zip(ptrs[:half], ptrs[half:]))
    spec = KVSpec(num_layers=len(layers), num_kv_heads=1 if is_mla else tp_size,
                  head_dim=item // (page_size * heads), block_size=page_size, num_blocks=length // item,
                  dtype="uint8", layout="NHD", storage="split", mla=is_mla,
                  tp_rank=0 if is_mla else tp_rank, tp_size=1 if is_mla else tp_size,
                  model=f"sglang:{model}:{kv_dtype}")
    return CacheDescription(spec, layers, length)


class HostBuffer:
    """A host buffer at a raw address, seen through the array interface (what kvxfer registers)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(addr), False),
                                    "version": 3}


class DeviceBuffer:
    """A CUDA buffer at a raw address, seen through ``__cuda_array_interface__``."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(addr), False),
                                         "version": 3, "strides": None}


class AnnouncePayload(msgspec.Struct, frozen=True):
    """What a decode rank tells a prefill rank beside its pages (``Agent.announce``'s payload)."""

    required_dst_info_num: int
    is_dummy: bool = False
    aux_lens: list[int] = []


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(AnnouncePayload)
_ROWS = msgspec.msgpack.Decoder(list[bytes])


def encode_payload(payload: AnnouncePayload) -> bytes:
    return _ENC.encode(payload)


def decode_payload(data: bytes) -> AnnouncePayload:
    """Raises LayoutError (a malformed payload: names what was wrong)."""
    try:
        out = _DEC.decode(data)
    except msgspec.DecodeError as exc:
        raise LayoutError(f"malformed kvxfer SGLang announce payload: {exc}") from None
    if out.required_dst_info_num < 1:
        raise LayoutError(f"announce payload required_dst_info_num: expected >= 1; got {out.required_dst_info_num}")
    return out


class AuxRows:
    """One rank's metadata buffers (``KVArgs.aux_*``): read a request's row as bytes, write it back.

    Host memory (SGLang keeps these buffers on the CPU)."""

    def __init__(self, ptrs, data_lens, item_lens) -> None:
        self.ptrs, self.data_lens, self.item_lens = list(ptrs), list(data_lens), list(item_lens)

    def _check(self, index: int) -> None:
        for ptr, length, item in zip(self.ptrs, self.data_lens, self.item_lens):
            if index < 0 or (index + 1) * item > length:
                raise LayoutError(f"metadata row {index}: past the buffer ({length // item} rows)")

    def read(self, index: int) -> bytes:
        """Row ``index`` of every buffer, packed (msgpack list of bytes)."""
        self._check(index)
        return _ENC.encode([ctypes.string_at(p + index * n, n) for p, n in zip(self.ptrs, self.item_lens)])

    def write(self, index: int, packed: bytes) -> None:
        """Write a row ``read`` packed on the peer into row ``index`` here.

        Raises:
            LayoutError: malformed bytes, or buffers that differ from this rank's (names both).
        """
        try:
            rows = _ROWS.decode(packed)
        except msgspec.DecodeError as exc:
            raise LayoutError(f"malformed metadata row from the prefill: {exc}") from None
        got = [len(r) for r in rows]
        if got != self.item_lens:
            raise LayoutError(f"metadata buffers differ: prefill rows of {got} bytes, decode rows of "
                              f"{self.item_lens} bytes (the same optional metadata must be enabled on both)")
        self._check(index)
        for ptr, item, row in zip(self.ptrs, self.item_lens, rows):
            ctypes.memmove(ptr + index * item, row, item)
