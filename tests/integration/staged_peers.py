"""Producer ranks for the staged-path tests (``nixl_peers.Producer`` with staged defaults) and
the logical-KV oracle they check reads against."""

import numpy as np

from kvxfer import KVSpec

from nixl_peers import Producer


class StagedProducer(Producer):
    """A producer rank with ``transfer_path="staged"`` and a small staging area by default."""

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, stall_after: int | None = None,
                 **cfg) -> None:
        cfg.setdefault("transfer_path", "staged")
        cfg.setdefault("pipeline_slot_bytes", 16 << 10)
        cfg.setdefault("pipeline_slots", 4)
        super().__init__(spec, seed, port, holds, stall_after, **cfg)


def logical(spec: KVSpec, cache: list[np.ndarray], ids) -> np.ndarray:
    """Oracle: ``[layers, K/V, tokens, heads_per_rank, head_dim]`` of ``ids`` from split-storage tensors."""
    out = []
    for t in cache:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)   # [2, blocks, heads, bs, hd] -> [2, blocks, bs, heads, hd]
        sel = t[:, list(ids)]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def expect_read(consumer: KVSpec, c_cache0: list[np.ndarray], c_ids, producers: list[tuple[KVSpec, list]],
                p_ids) -> np.ndarray:
    """The consumer's logical view of ``c_ids`` after reading ``p_ids`` from every producer rank."""
    want = logical(consumer, c_cache0, c_ids).copy()
    c0 = consumer.first_head
    for spec, cache in producers:
        src = logical(spec, cache, p_ids)
        p0 = spec.first_head
        lo, hi = max(p0, c0), min(p0 + spec.heads_per_rank, c0 + consumer.heads_per_rank)
        want[:, :, :, lo - c0:hi - c0] = src[:, :, :, lo - p0:hi - p0]
    return want
