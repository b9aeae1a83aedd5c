"""vLLM 0.32's GPU attention caches, built on CPU exactly as vLLM builds them, described by the adapter
and checked against kvxfer's byte oracle, then moved between Agents (byte-copying FakeBackend; the
GPU script's cases also over NIXL between real processes, in host memory).

vLLM 0.32 no longer asks a backend for a cache shape: ``vllm.v1.worker.utils.allocate_kv_cache``
views one allocation as ``[blocks, heads, tokens, content]`` per layer, in the memory order of the
KV-cache layout (``KVCacheLayout``, set by ``VLLM_KV_CACHE_LAYOUT`` or the connector), and each
backend reads that view its own way. The tests below call vLLM's own functions
(``compute_layout_strides``, ``_get_kv_cache_bytes_per_block``, ``allocate_kv_cache``) on CPU memory,
and read K and V as the backends do, from this table (vLLM 0.32 source, ``vllm/v1/attention/backends``):

| backend | per-layer view | K and V |
|---|---|---|
| FlashAttention (flash_attn.py) | ``[B, H, N, 2*D]`` | ``view.transpose(1, 2).split(D, -1)`` |
| Triton (triton_attn.py) | ``[B, H, N, 2*D]`` | ``view.transpose(1, 2).split(D, -1)`` |
| FlexAttention (flex_attention.py) | ``[B, H, N, 2*D]`` | ``view.transpose(1, 2).split(D, -1)`` |
| FlashInfer (flashinfer.py) | ``[B, H, N, 2*D]`` | permuted to HND, split on the last axis (NVFP4: K and V head groups, not covered) |
| MLA backends (FlashMLA, FlashAttn MLA, Triton MLA, CUTLASS MLA, FlashInfer MLA) | ``[B, 1, N, latent]`` | one latent vector per token |

So every one of them keeps ``K | V`` side by side in each head vector (``BACKEND_SPLIT``): the
adapter describes that as a fused cache (``KVSpec.kv_fused``), element for element.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer import Agent, AgentConfig, LayoutError, ReadRequest
from kvxfer.layout.oracle import Arena, logical_kv
from kvxfer.testing import FakeBackend, FakeWorld, MemoryNetwork, MemoryTransport
from kvxfer_vllm.cache import describe_cache

kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

_LAYOUTS = importlib.util.spec_from_file_location(
    "vllm_layouts", Path(__file__).resolve().parents[1] / "gpu" / "vllm_layouts.py")
vllm_layouts = importlib.util.module_from_spec(_LAYOUTS)
_LAYOUTS.loader.exec_module(vllm_layouts)
layout_views = vllm_layouts.layout_views

N, BS, H, D, L = 6, 16, 2, 64, 3
BACKEND_SPLIT = ("FlashAttention", "Triton", "FlexAttention", "FlashInfer")
DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def vllm_caches(spec, layout: KVCacheLayout, num_layers: int = L, num_blocks: int = N) -> list[torch.Tensor]:
    """The per-layer views vLLM 0.32's model runner hands the connector (one KV-cache group)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    groups = [kv_iface.KVCacheGroupSpec(names, spec)]
    per_block = _get_kv_cache_bytes_per_block(groups, layout)
    layer_stride, block_stride, *_ = kv_iface.compute_layout_strides(
        spec, num_blocks, num_layers, layout,
        fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None))
    tensor = kv_iface.KVCacheTensor(size=per_block * num_blocks, layers=names, layer_stride=layer_stride,
                                    block_stride=block_stride)
    config = kv_iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=groups)
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    return [views[name] for name in names]


def attention(heads: int = H, dtype=torch.float16):
    return kv_iface.FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=D, dtype=dtype)


def mla(dtype=torch.bfloat16):
    return kv_iface.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=dtype)


def backing(caches: list[torch.Tensor]) -> Arena:
    """An arena over the one allocation every layer's view shares."""
    raw = torch.empty(0, dtype=torch.uint8).set_(caches[0].untyped_storage())
    return Arena.wrap(raw.numpy())


def describe(caches, heads=H, head=D, *, tp_rank=0, tp_size=1, is_mla=False):
    return describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=heads, head_size=head,
                          tp_rank=tp_rank, tp_size=tp_size, model="m", mla=is_mla, cpu_kernel=False)


def registered(desc, name="a", world=None, network=None, port=7400):
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port)
    agent = Agent(name, desc.spec, config, backend=FakeBackend(name, world or FakeWorld()),
                  transport=MemoryTransport(network or MemoryNetwork()))
    agent.register(desc.tensors)
    return agent


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def mark_heads(caches: list[torch.Tensor]) -> dict[tuple[int, int, int], int]:
    """Write one byte value per (layer, block, head) through vLLM's own views (all its K and V bytes)."""
    marks, value = {}, 1
    for layer, view in enumerate(caches):
        raw = view.view(torch.uint8)
        for b in range(view.shape[0]):
            for h in range(view.shape[1]):
                raw[b, h] = value
                marks[layer, b, h] = value
                value = value % 251 + 1
    return marks


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("spec", [attention(), attention(dtype=torch.float8_e4m3fn), mla()], ids=["fp16", "fp8", "mla"])
def test_layout_table_matches_vllm(layout, spec):
    """tests/gpu/vllm_layouts.py (used where vLLM is not installed) builds vLLM's own tensors."""
    want = vllm_caches(spec, layout)
    got = layout_views(num_layers=L, num_blocks=N, heads=spec.num_kv_heads, block_size=BS,
                       content=want[0].shape[-1], dtype=spec.dtype, layout=layout.name)
    base_w, base_g = want[0].data_ptr(), got[0].data_ptr()
    for w, g in zip(want, got):
        assert (w.shape, w.stride(), w.dtype) == (g.shape, g.stride(), g.dtype)
        assert w.data_ptr() - base_w == g.data_ptr() - base_g


# ---- what the adapter says about each layout ---------------------------------------------

@pytest.mark.parametrize("layout, storage, kv_layout", [
    (KVCacheLayout.LBHNC, "split", "HND"),        # the connector's default
    (KVCacheLayout.LBNHC, "split", "NHD"),
    (KVCacheLayout.BLHNC, "cross_layer", "HND"),  # cross-layer blocks
    (KVCacheLayout.BLNHC, "cross_layer", "NHD"),
])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_backend_caches_are_described_exactly(layout, storage, kv_layout, dtype):
    caches = vllm_caches(attention(dtype=dtype), layout)
    desc = describe(caches)
    assert (desc.spec.storage.value, desc.spec.layout.value, desc.spec.dtype) == \
        (storage, kv_layout, str(dtype).removeprefix("torch."))
    assert desc.spec.kv_fused and desc.spec.head_dim == 2 * D and desc.spec.kv_count == 1
    assert desc.head_slices_exact and not desc.same_format_only
    _fill(caches, seed=7)
    agent = registered(desc)
    try:
        # the oracle, reading the registered spec, finds every token's K | V vector of every head
        # where vLLM's backends read it: view[block, head, token]
        got = logical_kv(agent.cache, backing(caches), list(range(N)))  # [layers, 1, tokens, heads, bytes]
        for layer, view in enumerate(caches):
            want = view.view(torch.uint8).permute(0, 2, 1, 3).reshape(N * BS, H, -1).numpy()
            assert np.array_equal(got[layer, 0], want), layer
    finally:
        agent.close()


@pytest.mark.parametrize("layout", [KVCacheLayout.LHBNC, KVCacheLayout.BHLNC])
def test_layouts_with_heads_outside_blocks_are_refused_naming_them(layout):
    with pytest.raises(LayoutError, match="LHBNC or BHLNC"):
        describe(vllm_caches(attention(), layout))


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_mla_caches_are_described_exactly(layout):
    caches = vllm_caches(mla(), layout)
    if layout in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC) and caches[0].stride(0) not in (BS * 576, L * BS * 576):
        pytest.skip("no MLA block placement to describe")  # not reached: H = 1 makes them plain
    desc = describe(caches, heads=1, head=576, is_mla=True)
    g = torch.Generator().manual_seed(1)
    for view in caches:
        view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
    agent = registered(desc)
    try:
        got = logical_kv(agent.cache, backing(caches), list(range(N)))  # [layers, 1, tokens, 1, bytes]
        for layer, view in enumerate(caches):
            want = bytes_of(view[:, 0])  # the latent vectors the MLA backends read, token order
            assert np.array_equal(got[layer, 0, :, 0].reshape(-1), want), layer
    finally:
        agent.close()


def test_the_cpu_kernels_order_is_not_assumed_for_a_gpu_backends_cache():
    caches = vllm_caches(attention(dtype=torch.float32), KVCacheLayout.LBHNC)
    cpu = describe_cache(caches, num_blocks=N, block_size=BS, num_kv_heads=H, head_size=D, tp_rank=0,
                         tp_size=1, model="m", cpu_isa="vec", cpu_kernel=True)
    gpu = describe(caches)
    assert cpu.spec.k_dim_chunk == 1 and not cpu.spec.kv_fused        # what vLLM's CPU kernel writes
    assert gpu.spec.k_dim_chunk == 0 and gpu.spec.kv_fused            # FlashAttention & co: K | V per vector


# ---- moves between Agents: TP 1->1, 2->1, 1->2, fp8, MLA, HND <-> NHD ---------------------------

class _Pair:
    def __init__(self):
        self.world, self.network, self.agents, self.port = FakeWorld(), MemoryNetwork(), [], 7500

    def agent(self, name, desc):
        if desc.spec.tp_rank == 0:
            self.port += 10  # one instance's ranks share a base port: rank r listens at base + r
        a = registered(desc, name, self.world, self.network, self.port)
        a.listen()
        self.agents.append(a)
        return a, ("127.0.0.1", self.port)  # the instance's address (its rank 0)

    def close(self):
        for a in self.agents:
            a.close()


def _read(agent, address, dst, src, same_format=False):
    """As the connector's worker reads (``same_format`` where the cache is described ``same_format_only``)."""
    return agent.read_many([ReadRequest(address, dst, src, "req", same_format=same_format)])[0].wait(10)


def _fill(caches, seed):
    g = torch.Generator().manual_seed(seed)
    for view in caches:
        view.view(torch.uint8).copy_(torch.randint(0, 256, view.view(torch.uint8).shape, generator=g,
                                                   dtype=torch.uint8))


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_lbhnc_caches_move_byte_exact_across_tp(p_tp, d_tp, dtype):
    pair = _Pair()
    try:
        src, dst = [1, 4, 2], [0, 5, 3]
        producers, p_caches = [], []
        for r in range(p_tp):
            caches = vllm_caches(attention(H // p_tp, dtype), KVCacheLayout.LBHNC)
            _fill(caches, seed=10 + r)
            agent, address = pair.agent(f"p{r}", describe(caches, tp_rank=r, tp_size=p_tp))
            agent.hold("req", src)
            producers.append(address)
            p_caches.append(caches)
        for r in range(d_tp):
            caches = vllm_caches(attention(H // d_tp, dtype), KVCacheLayout.LBHNC)
            agent, _ = pair.agent(f"d{r}", describe(caches, tp_rank=r, tp_size=d_tp))
            _read(agent, producers[0], dst, src)
            for layer in range(L):
                for i, h in enumerate(range(r * H // d_tp, (r + 1) * H // d_tp)):  # global heads of this rank
                    pr, ph = divmod(h, H // p_tp)
                    want = p_caches[pr][layer][src, ph]
                    assert torch.equal(caches[layer][dst, i].view(torch.uint8), want.view(torch.uint8)), (layer, h)
    finally:
        pair.close()


def test_mla_and_cross_layer_caches_move_byte_exact():
    pair = _Pair()
    try:
        for spec, layout, is_mla, head in ((mla(), KVCacheLayout.LBHNC, True, 576),
                                           (mla(), KVCacheLayout.BLHNC, True, 576),
                                           (attention(), KVCacheLayout.BLHNC, False, D),
                                           (attention(), KVCacheLayout.LBNHC, False, D)):
            heads = 1 if is_mla else H
            p = vllm_caches(spec, layout)
            d = vllm_caches(spec, layout)
            _fill(p, seed=3)
            producer, address = pair.agent(f"p-{layout.name}-{is_mla}", describe(p, heads, head, is_mla=is_mla))
            consumer, _ = pair.agent(f"d-{layout.name}-{is_mla}", describe(d, heads, head, is_mla=is_mla))
            producer.hold("req", [0, 3])
            _read(consumer, address, [5, 1], [0, 3], same_format=describe(d, heads, head, is_mla=is_mla).same_format_only)
            for layer in range(L):
                assert torch.equal(d[layer][[5, 1]].view(torch.uint8), p[layer][[0, 3]].view(torch.uint8))
                assert not d[layer][[0, 2, 3, 4]].view(torch.uint8).any()
    finally:
        pair.close()


@pytest.mark.parametrize("p_layout, d_layout", [
    (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC), (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC),
    (KVCacheLayout.BLHNC, KVCacheLayout.LBNHC), (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC),
], ids=lambda x: x.name)
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_hnd_and_nhd_gpu_caches_convert_byte_exact(p_layout, d_layout, p_tp, d_tp, dtype):
    """A decode cache of the other layout (and TP size) gets every K | V vector where its own layout
    keeps it: compared in vLLM's logical ``[blocks, heads, tokens, K | V]`` view on both sides."""
    pair = _Pair()
    try:
        src, dst = [1, 4, 2], [0, 5, 3]
        producers, p_caches = [], []
        for r in range(p_tp):
            caches = vllm_caches(attention(H // p_tp, dtype), p_layout)
            _fill(caches, seed=20 + r)
            agent, address = pair.agent(f"p{r}", describe(caches, tp_rank=r, tp_size=p_tp))
            agent.hold("req", src)
            producers.append(address)
            p_caches.append(caches)
        for r in range(d_tp):
            caches = vllm_caches(attention(H // d_tp, dtype), d_layout)
            agent, _ = pair.agent(f"d{r}", describe(caches, tp_rank=r, tp_size=d_tp))
            _read(agent, producers[0], dst, src)
            for layer in range(L):
                for i, h in enumerate(range(r * H // d_tp, (r + 1) * H // d_tp)):
                    pr, ph = divmod(h, H // p_tp)
                    want = p_caches[pr][layer][src, ph]
                    assert torch.equal(caches[layer][dst, i].view(torch.uint8), want.view(torch.uint8)), (layer, h)
                assert not caches[layer][[1, 2, 4]].view(torch.uint8).any()
    finally:
        pair.close()


def test_a_fused_cache_and_a_split_one_do_not_pair():
    """A vLLM GPU cache (K | V in one vector) and a cache of separate K and V (kvxfer-hf, another
    engine) are not the same cache: the handshake refuses it typed (the compat hash covers kv_fused)
    and nothing lands."""
    from kvxfer import IncompatiblePeerError, KVSpec

    pair = _Pair()
    try:
        d = vllm_caches(attention(dtype=torch.float16), KVCacheLayout.LBHNC)
        consumer, _ = pair.agent("d", describe(d))
        # head_dim 2D, as the fused description says: only kv_fused tells the two apart
        split = KVSpec(num_layers=L, num_kv_heads=H, head_dim=2 * D, block_size=BS, num_blocks=N, dtype="float16",
                       layout="HND", model="m")
        from types import SimpleNamespace

        other = SimpleNamespace(spec=split, tensors=[torch.ones(s, dtype=torch.float16) for s in split.tensor_shapes()])
        producer, address = pair.agent("p", other)
        producer.hold("req", [0])
        with pytest.raises(IncompatiblePeerError, match="compat hash .*kv_fused"):
            _read(consumer, address, [1], [0])
        assert not d[0].view(torch.uint8).any()
    finally:
        pair.close()


# ---- the GPU host's script, run here over NIXL in host memory (real processes) ------------------

@pytest.mark.parametrize("name", ["tp2-1-lbhnc-bf16", "tp1-2-lbhnc-fp8", "tp2-1-mla", "tp2-1-lbnhc-to-lbhnc-fp8",
                                  "tp1-2-lbhnc-to-lbnhc-bf16", "tp1-1-blhnc-to-lbnhc-bf16"])
def test_the_gpu_scripts_cases_hold_in_host_memory(name):
    """tests/gpu/test_vllm_caches_gpu.py's cases with ``cpu`` tensors: its producer processes, NIXL
    reads and byte checks run here, so on the GPU host only the GPU memory is new."""
    gpu_script = _gpu_script()
    gpu_script.run_case(name, "cpu", "cpu")


def _gpu_script():
    pytest.importorskip("nixl._api")
    import sys

    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)  # tests/gpu is the package ``gpu`` (spawned producers import it by name)
    from gpu import test_vllm_caches_gpu

    return test_vllm_caches_gpu
