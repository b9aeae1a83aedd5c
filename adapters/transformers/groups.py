"""A hybrid model's layer groups in the pool's terms (layer: adapter; kvxfer's public API only, no torch or transformers).

A transformers config names each decoder layer's kind (``layer_types``). Layers of one kind
form one group, as vLLM's hybrid KV-cache manager forms them for models with as many layers of
each kind (groups in the order their kind first appears, named ``<kind><index>``, e.g. Gemma 3:
``sliding0``, ``full1``), so a kvxfer-hf pool and a vLLM instance list the same groups. Here:
which groups a model has, which ids of a request each group holds and answers (a sliding
group its window's blocks plus one, as vLLM's prefill answers), and the per-group lists a
decode reads. A model of one kind of layer has no groups here (``layer_groups`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvxfer import LayoutError

#: transformers ``layer_types`` -> the group kind kvxfer moves (``linear_attention``: transformers'
#: name for SSM / linear-attention layers, whose cache is a per-request conv and recurrent state).
KINDS = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "state"}


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind: their indices in the model, the kind (``full``, ``sliding`` or
    ``state``) and the window in tokens (0: not sliding). ``index`` is the group's position (it
    enters the name)."""

    index: int
    kind: str
    layers: tuple[int, ...]
    sliding_window: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"

    def kept_blocks(self, block_size: int) -> int:
        """Blocks a sliding group keeps at the end of a request's list (0: all): its window's
        blocks plus one, for a window that does not start on a block boundary."""
        return -(-self.sliding_window // block_size) + 1 if self.sliding_window else 0


def layer_groups(layer_types: Sequence[str] | None, sliding_window: int | None) -> tuple[LayerGroup, ...] | None:
    """The groups of a model whose layers are ``layer_types``; None for one kind of layer.

    Raises:
        LayoutError: a layer kind the pool cannot hold (names the layer and its kind), no
            full-attention layer, or sliding layers without a positive ``sliding_window``.
    """
    types = list(layer_types or ())
    order: list[str] = []
    for i, t in enumerate(types):
        if t not in KINDS:
            raise LayoutError(f"layer {i} is {t!r}: kvxfer-hf holds {sorted(KINDS)} layers")
        if t not in order:
            order.append(t)
    if "full_attention" not in order and types:
        raise LayoutError(f"kvxfer-hf needs a full_attention layer (a decode's extent is taken from one); this "
                          f"model's layers are all {order}")
    if len(order) <= 1:
        return None
    if "sliding_attention" in order and not (isinstance(sliding_window, int) and sliding_window > 0):
        raise LayoutError(f"sliding_attention layers need a positive sliding_window; got {sliding_window!r}")
    return tuple(LayerGroup(g, KINDS[t], tuple(i for i, x in enumerate(types) if x == t),
                            int(sliding_window) if t == "sliding_attention" else 0) for g, t in enumerate(order))


def answer_ids(groups: Sequence[LayerGroup], blocks: Sequence[int], block_size: int,
               slot: int | None = None) -> list[list[int]]:
    """A prefilled request's ids per group (what it holds and answers): every attention group
    keeps the request's ``blocks`` (one block table for all groups), a sliding group only their
    tail; a state group its ``slot``."""
    out = []
    for g in groups:
        if g.kind == "state":
            out.append([_slot(slot, g)])
            continue
        n = g.kept_blocks(block_size)
        out.append(list(blocks[-n:]) if n else list(blocks))
    return out


def _slot(slot: int | None, g: LayerGroup) -> int:
    if slot is None:
        raise LayoutError(f"group {g.name} is a state group: a request needs a state slot")
    return slot


def read_ids(groups: Sequence[LayerGroup], remote: Sequence[Sequence[int]], remote_tokens: int,
             landing: Sequence[int], tokens: int, block_size: int,
             slot: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(local, remote) lists per group that read the first ``tokens`` tokens into ``landing``
    (``ceil(tokens / block_size)`` blocks), blocks of ``block_size`` on both sides.

    Full groups: the producer's first ``len(landing)`` blocks. Sliding groups: the producer's
    kept tail (whose last block holds token ``remote_tokens - 1``) cut to end at the block of
    token ``tokens - 1``, against all of ``landing``; kvxfer then moves the window only. State
    groups: the producer's slot list into ``[slot]``.
    """
    local, theirs = [], []
    for g, ids in zip(groups, remote):
        ids = list(ids)
        if g.kind == "state":
            local.append([_slot(slot, g)])
            theirs.append(ids)
            continue
        if g.kind == "full":
            theirs.append(ids[:len(landing)])
        else:
            drop = (max(remote_tokens, 1) - 1) // block_size - (tokens - 1) // block_size
            theirs.append(ids[:len(ids) - drop] if drop > 0 else ids)
        local.append(list(landing))
    return local, theirs
