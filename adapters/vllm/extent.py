"""Which prompt tokens a vLLM decode instance loads from a producer whose blocks may be another size
(layer: vLLM adapter, pure arithmetic; imports nothing from vLLM or kvxfer).

vLLM allocates the decode's blocks for exactly the tokens the connector announces, and the
producer holds blocks for exactly its prompt. The load starts where the local prefix cache ends
(it must fall on a producer block boundary) and ends at the end of what the producer holds: every
prompt token moves, the last block of each side possibly partial. Where the two sides' lists
then cover different tokens, the load names its token count (kvxfer's ``num_tokens``), so
exactly those tokens move and nothing past them lands in the decode's last block.

Such partial reads move by descriptors, which a GPU cache takes only where the layouts match in
plain byte ranges; a decode whose cache is on a GPU (``partial=False``) therefore loads whole
units of the larger block size, as before, and computes the tokens after the last one (fewer
than one unit) itself: the answer is the same, only less of it is moved.
"""

from __future__ import annotations

from dataclasses import dataclass


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def tokens_to_load(*, computed: int, available: int, local_block: int, remote_block: int | None,
                   remote_blocks: int, partial: bool = True) -> int:
    """Prompt tokens to load after the ``computed`` ones the decode has locally (0: none).

    Args:
        computed: tokens the decode's own prefix cache covers (whole local blocks).
        available: prompt tokens whose KV the producer holds (``remote_num_tokens`` capped by the prompt).
        local_block, remote_block: tokens per block here and at the producer (None: the producer
            did not say; taken as ``local_block``, the old contract).
        remote_blocks: how many blocks the producer holds for the request.
        partial: loads may end inside a block on both sides (see the module doc); False: only
            whole units of the larger block size, or a tail whose partial blocks cover the same
            tokens on both sides.
    """
    remote_block = remote_block or local_block
    end = min(available, remote_blocks * remote_block)
    count = end - computed
    if count <= 0:
        return 0
    small, big = sorted((local_block, remote_block))
    if big % small or computed % remote_block:
        return 0  # the block sizes do not pair, or the load would start inside a producer block
    if partial or small == big:
        return count
    whole, tail = divmod(count, big)
    if tail and _blocks(tail, small) * small == big:
        return count   # the partial last blocks cover the same tokens on both sides
    return whole * big


@dataclass(frozen=True)
class LoadBlocks:
    """The block lists of one load: ``local[i]`` and ``remote[j]`` in token order; ``num_tokens``:
    the tokens it moves where the lists' partial last blocks cover different tokens, else None."""

    local: tuple[int, ...]
    remote: tuple[int, ...]
    num_tokens: int | None = None


def load_blocks(*, computed: int, count: int, fresh: tuple[int, ...], remote_ids: tuple[int, ...],
                local_block: int, remote_block: int | None) -> LoadBlocks:
    """The blocks that move ``count`` tokens after ``computed``: ``fresh`` are the decode's blocks
    from token ``computed`` on, ``remote_ids`` all the producer's blocks of the request."""
    remote_block = remote_block or local_block
    first = computed // remote_block
    local = tuple(fresh[:_blocks(count, local_block)])
    remote = tuple(remote_ids[first:first + _blocks(count, remote_block)])
    same = len(local) * local_block == len(remote) * remote_block
    return LoadBlocks(local, remote, None if same else count)
