"""Agent reads between a cache that keeps K dim-major (vLLM CPU's) and an NHD cache, over FakeBackend.

The layout translator converts such a K (tests/layout/test_dim_major_k.py); the pair-copy paths
(staged pipeline, CUDA IPC) cannot express it, so ``auto`` takes the descriptor plan and a forced
pair path is a ConfigError naming both layouts, raised before anything moves.
"""

import numpy as np
import pytest

from kvxfer.errors import ConfigError

from agent_helpers import spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


def vllm_cpu(**kw):
    return spec(layout="HND", storage="head_packed", k_dim_chunk=1, block_size=8, num_blocks=6, **kw)


def logical(s, cache, blocks) -> tuple[np.ndarray, np.ndarray]:
    """K and V of ``blocks`` as ``[layers, tokens, heads, head_dim]``, read by the spec's definition."""
    ks, vs = [], []
    for t in cache:
        if s.storage.value == "head_packed":   # [blocks, heads, 2, bs, d]; K's bytes are [d, bs]
            b = t[blocks]
            n, h, _, bs, d = b.shape
            k = (b[:, :, 0].reshape(n, h, d, bs).transpose(0, 3, 1, 2) if s.k_dim_major
                 else b[:, :, 0].transpose(0, 2, 1, 3))
            v = b[:, :, 1].transpose(0, 2, 1, 3)
        else:                                   # split NHD: [2, blocks, bs, heads, d]
            k, v = t[0][blocks], t[1][blocks]
        ks.append(k.reshape(-1, *k.shape[2:]))
        vs.append(v.reshape(-1, *v.shape[2:]))
    return np.stack(ks), np.stack(vs)


@pytest.mark.parametrize("producer,consumer", [(vllm_cpu(), spec()), (spec(), vllm_cpu())],
                         ids=["vllm-cpu-to-nhd", "nhd-to-vllm-cpu"])
def test_auto_read_converts_a_dim_major_k_exactly(harness, producer, consumer):
    prod, pcache = harness.agent(producer, seed=1, **STAGED)   # offers staged reads: auto must not take them
    cons, ccache = harness.agent(consumer, seed=2, listen=False)
    tokens = 16
    pb = [4, 1][:tokens // producer.block_size] if producer.block_size == 8 else [9, 2, 7, 0]
    cb = [4, 1][:tokens // consumer.block_size] if consumer.block_size == 8 else [9, 2, 7, 0]
    prod.hold("r", pb)
    stats = cons.read(prod.address, cb, pb, "r").wait(5)
    assert stats.mode != "staged"
    for got, want in zip(logical(consumer, ccache, cb), logical(producer, pcache, pb)):
        np.testing.assert_array_equal(got, want)
    assert wait_for(lambda: not prod.holding("r"))


@pytest.mark.parametrize("path", ["staged", "ipc"])
def test_forced_pair_path_names_both_layouts_and_changes_nothing(harness, path):
    prod, _ = harness.agent(vllm_cpu(), seed=1, **STAGED)
    cons, ccache = harness.agent(spec(), seed=2, listen=False, **{**STAGED, "transfer_path": path})
    prod.hold("r", [4, 1])
    before = [c.copy() for c in ccache]
    with pytest.raises(ConfigError, match=rf"transfer_path='{path}' cannot move this request: .*cannot express "
                                          r"a dim-major K: source HND/head_packed, K dim-major in chunks of 1, "
                                          r"destination NHD/split"):
        cons.read(prod.address, [9, 2, 7, 0], [4, 1], "r").wait(5)
    assert prod.holding("r")
    for got, want in zip(ccache, before):
        np.testing.assert_array_equal(got, want)
