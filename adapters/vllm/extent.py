"""Which prompt tokens a vLLM decode instance loads from a producer whose blocks may be another size
(layer: vLLM adapter, pure arithmetic; imports nothing from vLLM or kvxfer).

kvxfer moves whole blocks on both sides and refuses a read whose local and remote block lists
cover different numbers of tokens. vLLM allocates the decode's blocks for exactly the tokens the
connector announces, and the producer holds blocks for exactly its prompt. So the load starts
where the local prefix cache ends (it must fall on a producer block boundary) and ends where
both sides' blocks end together: at the prompt's end when its last, partial, blocks cover the
same tokens on both sides, else at the last whole unit (the larger block size). The tokens
after it, fewer than one unit, are computed by the decode instance, as tokens past
``remote_num_tokens`` are: the answer is the same, only less of it is moved.
"""

from __future__ import annotations

from dataclasses import dataclass


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def tokens_to_load(*, computed: int, available: int, local_block: int, remote_block: int | None,
                   remote_blocks: int) -> int:
    """Prompt tokens to load after the ``computed`` ones the decode has locally (0: none).

    Args:
        computed: tokens the decode's own prefix cache covers (whole local blocks).
        available: prompt tokens whose KV the producer holds (``remote_num_tokens`` capped by the prompt).
        local_block, remote_block: tokens per block here and at the producer (None: the producer
            did not say; taken as ``local_block``, the old contract).
        remote_blocks: how many blocks the producer holds for the request.
    """
    remote_block = remote_block or local_block
    end = min(available, remote_blocks * remote_block)
    count = end - computed
    if count <= 0:
        return 0
    if remote_block == local_block:
        return count
    small, big = sorted((local_block, remote_block))
    if big % small or computed % remote_block:
        return 0  # no whole-block pairing exists: the decode computes the prompt itself
    whole, tail = divmod(count, big)
    if tail and _blocks(tail, small) * small == big:
        return count   # the partial last blocks cover the same tokens on both sides
    return whole * big


@dataclass(frozen=True)
class LoadBlocks:
    """The block lists of one load: ``local[i]`` and ``remote[j]`` in token order, equal coverage."""

    local: tuple[int, ...]
    remote: tuple[int, ...]


def load_blocks(*, computed: int, count: int, fresh: tuple[int, ...], remote_ids: tuple[int, ...],
                local_block: int, remote_block: int | None) -> LoadBlocks:
    """The blocks that move ``count`` tokens after ``computed``: ``fresh`` are the decode's blocks
    from token ``computed`` on, ``remote_ids`` all the producer's blocks of the request."""
    remote_block = remote_block or local_block
    first = computed // remote_block
    return LoadBlocks(tuple(fresh[:_blocks(count, local_block)]),
                      tuple(remote_ids[first:first + _blocks(count, remote_block)]))
