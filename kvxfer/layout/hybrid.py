"""The translator over every group of a hybrid cache (layer: layout, pure; numpy only, no nixl/zmq/torch).

``build_hybrid_plan`` runs once per (local rank, remote rank) pair, like ``build_plan``: it
checks the two group lists match, then plans every group that pair moves (``build_plan`` for an
attention group, ``build_state_plan`` for a state group). A group the consumer reads from
another producer rank (its heads or state units live elsewhere) has no part for this pair.
``HybridPlan.for_request`` takes one id list per group and returns every group's descriptors,
or raises before returning anything: never a partial request.

Which producer ranks a consumer rank reads from and notifies is the union over groups of each
group's rule (``tp.peer_ranks`` for heads, ``tp.unit_read_ranks`` for state units), so one
post and one notice per producer rank cover all groups.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.layout.groups import AttentionGroup, HybridSpec, HybridView, StateGroup
from kvxfer.layout.plan import build_plan, check_compatible
from kvxfer.layout.request import RequestPlan
from kvxfer.layout.stateplan import StatePlan, build_state_plan
from kvxfer.layout.tp import notify_ranks, peer_ranks, unit_notify_ranks, unit_read_ranks
from kvxfer.types import TransferPath

__all__ = ["HybridPlan", "HybridRequest", "build_hybrid_plan", "check_groups_match", "hybrid_expected_notifications",
           "hybrid_notify_ranks", "hybrid_peer_ranks"]


def _state_ranks(g: StateGroup, remote_tp: int, read: bool) -> set[int]:
    """Remote ranks a state group reads from (``read``) or depends on: the union over its segments."""
    s, ranks = g.spec, set()
    for t in s.tensors:
        if t.segments is None:
            if remote_tp != s.tp_size:
                raise LayoutError(f"state tensor {t.name!r} has no described TP split: it moves only between "
                                  f"equal TP sizes; local tp_size {s.tp_size}, remote tp_size {remote_tp}")
            ranks.add(s.tp_rank)
            continue
        rule = unit_read_ranks if read else unit_notify_ranks
        for units, _ in t.segments:
            ranks.update(rule(units, s.tp_size, s.tp_rank, remote_tp))
    return ranks


def _group_ranks(spec: HybridSpec, remote_tp: int, read: bool) -> list[set[int]]:
    """Per group, the remote ranks ``spec``'s rank reads from (``read``) or depends on."""
    if isinstance(remote_tp, bool) or not isinstance(remote_tp, int) or remote_tp <= 0:
        raise LayoutError(f"remote tp_size must be a positive integer; got {remote_tp!r}")
    out = []
    for i, g in enumerate(spec.groups):
        try:
            if isinstance(g, AttentionGroup):
                out.append(set((peer_ranks if read else notify_ranks)(g.spec, remote_tp)))
            else:
                out.append(_state_ranks(g, remote_tp, read))
        except LayoutError as exc:
            raise type(exc)(f"{spec.label(i)}: {exc}") from exc
    return out


def hybrid_peer_ranks(local: HybridSpec, remote_tp_size: int) -> list[int]:
    """Remote ranks ``local`` reads from for any group (ascending): one post each covers all its groups."""
    return sorted(set().union(*_group_ranks(local, remote_tp_size, read=True)))


def hybrid_notify_ranks(local: HybridSpec, remote_tp_size: int) -> list[int]:
    """Every remote rank holding anything ``local`` needs, in any group; ``local`` notifies each once per request."""
    return sorted(set().union(*_group_ranks(local, remote_tp_size, read=False)))


def hybrid_expected_notifications(producer: HybridSpec, consumer_tp_size: int) -> int:
    """How many consumer ranks notify ``producer`` per request: those whose ``hybrid_notify_ranks``
    list it (a consumer rank depends on a producer rank when they share a head or a state unit
    of any group).

    Raises:
        LayoutError: a group cannot be cut at ``consumer_tp_size`` (names the group and both values).
    """
    if isinstance(consumer_tp_size, bool) or not isinstance(consumer_tp_size, int) or consumer_tp_size <= 0:
        raise LayoutError(f"consumer tp_size must be a positive integer; got {consumer_tp_size!r}")
    return sum(producer.tp_rank in hybrid_notify_ranks(_as_rank(producer, consumer_tp_size, c), producer.tp_size)
               for c in range(consumer_tp_size))


def _as_rank(spec: HybridSpec, tp_size: int, rank: int) -> HybridSpec:
    """``spec``'s groups as rank ``rank`` of a ``tp_size`` instance holds them (their cut only:
    a state page's padding is dropped, it is sized for ``spec``'s TP)."""
    groups = []
    for i, g in enumerate(spec.groups):
        extra = {"slot_stride": 0} if isinstance(g, StateGroup) else {}
        try:
            groups.append(replace(g, spec=replace(g.spec, tp_size=tp_size, tp_rank=rank, **extra)))
        except LayoutError as exc:
            raise type(exc)(f"{spec.label(i)} at tp_size {tp_size} (producer has {spec.tp_size}): {exc}") from exc
    return HybridSpec(tuple(groups))


def check_groups_match(local: HybridSpec, remote: HybridSpec) -> None:
    """LayoutError unless both caches list the same groups: count, kind, name and window
    (each group's own spec is checked by its planner, the error naming the group)."""
    nl, nr = len(local.groups), len(remote.groups)
    if nl != nr:
        raise LayoutError(f"the caches have different group lists: local has {nl} groups "
                          f"{[g.kind.value for g in local.groups]}; remote has {nr} {[g.kind.value for g in remote.groups]}")
    for i, (a, b) in enumerate(zip(local.groups, remote.groups)):
        for what, x, y in (("kind", a.kind.value, b.kind.value), ("name", a.name, b.name),
                           ("sliding_window", getattr(a, "sliding_window", 0), getattr(b, "sliding_window", 0))):
            if x != y:
                raise LayoutError(f"{local.label(i)}: {what} differs: local has {x!r}; remote has {y!r}")


class HybridRequest:
    """One request's descriptors for every group a pair moves: ``parts[i]`` is group ``i``'s
    ``RequestPlan`` or None (the pair does not move that group). ``num_bytes``: all parts."""

    def __init__(self, parts: tuple[RequestPlan | None, ...]) -> None:
        self.parts = parts
        self.num_bytes = sum(p.num_bytes for p in parts if p is not None)

    def descriptors(self) -> tuple[np.ndarray, np.ndarray]:
        """Every part's ``[N, 3]`` local and remote rows together, group after group (one post).

        Raises:
            LayoutError: a part is host-staged (its local rows are staging offsets; post it apart).
        """
        loc, rem = [], []
        for i, p in enumerate(self.parts):
            if p is None:
                continue
            if p.mode is not TransferPath.DIRECT:
                raise LayoutError(f"group {i} is host-staged: its local rows are staging offsets and "
                                  f"cannot join one descriptor list")
            loc.append(p.local)
            rem.append(p.remote)
        if not loc:
            empty = np.zeros((0, 3), dtype=np.uint64)
            return empty, empty.copy()
        return np.concatenate(loc), np.concatenate(rem)


class HybridPlan:
    """Per-group plans between a local and a remote rank's hybrid caches; built once per peer.

    ``parts[i]``: group ``i``'s ``TransferPlan``/``SplitKVPlan``/``StatePlan``, or None when this
    pair does not move it. ``local``, ``remote``: the HybridViews.
    """

    def __init__(self, local: HybridView, remote: HybridView, parts: tuple) -> None:
        self.local, self.remote, self.parts = local, remote, parts

    def __repr__(self) -> str:
        return f"HybridPlan({', '.join(repr(p) for p in self.parts)})"

    @property
    def reversible(self) -> bool:
        return all(p.reversible for p in self.parts if p is not None)

    def for_request(self, local_ids: Sequence, remote_ids: Sequence, num_tokens: int | None = None) -> HybridRequest:
        """Descriptors of every group for one request.

        Args:
            local_ids, remote_ids: one id list per group, in group order: block ids in token
                order for an attention group, slot ids for a state group.
            num_tokens: the request's tokens. Given, a sliding group's lists are read as ending
                at the block of the last token (padded to whole units of the larger block, as
                every list is) and only the blocks of its window move; None, they move as given.

        Raises:
            BlockIdError: not one list per group (names both counts); any group's ids refused
                by its planner, or a sliding list shorter than its window (names the group).
        """
        spec = self.local.spec
        for side, ids in (("local", local_ids), ("remote", remote_ids)):
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or len(ids) != len(spec.groups):
                got = len(ids) if isinstance(ids, (list, tuple)) else type(ids).__name__
                raise BlockIdError(f"{side} ids must be one list per group: {len(spec.groups)} groups; got {got}")
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer))
                                       or num_tokens < 0):
            raise BlockIdError(f"num_tokens must be a non-negative integer or None; got {num_tokens!r}")
        parts = []
        for i, (g, plan, lids, rids) in enumerate(zip(spec.groups, self.parts, local_ids, remote_ids)):
            if plan is None:
                parts.append(None)
                continue
            try:
                if num_tokens is not None and isinstance(g, AttentionGroup) and g.sliding_window:
                    lids, rids = self._window(g, plan, lids, rids, int(num_tokens))
                parts.append(plan.for_request(lids, rids))
            except LayoutError as exc:
                raise type(exc)(f"{spec.label(i)}: {exc}") from exc
        return HybridRequest(tuple(parts))

    @staticmethod
    def _window(g: AttentionGroup, plan, lids, rids, num_tokens: int):
        ls, rs = plan.local.spec, plan.remote.spec
        start, stop = g.window_tokens(num_tokens, max(ls.block_size, rs.block_size))
        out = []
        for side, ids, bs in (("local", lids, ls.block_size), ("remote", rids, rs.block_size)):
            ids = np.asarray(ids)
            need = (stop - start) // bs
            if ids.ndim != 1 or ids.size < need:
                raise BlockIdError(f"the {side} list must end with the window's {need} blocks (tokens "
                                   f"[{start}, {stop}) of {num_tokens}); got shape {ids.shape}")
            out.append(ids[ids.size - need:])
        return out[0], out[1]


def build_hybrid_plan(local: HybridView, remote: HybridView, *, local_is_consumer: bool = True,
                      allow_conversion: bool = True, min_direct_bytes: int = 4096, mode: str = "auto") -> HybridPlan:
    """Plan every group the pair (``local`` rank, ``remote`` rank) moves, for any request.

    ``local_is_consumer`` (True: a READ into ``local``; False: a WRITE from it) says whose choice
    of producer replica applies. Knobs as ``build_plan``'s, for attention groups.

    Raises:
        LayoutError: group lists differ (names the group and both values); a group's specs
            cannot be combined (its planner's error, prefixed with the group); the pair moves
            nothing of any group, the producer not being in the consumer's ``hybrid_peer_ranks``
            (names both ranks).
    """
    for name, view in (("local", local), ("remote", remote)):
        if not isinstance(view, HybridView):
            raise LayoutError(f"{name} must be a HybridView; got {type(view).__name__}")
    ls, rs = local.spec, remote.spec
    check_groups_match(ls, rs)
    consumer, producer = (ls, rs) if local_is_consumer else (rs, ls)
    reads = _group_ranks(consumer, producer.tp_size, read=True)
    parts: list = []
    for i, (g, lv, rv) in enumerate(zip(ls.groups, local.views, remote.views)):
        try:
            if isinstance(g, StateGroup):
                part: StatePlan | None = build_state_plan(lv, rv, local_is_consumer=local_is_consumer)
                part = None if part.empty else part
            elif producer.tp_rank in reads[i]:
                part = build_plan(lv, rv, allow_conversion=allow_conversion, min_direct_bytes=min_direct_bytes,
                                  mode=mode)
            else:
                check_compatible(lv.spec, rv.spec)   # a group this pair skips must still match
                part = None
        except LayoutError as exc:
            raise type(exc)(f"{ls.label(i)}: {exc}") from exc
        parts.append(part)
    if all(p is None for p in parts):
        raise LayoutError(f"remote rank {rs.tp_rank}/{rs.tp_size} and local rank {ls.tp_rank}/{ls.tp_size} "
                          f"move nothing in any group: the consumer reads none of its groups from the producer "
                          f"(see hybrid_peer_ranks)")
    return HybridPlan(local, remote, tuple(parts))
