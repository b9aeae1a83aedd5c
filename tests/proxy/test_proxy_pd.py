"""The pure P/D request rewriting (layer: tests)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.proxy.pd import (PREFILL_KV_TRANSFER_PARAMS, BadRequest, BadUpstream, decode_body, parse_client_body,
                             parse_prefill_response, prefill_body)

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=10)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.booleans(), st.booleans())
def test_prefill_body_rewrites_exactly_the_contract_fields(body, with_mct, with_opts):
    if with_mct:
        body["max_completion_tokens"] = 77
    if with_opts:
        body["stream_options"] = {"include_usage": True}
    before = copy.deepcopy(body)
    out = prefill_body(body)
    assert body == before  # input untouched
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert out.get("max_completion_tokens") == (1 if "max_completion_tokens" in body else None)
    changed = {"max_tokens", "max_completion_tokens", "stream", "stream_options", "kv_transfer_params"}
    assert {k: v for k, v in out.items() if k not in changed} == {k: v for k, v in body.items() if k not in changed}


def test_decode_body_adds_params_without_aliasing():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    params = {"remote_block_ids": [1, 2]}
    out = decode_body(body, params)
    assert out == {**body, "kv_transfer_params": params}
    params["remote_block_ids"].append(3)
    assert out["kv_transfer_params"] == {"remote_block_ids": [1, 2]} and "kv_transfer_params" not in body


def test_prefill_kv_params_constant_is_not_shared():
    a, b = prefill_body({}), prefill_body({})
    a["kv_transfer_params"]["remote_host"] = "evil"
    assert b["kv_transfer_params"]["remote_host"] is None and PREFILL_KV_TRANSFER_PARAMS["remote_host"] is None


@pytest.mark.parametrize("raw", [b"", b"null", b'"s"', b'{"stream": 1}', b'{"max_tokens": true}',
                                 b'{"max_completion_tokens": 0}', b'{"max_tokens": 1.5}'])
def test_parse_client_body_rejects(raw):
    with pytest.raises(BadRequest):
        parse_client_body(raw)


def test_parse_client_body_accepts_null_limits():
    assert parse_client_body(b'{"max_tokens": null, "stream": false}') == {"max_tokens": None, "stream": False}


@pytest.mark.parametrize("raw", [b"oops", b"[]", b"{}", json.dumps({"kv_transfer_params": None}).encode(),
                                 json.dumps({"kv_transfer_params": [1]}).encode()])
def test_parse_prefill_response_rejects(raw):
    with pytest.raises(BadUpstream):
        parse_prefill_response(raw)


def test_parse_prefill_response_returns_the_params():
    params = {"remote_engine_id": "e", "remote_block_ids": [4], "remote_host": "h", "remote_port": 1, "tp_size": 2}
    assert parse_prefill_response(json.dumps({"id": "x", "kv_transfer_params": params}).encode()) == params
