"""A hybrid cache as the agent's one-spec machinery sees it (layer: layout, pure; numpy only, no nixl/zmq/torch).

The agent holds, claims, checks and quarantines *block ids of one cache*. A hybrid cache
(``HybridSpec``: several groups, each with its own id space) is given to that machinery as one
id space, the *flat ids*: id ``i`` of group ``g`` of a ``G``-group cache is ``i * G + g``. One
hold, one claim and one post per producer rank then cover every group of a request, and a
partial transfer cannot happen: the request's descriptors are built for all groups before
anything moves (``HybridPlan.for_request`` raises first).

* ``HybridCarrier``: a ``KVSpec`` (one latent byte per flat id, so id checks, TP rank and port
  rules work as for any spec) that carries the ``HybridSpec``; the TP rules of ``kvxfer.layout.tp``
  use the hybrid's own rules for it (union over groups).
* ``HybridGeometry``: a ``CacheGeometry`` that carries the ``HybridView`` (every group's bases).
* ``flat_ids``: one id list per group -> flat ids, a sliding group's lists cut to its window.
* ``FlatHybridPlan``: ``build_hybrid_plan`` behind ``TransferPlan``'s ``for_request`` (flat ids
  in, one ``RequestPlan`` of every group's rows out, always direct).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.layout.groups import AttentionGroup, HybridSpec, HybridView
from kvxfer.layout.request import RequestPlan
from kvxfer.layout.spec import CacheGeometry, KVSpec

__all__ = ["FlatHybridPlan", "HybridCarrier", "HybridGeometry", "build_flat_plan", "carrier_for", "flat_ids",
           "hybrid_of", "split_flat"]


@dataclass(frozen=True)
class HybridCarrier(KVSpec):
    """The flat-id ``KVSpec`` of a hybrid cache (see the module doc); ``hybrid`` is the real spec,
    kept at this spec's ``tp_rank`` (``replace``/``with_rank`` move both)."""

    hybrid: HybridSpec | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.hybrid
        if not isinstance(h, HybridSpec):
            raise LayoutError(f"HybridCarrier.hybrid must be a HybridSpec; got {type(h).__name__}")
        if h.tp_rank != self.tp_rank:
            object.__setattr__(self, "hybrid", h.with_rank(self.tp_rank))

    def with_rank(self, tp_rank: int) -> "HybridCarrier":
        return replace(self, tp_rank=tp_rank)


@dataclass(frozen=True)
class HybridGeometry(CacheGeometry):
    """A carrier's geometry: ``bases`` one address (the first group's), ``view`` every group's."""

    view: HybridView | None = field(default=None, repr=False, compare=False)


def _group_sizes(spec: HybridSpec) -> list[int]:
    return [g.spec.num_blocks if isinstance(g, AttentionGroup) else g.spec.num_slots for g in spec.groups]


def _fingerprint(spec: HybridSpec) -> str:
    """What two hybrid caches must share to meet at all: the model names of the groups. The
    groups themselves are compared group by group when a pair is planned (errors name them)."""
    models = sorted({g.spec.model for g in spec.groups})
    return hashlib.sha256("\0".join(models).encode()).hexdigest()[:16]


def carrier_for(spec: HybridSpec) -> HybridCarrier:
    """The flat-id spec of ``spec`` (``num_blocks``: groups x the largest group's ids)."""
    if not isinstance(spec, HybridSpec):
        raise LayoutError(f"expected a HybridSpec; got {type(spec).__name__}")
    n = len(spec.groups)
    model = spec.groups[0].spec.model
    return HybridCarrier(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1,
                         num_blocks=n * max(_group_sizes(spec)), dtype="uint8", mla=True,
                         tp_rank=spec.tp_rank, tp_size=spec.tp_size,
                         model=f"{model}#hybrid-{_fingerprint(spec)}", hybrid=spec)


def hybrid_of(spec) -> HybridSpec | None:
    """The ``HybridSpec`` a spec carries (None: a one-group ``KVSpec``)."""
    return getattr(spec, "hybrid", None)


def carrier_geometry(view: HybridView) -> HybridGeometry:
    """The carrier's geometry over ``view`` (device and memory kind of its first group)."""
    first = view.geometries[0]
    return HybridGeometry(np.array([[int(first.bases.flat[0])]], dtype=np.uint64), first.device, first.kind,
                          view=view)


def _ids(side: str, label: str, ids) -> np.ndarray:
    if isinstance(ids, (str, bytes)):
        raise BlockIdError(f"{side} ids of {label}: expected integers; got {type(ids).__name__}")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise BlockIdError(f"{side} ids of {label}: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise BlockIdError(f"{side} ids of {label}: expected a 1-D integer list; got shape {arr.shape}, "
                           f"dtype {arr.dtype}")
    return arr.astype(np.int64)


def flat_ids(spec: HybridSpec, lists: Sequence, side: str = "local", num_tokens: int | None = None) -> np.ndarray:
    """One id list per group (vLLM's tuple of block-id lists: token-ordered block ids for an
    attention group, slot ids for a state group) as flat ids, group after group.

    ``num_tokens`` given: a sliding group's list is read as ending at the block of the request's
    last token and cut to the blocks of its window (this side's block size; both sides of a
    sliding group must have the same, which the plan checks). Full and state groups move as given.

    Raises:
        BlockIdError: not one list per group (names both counts); a list that is not 1-D
            integers; an id past its group (names the group, the id and the bound); a sliding
            list shorter than its window; a bad ``num_tokens``.
    """
    n = len(spec.groups)
    if isinstance(lists, (str, bytes, np.ndarray)) or not isinstance(lists, (list, tuple)) or len(lists) != n:
        got = len(lists) if isinstance(lists, (list, tuple)) else type(lists).__name__
        raise BlockIdError(f"a hybrid cache's {side} ids must be one list per group: {n} groups; got {got}")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer))
                                   or num_tokens < 0):
        raise BlockIdError(f"num_tokens must be a non-negative integer or None; got {num_tokens!r}")
    out = []
    for g, (group, ids) in enumerate(zip(spec.groups, lists)):
        label = spec.label(g)
        arr = _ids(side, label, ids)
        bound = _group_sizes(spec)[g]
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= bound):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise BlockIdError(f"{side} ids of {label}: id {bad} is outside [0, {bound})")
        if num_tokens is not None and isinstance(group, AttentionGroup) and group.sliding_window:
            bs = group.spec.block_size
            start, stop = group.window_tokens(int(num_tokens), bs)
            need = (stop - start) // bs
            if arr.size < need:
                raise BlockIdError(f"{side} ids of {label}: the list must end with the window's {need} blocks "
                                   f"(tokens [{start}, {stop}) of {num_tokens}); got {arr.size}")
            arr = arr[arr.size - need:]
        out.append(arr * n + g)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def split_flat(num_groups: int, ids) -> list[np.ndarray]:
    """Flat ids back into one id list per group (each group's ids in their flat order)."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    groups = arr % num_groups
    return [arr[groups == g] // num_groups for g in range(num_groups)]


class FlatHybridPlan:
    """``build_hybrid_plan`` between two carriers' views, taking and giving what the agent's
    read path takes of a ``TransferPlan``: ``for_request(flat_local, flat_remote)``."""

    reversible = True

    def __init__(self, plan, local, remote) -> None:
        self.hybrid, self.local, self.remote = plan, local, remote

    def __repr__(self) -> str:
        return f"FlatHybridPlan({self.hybrid!r})"

    @property
    def mode(self):
        from kvxfer.types import TransferPath
        return TransferPath.DIRECT

    def for_request(self, local_ids, remote_ids, num_tokens: int | None = None) -> RequestPlan:
        """Every group's rows of one request, group after group: one post.

        Raises:
            BlockIdError: ``num_tokens`` (a hybrid read's windows are cut by ``flat_ids``), or a
                group's ids refused by its planner (names the group).
            LayoutError: a group planned through host staging (not one descriptor list).
        """
        if num_tokens is not None:
            raise BlockIdError("a hybrid read moves whole blocks: pass num_tokens when naming its ids "
                               f"(kvxfer.layout.carrier.flat_ids), not to the plan; got num_tokens={num_tokens}")
        n = len(self.hybrid.local.spec.groups)
        req = self.hybrid.for_request(split_flat(n, local_ids), split_flat(n, remote_ids))
        loc, rem = req.descriptors()
        return RequestPlan(loc, rem, 0, int(req.num_bytes))


def build_flat_plan(local, remote, *, allow_conversion: bool = True) -> FlatHybridPlan:
    """The plan between two carriers' ``CacheView``s (``local`` reads from ``remote``).

    Raises:
        LayoutError: a side is not a hybrid cache (names which); the groups differ, a group's
            specs cannot be combined, or a group's block sizes differ on the two sides (names the
            group and both values).
    """
    from kvxfer.layout.hybrid import build_hybrid_plan

    for name, view in (("local", local), ("remote", remote)):
        if not isinstance(view.geometry, HybridGeometry) or hybrid_of(view.spec) is None:
            raise LayoutError(f"the {name} cache is not a hybrid cache: a hybrid cache (HybridSpec) moves only "
                              f"to and from another hybrid cache")
    lh, rh = local.geometry.view, remote.geometry.view
    for i, (a, b) in enumerate(zip(lh.spec.groups, rh.spec.groups)):
        if isinstance(a, AttentionGroup) and isinstance(b, AttentionGroup) and a.sliding_window \
                and a.spec.block_size != b.spec.block_size:
            raise LayoutError(f"{lh.spec.label(i)}: block_size differs: local has {a.spec.block_size}; remote has "
                              f"{b.spec.block_size} (a sliding group moves between equal block sizes)")
    plan = build_hybrid_plan(lh, rh, allow_conversion=allow_conversion, mode="direct")
    return FlatHybridPlan(plan, local, remote)

