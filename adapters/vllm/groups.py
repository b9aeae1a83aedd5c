"""vLLM's KV-cache groups (the hybrid KV-cache manager's) in the adapter's terms; imports kvxfer's public API only, never vllm at import time.

With the hybrid manager on, vLLM gives each kind of layer its own group with its own block
table: full attention, sliding-window attention, SSM state. Here: which groups a request's
blocks travel in, how a sliding group's list is cut to the blocks its window keeps, how a state
group's list is cut to the one block holding the running state, and how a load's per-group
lists line up with the producer's. A model of one group never comes here
(``groups_of`` returns None): its path is the one-group path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvxfer import ConfigError

from kvxfer_vllm.extent import load_blocks


@dataclass(frozen=True)
class StateInfo:
    """A state (vLLM ``MambaSpec``) group's page: the state tensors of one layer in page order
    (``shapes`` and torch ``dtypes`` as vLLM gives them, TP-local), the page's bytes (padded to the
    other groups' page size), the speculative scratch blocks after the running state's, and
    vLLM's ``mamba_cache_mode``."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    page_bytes: int
    speculative_blocks: int = 0
    cache_mode: str = "none"


@dataclass(frozen=True)
class GroupInfo:
    """One transferred KV-cache group: its index in vLLM's ``kv_cache_groups``, its kind
    (``full``, ``sliding`` or ``state``), the window in tokens (0: full), its block size and
    layer names; ``state``: a state group's page (None for attention)."""

    index: int
    kind: str
    sliding_window: int
    block_size: int
    layer_names: tuple[str, ...]
    state: StateInfo | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"

    def kept_blocks(self) -> int:
        """Blocks a sliding group keeps at the end of a request's list (0: all, a full group):
        its window's blocks plus one, for a window that does not start on a block boundary."""
        return -(-self.sliding_window // self.block_size) + 1 if self.sliding_window else 0

    def state_block(self, ids: Sequence[int]) -> tuple[int, ...]:
        """A state group's list cut to the running state's block: the speculative scratch blocks
        at its end dropped (at least one block stays), then the last (vLLM's form, the one block
        NixlConnector answers too); ``()`` for an empty list."""
        ids = tuple(ids)
        if not ids:
            return ()
        scratch = min(self.state.speculative_blocks if self.state else 0, len(ids) - 1)
        return (ids[:len(ids) - scratch] if scratch else ids)[-1:]


def has_state(groups: Sequence[GroupInfo] | None) -> bool:
    """Whether a hybrid cache has a state group (its prefill then stops one token short)."""
    return bool(groups) and any(g.kind == "state" for g in groups)


def groups_of(kv_cache_config: Any, block_size: int) -> tuple[GroupInfo, ...] | None:
    """The groups a hybrid cache transfers, in vLLM's order; None for a cache of one group.

    A ``MambaSpec`` group is a ``state`` group (its block size is the state's alignment, any
    size: the group moves one block, the running state's).

    Raises:
        ConfigError: a group kind the adapter cannot move yet (chunked local attention,
            cross-attention, ...), naming the group and its kind; an attention group whose block
            size is not ``block_size`` (names both); or no full-attention group (the load's
            extent is taken from one).
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    out = []
    for i in ids:
        spec = groups[i].kv_cache_spec
        if isinstance(spec, MambaSpec):
            state = StateInfo(tuple(tuple(int(d) for d in x) for x in spec.shapes), tuple(spec.dtypes),
                              int(spec.page_size_bytes), int(spec.num_speculative_blocks),
                              str(spec.mamba_cache_mode))
            out.append(GroupInfo(i, "state", 0, int(spec.block_size), tuple(groups[i].layer_names), state))
            continue
        if isinstance(spec, SlidingWindowSpec):
            kind, window = "sliding", int(spec.sliding_window)
        elif type(spec) is FullAttentionSpec:
            kind, window = "full", 0
        else:
            raise ConfigError(f"KvxferConnector moves full and sliding-window attention groups and Mamba state "
                              f"groups; KV-cache group {i} is {type(spec).__name__} (layers "
                              f"{list(groups[i].layer_names)[:4]}...), which it does not move yet: serve this "
                              f"model with vLLM's NixlConnector, or with --disable-hybrid-kv-cache-manager where "
                              f"vLLM runs the model without it")
        if int(spec.block_size) != block_size:
            raise ConfigError(f"KV-cache group {i} ({kind}) has blocks of {spec.block_size} tokens; KvxferConnector "
                              f"moves hybrid caches whose groups all have the engine's block size {block_size}")
        out.append(GroupInfo(i, kind, window, int(spec.block_size), tuple(groups[i].layer_names)))
    if not any(g.kind == "full" for g in out):
        raise ConfigError(f"KvxferConnector needs a full-attention KV-cache group in a hybrid cache; got "
                          f"{[g.name for g in out]}")
    return tuple(out)


def full_index(groups: Sequence[GroupInfo]) -> int:
    """Position (among ``groups``) of the first full-attention group."""
    return next(i for i, g in enumerate(groups) if g.kind == "full")


def select(groups: Sequence[GroupInfo], block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """One id tuple per transferred group from vLLM's tuple of per-group lists (all groups)."""
    return tuple(tuple(block_ids[g.index]) for g in groups)


def kept(groups: Sequence[GroupInfo], block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """A request's blocks per transferred group, each sliding group's cut to what it keeps
    (the tail of ``kept_blocks()``; vLLM frees the blocks before it, or marks them null), each
    state group's to its running state's block (``GroupInfo.state_block``)."""
    out = []
    for g, ids in zip(groups, select(groups, block_ids)):
        if g.kind == "state":
            out.append(g.state_block(ids))
            continue
        n = g.kept_blocks()
        out.append(ids[-n:] if n else ids)
    return tuple(out)


@dataclass(frozen=True)
class HybridLoad:
    """A load's lists, one per transferred group (same order on both sides); ``num_tokens``:
    the request's tokens after the load, which cuts each sliding group's lists to its window."""

    local: tuple[tuple[int, ...], ...]
    remote: tuple[tuple[int, ...], ...]
    num_tokens: int


def hybrid_load(groups: Sequence[GroupInfo], *, computed: int, count: int, fresh: Any,
                remote: Sequence[Sequence[int]], remote_tokens: int, block_size: int) -> HybridLoad:
    """The per-group lists that load ``count`` tokens after the ``computed`` ones (whole blocks
    of ``block_size`` on both sides).

    Full groups: as the one-group path (``load_blocks``). Sliding groups: the decode's fresh
    blocks of that group, ending at the block of token ``computed + count - 1``, against the
    producer's kept tail, whose last block holds token ``remote_tokens - 1``, cut to end at the
    same block; kvxfer then moves the window of ``computed + count`` tokens only. State groups:
    the decode's running-state block (``GroupInfo.state_block`` of its fresh blocks) against the
    producer's one block: the whole state after the loaded tokens. Lists that do not pair (no
    fresh state block here, or a producer answering other than one) pass as they are: kvxfer
    refuses the whole read, typed and naming both (never a partial transfer).
    """
    end = computed + count
    local_out, remote_out = [], []
    for g, mine, theirs in zip(groups, select(groups, fresh), remote):
        theirs = tuple(theirs)
        if g.kind == "state":
            local_out.append(g.state_block(mine))
            remote_out.append(theirs)
            continue
        if g.kind == "full":
            blocks = load_blocks(computed=computed, count=count, fresh=mine, remote_ids=theirs,
                                 local_block=block_size, remote_block=block_size)
            local_out.append(blocks.local)
            remote_out.append(blocks.remote)
            continue
        last_remote = (max(remote_tokens, 1) - 1) // block_size   # block index of the list's last id
        drop = last_remote - (end - 1) // block_size               # producer blocks past the load's end
        remote_out.append(theirs[:len(theirs) - drop] if drop > 0 else theirs)
        want = -(-end // block_size) - computed // block_size      # the decode's blocks from `computed` to `end`
        local_out.append(tuple(mine[:want]))
    return HybridLoad(tuple(local_out), tuple(remote_out), end)
