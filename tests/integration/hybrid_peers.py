"""Hybrid caches for integration tests: a full-attention group, a sliding-window group sharing its tensors
(vLLM's shared tensors, ids kept apart) and a Mamba2 state group, laid out in one real buffer per rank."""

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.layout import AttentionGroup, HybridSpec, StateGroup, StateSpec, mamba2_state
from kvxfer.layout.oracle import Arena, place_hybrid
from kvxfer.testing import serve_commands

WINDOW = 10  # tokens of the sliding group's window
ATTN = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=32, dtype="float16", model="hyb")


def hybrid_spec(tp_size: int = 1, tp_rank: int = 0, window: int = WINDOW, layout: str = "NHD") -> HybridSpec:
    kv = KVSpec(**ATTN, layout=layout, tp_size=tp_size, tp_rank=tp_rank)
    state = StateSpec(1, mamba2_state(4, 4, 2, 4, 3, conv_dtype="float16", ssm_dtype="float32"), num_slots=8,
                      tp_size=tp_size, tp_rank=tp_rank, model="hyb")
    return HybridSpec((AttentionGroup(kv, 0, "full"), AttentionGroup(kv, window, "swa"), StateGroup(state, "mamba")))


def hybrid_cache(spec: HybridSpec, seed: int):
    """(tensors to register, the arena over the real buffer, the view at its real addresses)."""
    _, scratch = place_hybrid(spec, arena_base=0, share=True)
    buf = np.random.default_rng(seed).integers(0, 256, size=scratch.buf.size, dtype=np.uint8)
    arena = Arena.wrap(buf)
    view, _ = place_hybrid(spec, arena_base=arena.base, share=True)
    entries = []
    for g, geo in zip(spec.groups, view.geometries):
        s = g.spec
        if isinstance(g, AttentionGroup):
            layers = []
            for layer, shape in enumerate(s.tensor_shapes()):
                start = int(geo.bases[layer, 0]) - arena.base
                n = int(np.prod(shape)) * s.itemsize
                assert int(geo.bases[layer, 1]) - arena.base == start + n // 2  # K half then V half
                layers.append(buf[start:start + n].view(np.float16).reshape(shape))
            entries.append(layers)
        else:
            layers = []
            for layer in range(s.num_layers):
                arrays = []
                for t, size in enumerate(s.tensor_bytes):
                    start = int(geo.bases[layer, t]) - arena.base
                    arrays.append(buf[start:start + size * s.num_slots].view(s.tensors[t].dtype))
                layers.append(arrays)
            entries.append(layers)
    return entries, arena, view


def hybrid_producer(cmd, out, tp_size: int, tp_rank: int, seed: int, port: int, holds: dict, window: int) -> None:
    spec = hybrid_spec(tp_size, tp_rank, window)
    tensors, _, _ = hybrid_cache(spec, seed)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port)
    with Agent(f"hproducer{tp_rank}", spec, config) as agent:
        agent.register(tensors)
        agent.listen()
        serve_commands(agent, holds, cmd, out, timeout=120, extra={"token": lambda a: a.hold_token("t")})
