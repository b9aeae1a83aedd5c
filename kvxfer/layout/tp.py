"""Tensor-parallel head mapping between two instances (layer: layout, pure; numpy/stdlib only, no nixl/zmq/torch).

Every rank of an instance stores a contiguous range of the model's KV heads
(``KVSpec.first_head`` .. ``+ heads_per_rank``). A consumer rank *depends on* a producer
rank when the producer stores at least one head the consumer needs. The rules here:

* ``peer_ranks``: the producer ranks a consumer READS from: for every distinct head range
  of the producer instance that overlaps the consumer's heads, exactly one rank (the
  replica ``consumer.tp_rank % replication``, so consumers spread their reads).
* ``notify_ranks``: every producer rank the consumer depends on (a superset of
  ``peer_ranks``: it adds the replicas that hold the same heads but are not read).
  A consumer sends one completion notice per request to each of them.
* ``expected_notifications``: how many consumer ranks depend on a producer rank, i.e.
  how many notices it waits for before freeing a request's blocks. It is consistent with
  ``notify_ranks`` by construction (both use ``head_range``).
"""

from __future__ import annotations

from functools import lru_cache

from kvxfer.errors import LayoutError
from kvxfer.layout.spec import KVSpec

__all__ = ["expected_notifications", "head_range", "notify_ranks", "peer_ranks", "unit_notify_ranks",
           "unit_read_ranks"]


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int, mla: bool = False) -> tuple[int, int]:
    """Global head range ``[start, stop)`` that rank ``tp_rank`` of a ``tp_size`` instance stores.

    MLA caches hold one latent "head" replicated on every rank. With ``tp_size > num_kv_heads``
    each head is replicated on ``tp_size // num_kv_heads`` consecutive ranks.
    """
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank must be in [0, {tp_size}); got {tp_rank}")
    if mla:
        return (0, 1)
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise LayoutError(f"num_kv_heads ({num_kv_heads}) and tp_size ({tp_size}) must divide one another")
    per_rank = max(1, num_kv_heads // tp_size)
    replication = max(1, tp_size // num_kv_heads)
    start = (tp_rank // replication) * per_rank
    return (start, start + per_rank)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _check_tp(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"remote tp_size must be a positive integer; got {value!r}")


def unit_notify_ranks(units: int, local_tp: int, local_rank: int, remote_tp: int, mla: bool = False) -> list[int]:
    """Every rank of a ``remote_tp`` instance holding a unit (a head, or a state segment's unit)
    that rank ``local_rank`` of a ``local_tp`` instance holds, for ``units`` units cut as heads are."""
    _check_tp(remote_tp)
    return list(_notify(units, local_tp, local_rank, remote_tp, bool(mla)))


def unit_read_ranks(units: int, local_tp: int, local_rank: int, remote_tp: int, mla: bool = False) -> list[int]:
    """The ranks of ``unit_notify_ranks`` a consumer reads from: one replica per distinct
    overlapping unit range, the one at position ``local_rank % replication`` (see ``peer_ranks``)."""
    _check_tp(remote_tp)
    return list(_read(units, local_tp, local_rank, remote_tp, bool(mla)))


# Both answers depend only on a handful of ints and are asked for on every read: worked out once
# for each combination (a bad combination raises and is not kept).
@lru_cache(maxsize=256)
def _notify(units: int, local_tp: int, local_rank: int, remote_tp: int, mla: bool) -> tuple[int, ...]:
    need = head_range(units, local_tp, local_rank, mla)
    return tuple(r for r in range(remote_tp) if _overlaps(need, head_range(units, remote_tp, r, mla)))


@lru_cache(maxsize=256)
def _read(units: int, local_tp: int, local_rank: int, remote_tp: int, mla: bool) -> tuple[int, ...]:
    by_range: dict[tuple[int, int], list[int]] = {}
    for r in _notify(units, local_tp, local_rank, remote_tp, mla):
        by_range.setdefault(head_range(units, remote_tp, r, mla), []).append(r)
    return tuple(sorted(reps[local_rank % len(reps)] for reps in by_range.values()))


def notify_ranks(local: KVSpec, remote_tp_size: int) -> list[int]:
    """Every remote rank holding a head ``local`` needs (ascending); ``local`` notifies each once per request.
    A hybrid cache's carrier (``kvxfer.layout.carrier``): the union over its groups."""
    if getattr(local, "hybrid", None) is not None:
        from kvxfer.layout.hybrid import hybrid_notify_ranks
        return hybrid_notify_ranks(local.hybrid, remote_tp_size)
    return unit_notify_ranks(local.num_kv_heads, local.tp_size, local.tp_rank, remote_tp_size, local.mla)


def peer_ranks(local: KVSpec, remote_tp_size: int) -> list[int]:
    """Remote ranks ``local`` reads from (ascending): one replica per distinct overlapping head range.

    The heads those ranks hold are disjoint and together cover all heads ``local`` needs.
    Among replicas of one head range, the one at position ``local.tp_rank % replication``
    is chosen, so the consumers sharing a head range spread over its replicas.
    """
    if getattr(local, "hybrid", None) is not None:
        from kvxfer.layout.hybrid import hybrid_peer_ranks
        return hybrid_peer_ranks(local.hybrid, remote_tp_size)
    return unit_read_ranks(local.num_kv_heads, local.tp_size, local.tp_rank, remote_tp_size, local.mla)


def expected_notifications(producer: KVSpec, consumer_tp_size: int) -> int:
    """How many consumer ranks depend on ``producer`` (each sends it one notice per request).

    Equals ``sum(producer.tp_rank in notify_ranks(c, producer.tp_size) for c in consumer ranks)``.
    """
    if getattr(producer, "hybrid", None) is not None:
        from kvxfer.layout.hybrid import hybrid_expected_notifications
        return hybrid_expected_notifications(producer.hybrid, consumer_tp_size)
    _check_tp(consumer_tp_size)
    have = head_range(producer.num_kv_heads, producer.tp_size, producer.tp_rank, producer.mla)
    return sum(
        _overlaps(have, head_range(producer.num_kv_heads, consumer_tp_size, c, producer.mla))
        for c in range(consumer_tp_size)
    )
