"""Model presets and transfer scenarios for ``kvxfer bench`` (layer: bench app; pure: layout specs and numpy).

A *scenario* turns a model geometry into the producer ranks' and the measured consumer rank's
``KVSpec`` (TP change, layout change, storage) and a request's block ids (contiguous or
fragmented). Everything here is deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvxfer.errors import ConfigError
from kvxfer.layout.spec import KVSpec

__all__ = ["PRESETS", "SCENARIOS", "Scenario", "build_scenario", "block_ids"]

#: name -> (layers, kv heads, head dim, dtype, mla). Per-rank presets already divide the heads.
PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    # Llama-3-70B on TP 8: each rank holds 1 of the 8 KV heads; 80 layers.
    "llama-3-70b-rank": dict(num_layers=80, num_kv_heads=1, head_dim=128, dtype="bfloat16"),
    "qwen3-0.6b": dict(num_layers=28, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    # DeepSeek-V3-style MLA: one 576-wide latent (512 + 64 rope) per token, 61 layers.
    "deepseek-v3-mla": dict(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bfloat16", mla=True),
}

#: name -> (producer tp, consumer tp, producer layout, consumer layout, storage)
SCENARIOS: dict[str, tuple[int, int, str, str, str]] = {
    "same": (1, 1, "NHD", "NHD", "split"),
    "same-hnd": (1, 1, "HND", "HND", "split"),
    "packed": (1, 1, "NHD", "NHD", "packed"),
    "cross-layer": (1, 1, "NHD", "NHD", "cross_layer"),
    "tp1-2": (1, 2, "HND", "HND", "split"),
    "tp2-1": (2, 1, "HND", "HND", "split"),
    "tp4-1": (4, 1, "HND", "HND", "split"),
    "hnd-nhd": (1, 1, "HND", "NHD", "split"),
}


@dataclass(frozen=True)
class Scenario:
    """Producer rank specs (one per rank the consumer reads from) and the measured consumer's spec."""

    name: str
    producers: tuple[KVSpec, ...]
    consumer: KVSpec
    tokens: int

    @property
    def request_bytes(self) -> int:
        """Bytes the consumer rank receives for one request."""
        c = self.consumer
        return c.num_layers * c.kv_count * self.tokens * c.heads_per_rank * c.vector_bytes

    @property
    def producer_blocks(self) -> int:
        return -(-self.tokens // self.producers[0].block_size)

    @property
    def consumer_blocks(self) -> int:
        return -(-self.tokens // self.consumer.block_size)


def build_scenario(name: str, geometry: dict, tokens: int, block_size: int = 16,
                   cache_factor: int = 4) -> Scenario:
    """Specs for scenario ``name`` on a model ``geometry`` (a PRESETS entry or explicit fields).

    Each cache holds ``cache_factor`` times the blocks one request needs, so fragmented ids
    spread over a realistic cache. Raises ConfigError for an unknown scenario or bad sizes.
    """
    if name not in SCENARIOS:
        raise ConfigError(f"scenario must be one of {sorted(SCENARIOS)}; got {name!r}")
    if tokens <= 0 or cache_factor < 1:
        raise ConfigError(f"tokens and cache_factor must be positive; got {tokens}, {cache_factor}")
    p_tp, c_tp, p_layout, c_layout, storage = SCENARIOS[name]
    geo = dict(geometry)
    mla = bool(geo.get("mla", False))
    if mla and storage == "packed":
        raise ConfigError("an MLA cache has no V: scenario 'packed' does not apply")
    if mla and (p_tp, c_tp) != (1, 1):
        p_tp = c_tp = 1  # MLA caches are replicated: every rank reads one full copy
    blocks = cache_factor * -(-tokens // block_size)
    base = KVSpec(block_size=block_size, num_blocks=blocks, storage=storage, model="bench", **geo)
    if not mla and (base.num_kv_heads % max(p_tp, c_tp)):
        raise ConfigError(f"scenario {name!r} needs num_kv_heads divisible by {max(p_tp, c_tp)}; "
                          f"got {base.num_kv_heads}")
    consumer = replace(base, layout=c_layout, tp_size=c_tp, tp_rank=0)
    from kvxfer.layout.tp import peer_ranks  # noqa: PLC0415 - pure layout helper

    ranks = peer_ranks(consumer, p_tp)
    producers = tuple(replace(base, layout=p_layout, tp_size=p_tp, tp_rank=r) for r in ranks)
    return Scenario(name, producers, consumer, tokens)


def block_ids(n: int, num_blocks: int, pattern: str, seed: int) -> np.ndarray:
    """``n`` distinct block ids in ``[0, num_blocks)``: ``contiguous`` (a run starting mid-cache)
    or ``fragmented`` (a random subset in random order, as a long-running server's allocator gives)."""
    if n > num_blocks:
        raise ConfigError(f"a request of {n} blocks does not fit a cache of {num_blocks}")
    rng = np.random.default_rng(seed)
    if pattern == "contiguous":
        start = int(rng.integers(0, num_blocks - n + 1))
        return np.arange(start, start + n, dtype=np.int64)
    if pattern == "fragmented":
        return rng.permutation(num_blocks)[:n].astype(np.int64)
    raise ConfigError(f"block id pattern must be 'contiguous' or 'fragmented'; got {pattern!r}")
