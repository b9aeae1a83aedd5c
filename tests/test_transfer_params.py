"""kvxfer.transfer_params with several KV-cache groups: vLLM's one-list-per-group form both ways, bad input refused."""

from __future__ import annotations

import json

import pytest

from kvxfer.transfer_params import BadParams, RemotePrefill, producer_answer

ARGS = dict(request_id="r1", engine_id="e", host="10.0.0.1", port=5600, tp_size=2, num_tokens=40)


def test_one_list_per_group_round_trips_through_json():
    # full attention, sliding window (its window's blocks), SSM state (the running-state slot)
    groups = [[4, 5, 6], [5, 6], [9]]
    wire = json.loads(json.dumps(producer_answer(block_ids=groups, **ARGS)))
    assert wire["remote_block_ids"] == groups
    got = RemotePrefill.parse(wire, num_groups=3)
    assert got.groups == ((4, 5, 6), (5, 6), (9,)) and got.block_ids == (4, 5, 6)
    assert (got.request_id, got.tp_size, got.num_tokens) == ("r1", 2, 40)


def test_vllms_tuple_of_lists_parses():
    """vLLM's NixlConnector hands ``request_finished_all_groups``' tuple of lists on as it is."""
    params = {**producer_answer(block_ids=[1], **ARGS), "remote_block_ids": ([1, 2], [], [3]), "pp_size": 1}
    assert RemotePrefill.parse(params, num_groups=3).groups == ((1, 2), (), (3,))


def test_one_group_keeps_todays_form():
    answer = producer_answer(block_ids=[4, 5], **ARGS)
    assert answer["remote_block_ids"] == [[4, 5]]
    got = RemotePrefill.parse(answer)
    assert got.block_ids == (4, 5) and got.groups == ((4, 5),)
    assert RemotePrefill.parse({**answer, "remote_block_ids": [4, 5]}).groups == ((4, 5),)   # flat, older peers
    assert RemotePrefill("r", "h", 1, (7,)).groups == ((7,),)


@pytest.mark.parametrize("raw, groups, words", [
    ([[1], [2]], 1, "2 KV-cache groups; only 1"),          # a hybrid producer, a one-group consumer
    ([[1], [2]], 3, "2 KV-cache groups; expected 3"),
    ([1, 2], 2, "expected 2 lists; got a flat list"),
    ([[1], [2, -1]], 2, r"remote_block_ids\[1\]\[i\]"),
    ([[1], "2"], 2, "one list per KV-cache group"),
    ([[1], [True]], 2, r"remote_block_ids\[1\]"),
])
def test_group_lists_that_do_not_fit_are_refused_naming_both(raw, groups, words):
    params = {**producer_answer(block_ids=[1], **ARGS), "remote_block_ids": raw}
    with pytest.raises(BadParams, match=words):
        RemotePrefill.parse(params, num_groups=groups)


def test_pipeline_parallel_producers_are_refused():
    params = {**producer_answer(block_ids=[1], **ARGS), "pp_size": 2}
    with pytest.raises(BadParams, match="pp_size must be 1; got 2"):
        RemotePrefill.parse(params)


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_num_groups_must_be_a_positive_integer(bad):
    with pytest.raises(BadParams, match="num_groups"):
        RemotePrefill.parse(producer_answer(block_ids=[1], **ARGS), num_groups=bad)


@pytest.mark.parametrize("bad, words", [
    ("1,2", "block_ids must be a list"), ([[1], [-2]], r"block_ids\[1\]"), ([1, "x"], "block_ids"),
])
def test_producer_answer_refuses_bad_ids(bad, words):
    with pytest.raises(BadParams, match=words):
        producer_answer(block_ids=bad, **ARGS)
