"""HybridSpec: a cache made of several layer groups, each with its own spec (layer: layout, pure; numpy only, no nixl/zmq/torch).

Hybrid models keep more than one kind of layer, and an engine gives each kind its own group
with its own block table (vLLM's hybrid KV-cache manager: ``KVCacheConfig.kv_cache_groups``):

* ``AttentionGroup``: paged K/V described by a ``KVSpec`` (any layout, storage and TP kvxfer
  knows), with ``sliding_window`` tokens (0: full attention). A sliding group keeps only the
  blocks of its window, so a request moves only those.
* ``StateGroup``: per-request slots of fixed-size state (``StateSpec``: SSM conv and temporal
  state, linear-attention state).

A request names one id list per group, in group order (vLLM's tuple of block-id lists): token-
ordered block ids for an attention group, slot ids for a state group. Every group of one
instance shares its TP rank and size and its model; pipeline parallelism is not supported.
``HybridSpec.single(spec)`` is today's one-group cache: it plans exactly as ``build_plan``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Union

import numpy as np

from kvxfer.errors import ConfigError, LayoutError
from kvxfer.layout.plan import CacheView
from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.layout.state import StateSpec, StateView, contiguous_state

__all__ = ["AttentionGroup", "CacheGroup", "GroupKind", "HybridSpec", "HybridView", "StateGroup", "group_kind"]


class GroupKind(str, enum.Enum):
    """The kinds of layer group kvxfer can describe."""

    FULL = "full"          # full attention: every block of the request
    SLIDING = "sliding"    # sliding-window attention: the blocks of the window
    STATE = "state"        # per-request state slots (SSM, linear attention)


def group_kind(kind: str, group: int | str = "?") -> GroupKind:
    """``kind`` as a ``GroupKind``; LayoutError naming the group and the known kinds otherwise
    (an adapter maps its engine's group kinds through this, so an unknown one fails typed)."""
    try:
        return GroupKind(kind)
    except ValueError:
        raise LayoutError(f"group {group}: kind {kind!r} cannot be described by kvxfer; known kinds are "
                          f"{[k.value for k in GroupKind]}") from None


def _name(name) -> str:
    if not isinstance(name, str):
        raise LayoutError(f"a group name must be a str; got {name!r}")
    return name


@dataclass(frozen=True)
class AttentionGroup:
    """Paged attention layers: ``spec`` describes them; ``sliding_window`` tokens (0: full).

    The window counts the token being computed, as vLLM's does: after ``n`` tokens the next
    one attends to tokens ``[n - sliding_window + 1, n)`` of the cache.
    """

    spec: KVSpec
    sliding_window: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise LayoutError(f"AttentionGroup.spec must be a KVSpec; got {type(self.spec).__name__}")
        w = self.sliding_window
        if isinstance(w, np.integer):
            object.__setattr__(self, "sliding_window", w := int(w))
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise LayoutError(f"sliding_window must be a non-negative integer (0: full attention); got {w!r}")
        _name(self.name)

    @property
    def kind(self) -> GroupKind:
        return GroupKind.SLIDING if self.sliding_window else GroupKind.FULL

    def window_tokens(self, num_tokens: int, unit: int) -> tuple[int, int]:
        """Token range ``[start, stop)`` of a ``num_tokens`` request this group keeps, widened to
        whole units of ``unit`` tokens (a full group: ``[0, stop)``)."""
        stop = -(-num_tokens // unit) * unit
        if not self.sliding_window:
            return 0, stop
        start = max(0, num_tokens - self.sliding_window + 1)
        return start // unit * unit, stop


@dataclass(frozen=True)
class StateGroup:
    """State layers: ``spec`` describes their per-request slots."""

    spec: StateSpec
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, StateSpec):
            raise LayoutError(f"StateGroup.spec must be a StateSpec; got {type(self.spec).__name__}")
        _name(self.name)

    @property
    def kind(self) -> GroupKind:
        return GroupKind.STATE


CacheGroup = Union[AttentionGroup, StateGroup]


@dataclass(frozen=True)
class HybridSpec:
    """One tensor-parallel rank's cache of several groups (see the module docstring).

    Args:
        groups: the groups in the engine's order (the order requests name id lists in).
        pp_size: pipeline-parallel size; only 1 is supported.

    Raises:
        LayoutError: no groups, an object that is not a group (names its index and type),
            groups that disagree on ``tp_rank``, ``tp_size`` or ``model`` (names the group and both values).
        ConfigError: ``pp_size`` other than 1.
    """

    groups: tuple[CacheGroup, ...]
    pp_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.pp_size, bool) or not isinstance(self.pp_size, (int, np.integer)) or self.pp_size != 1:
            raise ConfigError(f"pipeline parallelism is not supported: pp_size must be 1; got {self.pp_size!r}")
        groups = tuple(self.groups) if isinstance(self.groups, (list, tuple)) else None
        if not groups:
            raise LayoutError(f"a HybridSpec needs a non-empty sequence of groups; got {self.groups!r}")
        for i, g in enumerate(groups):
            if not isinstance(g, (AttentionGroup, StateGroup)):
                raise LayoutError(f"group {i}: {type(g).__name__} is not a group kvxfer can describe "
                                  f"(AttentionGroup or StateGroup)")
        first = groups[0].spec
        for i, g in enumerate(groups[1:], 1):
            for name in ("tp_size", "tp_rank", "model"):
                if getattr(g.spec, name) != getattr(first, name):
                    raise LayoutError(f"group {i} ({g.kind.value} {g.name!r}): {name} is "
                                      f"{getattr(g.spec, name)!r}; group 0 has {getattr(first, name)!r}")
        object.__setattr__(self, "groups", groups)

    @classmethod
    def single(cls, spec: KVSpec) -> "HybridSpec":
        """Today's cache: one full-attention group."""
        return cls((AttentionGroup(spec),))

    @property
    def tp_size(self) -> int:
        return self.groups[0].spec.tp_size

    @property
    def tp_rank(self) -> int:
        return self.groups[0].spec.tp_rank

    def with_rank(self, tp_rank: int) -> "HybridSpec":
        """The same cache for another rank of the same instance."""
        return replace(self, groups=tuple(replace(g, spec=g.spec.with_rank(tp_rank)) for g in self.groups))

    def label(self, index: int) -> str:
        """How errors name group ``index``: ``group 1 (sliding 'swa')``."""
        g = self.groups[index]
        return f"group {index} ({g.kind.value} {g.name!r})"


@dataclass(frozen=True)
class HybridView:
    """One rank's hybrid cache: its ``spec`` and one geometry per group (the owner's addresses;
    groups may share memory, as vLLM's do: the engine keeps their ids apart)."""

    spec: HybridSpec
    geometries: tuple[CacheGeometry, ...] = field(repr=False)
    #: one ``CacheView`` (attention) or ``StateView`` (state) per group, built from the two above
    views: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, HybridSpec):
            raise LayoutError(f"HybridView.spec must be a HybridSpec; got {type(self.spec).__name__}")
        geos = tuple(self.geometries) if isinstance(self.geometries, (list, tuple)) else ()
        if len(geos) != len(self.spec.groups):
            raise LayoutError(f"HybridView needs one geometry per group: {len(self.spec.groups)} groups; "
                              f"got {len(geos)} geometries")
        views = []
        for i, (g, geo) in enumerate(zip(self.spec.groups, geos)):
            try:
                views.append(CacheView(g.spec, geo) if isinstance(g, AttentionGroup) else StateView(g.spec, geo))
            except LayoutError as exc:
                raise type(exc)(f"{self.spec.label(i)}: {exc}") from exc
        object.__setattr__(self, "geometries", geos)
        object.__setattr__(self, "views", tuple(views))

    @classmethod
    def contiguous(cls, spec: HybridSpec, base: int) -> "HybridView":
        """Every group in one allocation at ``base``, group after group (no sharing)."""
        geos, pos = [], base
        for g in spec.groups:
            if isinstance(g, AttentionGroup):
                geos.append(CacheGeometry.contiguous(g.spec, pos))
            else:
                geos.append(contiguous_state(g.spec, pos))
            pos += g.spec.cache_bytes
        return cls(spec, tuple(geos))
