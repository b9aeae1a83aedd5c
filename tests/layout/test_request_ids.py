"""``check_block_id_lists`` (a step's ids checked in one pass) agrees with ``check_block_ids``
list by list: the same arrays, or the same error naming the same id."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import BlockIdError
from kvxfer.layout.request import check_block_id_lists, check_block_ids, id_bounds

BOUND = 40

ids = st.lists(st.integers(min_value=-3, max_value=BOUND + 3), max_size=12)
as_array = st.sampled_from([list, lambda x: np.asarray(x, dtype=np.int64), lambda x: np.asarray(x, dtype=np.int32)])


def _one_by_one(lists):
    try:
        return [check_block_ids("local", x, BOUND) for x in lists], None
    except BlockIdError as exc:
        return None, str(exc)


def _agrees(check, want, error) -> None:
    """``check()`` raises the reference's error word for word, or returns its int64 arrays."""
    if error is not None:
        with pytest.raises(BlockIdError) as got:
            check()
        assert str(got.value) == error
        return
    got = check()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == np.int64 and a.ndim == 1
        np.testing.assert_array_equal(a, b)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ids, as_array), max_size=6))
def test_the_step_check_equals_the_check_of_each_list(raw):
    lists = [make(x) for x, make in raw]
    _agrees(lambda: check_block_id_lists("local", lists, BOUND), *_one_by_one(lists))


def test_an_id_may_repeat_across_requests_but_not_within_one():
    got = check_block_id_lists("local", [[1, 2], [2, 3]], BOUND)
    assert [a.tolist() for a in got] == [[1, 2], [2, 3]]
    with pytest.raises(BlockIdError, match="local block ids must be distinct; got 3 twice"):
        check_block_id_lists("local", [[1, 2], [3, 3]], BOUND)


@pytest.mark.parametrize("bad, message", [
    ([[0], [1.5]], "must be integers"),
    ([[0], [[1, 2]]], "must be a 1-D sequence"),
    ([[0], [True]], "must be integers"),
    ([[0], [BOUND]], f"local block id {BOUND} is outside"),
])
def test_mixed_or_malformed_lists_raise_as_one_by_one(bad, message):
    with pytest.raises(BlockIdError, match=message):
        check_block_id_lists("local", bad, BOUND)


def _numpy_path(x):
    """``check_block_ids`` the general way (numpy), bypassing the short-list path."""
    import kvxfer.layout.request as request

    saved, request._SMALL = request._SMALL, 0
    try:
        return check_block_ids("local", x, BOUND), None
    except BlockIdError as exc:
        return None, str(exc)
    finally:
        request._SMALL = saved


short_input = st.sampled_from([list, tuple, lambda x: np.asarray(x, dtype=np.int64),
                               lambda x: np.asarray(x, dtype=np.uint16), lambda x: np.asarray(x, dtype=np.int8)])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(min_value=-3, max_value=BOUND + 3), st.booleans()), max_size=12), short_input)
def test_short_lists_checked_as_python_ints_give_the_numpy_checks_result(raw, make):
    try:
        x = make(raw)
    except (OverflowError, ValueError):  # -3 as uint16: not an input anyone can pass
        return
    want, error = _numpy_path(x)
    _agrees(lambda: [check_block_ids("local", x, BOUND)], None if want is None else [want], error)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=130),
       st.sampled_from([np.int64, np.int32, np.uint64]))
def test_id_bounds_are_numpys_min_and_max_for_short_and_long_lists(values, dtype):
    if dtype is not np.int64:
        info = np.iinfo(dtype)
        values = [min(max(v, int(info.min)), int(info.max)) for v in values]
    ids = np.array(values, dtype=dtype)
    lo, hi = id_bounds(ids)
    assert (lo, hi) == (int(ids.min()), int(ids.max())) and type(lo) is int and type(hi) is int
