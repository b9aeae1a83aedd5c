"""Bad input gets a typed error naming the expected and the actual value."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.layout import CacheGeometry, CacheView, KVSpec, build_plan, head_range, peer_ranks
from kvxfer.layout.oracle import Arena, place_cache


def spec(**kw) -> KVSpec:
    base = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=8, dtype="float16", model="m")
    base.update(kw)
    return KVSpec(**base)


def view(**kw) -> CacheView:
    return place_cache(spec(**kw))[0]


@pytest.mark.parametrize("field,a,b", [
    ("dtype", "float16", "bfloat16"), ("head_dim", 8, 16), ("num_layers", 2, 3),
    ("model", "m", "other"), ("num_kv_heads", 4, 8),
])
def test_mismatched_specs_name_both_values(field, a, b):
    with pytest.raises(LayoutError, match=f"{field}.*{a!r}.*{b!r}"):
        build_plan(view(**{field: a}), view(**{field: b}))


def test_mla_against_non_mla():
    mla = view(mla=True, num_kv_heads=1)
    with pytest.raises(LayoutError, match="mla.*True.*False"):
        build_plan(mla, view(num_kv_heads=1))


def test_block_sizes_must_divide():
    with pytest.raises(LayoutError, match="local has 4, remote has 6"):
        build_plan(view(block_size=4), view(block_size=6))


def test_remote_without_needed_heads():
    with pytest.raises(LayoutError, match=r"holds heads \[2, 4\).*needs heads \[0, 2\)"):
        build_plan(view(tp_size=2, tp_rank=0), view(tp_size=2, tp_rank=1))


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "fast"}, "mode must be.*'fast'"),
    ({"min_direct_bytes": -1}, "min_direct_bytes.*-1"),
])
def test_bad_plan_options(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        build_plan(view(), view(), **kwargs)


def test_not_a_cache_view():
    with pytest.raises(LayoutError, match="CacheView; got KVSpec"):
        build_plan(spec(), view())


def test_geometry_must_fit_spec():
    with pytest.raises(LayoutError, match=r"\(3, 2\).*\(2, 2\)"):
        CacheView(spec(), CacheGeometry(np.zeros((3, 2), dtype=np.uint64)))


@pytest.fixture
def plan():
    return build_plan(view(), view(block_size=8, num_blocks=4))


def test_unequal_token_coverage_names_both(plan):
    with pytest.raises(BlockIdError, match=r"local 3 blocks x 4 = 12 tokens, remote 2 blocks x 8 = 16"):
        plan.for_request([0, 1, 2], [0, 1])


@pytest.mark.parametrize("lb,rb,match", [
    ([0, 8], [0], r"local block id 8 is outside \[0, 8\)"),
    ([0, -1], [0], r"local block id -1 is outside \[0, 8\)"),
    ([0, 1], [4], r"remote block id 4 is outside \[0, 4\)"),
    ([3, 3], [1], "distinct; got 3 twice"),
    ([[0, 1]], [0], r"1-D.*\(1, 2\)"),
    ([0.0, 1.0], [0], "integers; got dtype float64"),
])
def test_bad_block_ids(plan, lb, rb, match):
    with pytest.raises(BlockIdError, match=match):
        plan.for_request(lb, rb)


def test_unpack_needs_a_staged_plan(plan):
    req = plan.for_request([0, 1], [0])
    assert req.mode == "direct"
    with pytest.raises(LayoutError, match="staged plans only"):
        req.unpack_index()


def test_unpack_checks_its_buffers():
    lv, la = place_cache(spec(layout="NHD"))
    plan = build_plan(lv, view(layout="HND"), mode="staged")
    req = plan.for_request([0], [1])
    regions = lambda layer, kv: la.view(int(lv.geometry.bases[layer, kv]), lv.spec.region_bytes)  # noqa: E731
    with pytest.raises(LayoutError, match=f"at least {req.staging_bytes} bytes; got 10"):
        req.unpack_numpy(np.zeros(10, dtype=np.uint8), regions)
    with pytest.raises(LayoutError, match="uint8"):
        req.unpack_numpy(np.zeros(req.staging_bytes, dtype=np.float32), regions)
    with pytest.raises(LayoutError, match=r"region view \(0, 0\) must hold at least"):
        req.unpack_numpy(np.zeros(req.staging_bytes, dtype=np.uint8), lambda layer, kv: np.zeros(4, np.uint8))


@pytest.mark.parametrize("kwargs,match", [
    ({"layout": "XYZ"}, "layout must be 'NHD' or 'HND'; got 'XYZ'"),
    ({"storage": "weird"}, "storage must be one of"),
    ({"tp_size": 2, "tp_rank": 2}, r"tp_rank must be in \[0, 2\); got 2"),
    ({"num_kv_heads": 6, "tp_size": 4}, r"num_kv_heads \(6\) and tp_size \(4\)"),
    ({"mla": True, "num_kv_heads": 2}, "num_kv_heads=1; got 2"),
    ({"dtype": "float64"}, "dtype must be one of.*'float64'"),
    ({"block_size": 0}, "block_size must be a positive integer; got 0"),
])
def test_spec_validation(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        spec(**kwargs)


def test_spec_takes_numpy_integers_as_plain_ints():
    s = spec(tp_size=np.int64(2), tp_rank=np.int32(1), num_blocks=np.int64(8))
    assert (s.tp_rank, s.tp_size, s.num_blocks) == (1, 2, 8)
    assert all(type(v) is int for v in (s.tp_rank, s.tp_size, s.num_blocks))
    assert s == spec(tp_size=2, tp_rank=1)
    with pytest.raises(LayoutError, match=r"tp_rank must be in \[0, 2\); got True"):
        spec(tp_size=2, tp_rank=True)


def test_tp_helpers_validate():
    with pytest.raises(LayoutError, match=r"tp_rank must be in \[0, 4\); got 4"):
        head_range(8, 4, 4)
    with pytest.raises(LayoutError, match="positive integer; got 0"):
        peer_ranks(spec(), 0)
    with pytest.raises(LayoutError, match=r"num_kv_heads \(4\) and tp_size \(3\)"):
        peer_ranks(spec(), 3)


def test_arena_refuses_out_of_range():
    a = Arena(16, base=100)
    with pytest.raises(LayoutError, match="outside the arena"):
        a.view(110, 8)
