"""``HostPairKernel`` (the host twin the staged path uses on DRAM) against the element-level oracle."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.gpu.host import HostPairKernel
from kvxfer.layout.pairs import direct_pairs, pack_pairs, unpack_pairs

from .oracle import expected_move
from .test_pairs_cpu import CASES, _cache, _spec


@pytest.mark.parametrize("name,p_over,d_over", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("staged", [False, True])
def test_host_kernel_matches_oracle(name, p_over, d_over, staged):
    rng = np.random.default_rng(7)
    p, d = _spec(p_over), _spec(d_over)
    p_ids = rng.permutation(p.num_blocks)[:40 // p.block_size]
    d_ids = rng.permutation(d.num_blocks)[:40 // d.block_size]
    # the staging buffer is a separate allocation: the kernel must not assume one arena
    arena = rng.integers(0, 256, size=p.cache_bytes + 2 * d.cache_bytes, dtype=np.uint8)
    staging = np.zeros(4 * p.cache_bytes, dtype=np.uint8)
    p_geom, p_view = _cache(p, arena, 0)
    d_geom, d_view = _cache(d, arena, p.cache_bytes)
    _, want = _cache(d, arena, p.cache_bytes + d.cache_bytes)
    want[...] = d_view
    expected_move(p, p_view, p_ids, d, want, d_ids, 40)
    kernel = HostPairKernel()
    if staged:
        base = int(staging.ctypes.data)
        kernel.launch(pack_pairs(p, p_geom, p_ids, d, d_ids, base))
        kernel.launch(unpack_pairs(p, p_ids, d, d_geom, d_ids, base))
    else:
        kernel.launch(direct_pairs(p, p_geom, p_ids, d, d_geom, d_ids))
    assert np.array_equal(d_view, want)
