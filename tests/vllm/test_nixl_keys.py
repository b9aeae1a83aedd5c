"""vLLM 0.32 NixlConnector's kv_connector_extra_config keys, read by KvxferConnector (docs/vllm.md,
"Configuration keys"): each honoured with vLLM's meaning and default, or refused at start-up naming it."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from kvxfer import Agent, AgentConfig, ConfigError, KVSpec
from kvxfer.testing import wait_for
from kvxfer_vllm import settings as settings_module
from kvxfer_vllm.metadata import HeartbeatOrder, StepOrders
from kvxfer_vllm.scheduler import KvxferScheduler
from kvxfer_vllm.settings import Settings
from test_worker_loads import _Peers, _worker


def config(extra=None, **ktc):
    base = dict(kv_role="kv_both", kv_load_failure_policy="fail", kv_connector_extra_config=extra or {},
                enable_permute_local_kv=False, kv_buffer_device="cpu")
    base.update(ktc)
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(**base),
                           parallel_config=SimpleNamespace(data_parallel_rank=0))


# ---- kv_lease_duration ------------------------------------------------------------------

def test_kv_lease_duration_is_the_producers_lease_and_sets_the_heartbeat():
    s = Settings.from_vllm(config({"kv_lease_duration": 12}), environ={})
    assert (s.lease, s.heartbeat_interval, s.agent_config().lease_timeout) == (12.0, 2.0, 12.0)


def test_kv_lease_duration_defaults_to_vllms_30_seconds():
    assert Settings.from_vllm(config(), environ={}).agent_config().lease_timeout == 30.0


def test_kv_lease_duration_wins_over_the_old_environment_variable():
    env = {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "480", "KVXFER_LEASE_TIMEOUT": "99"}
    assert Settings.from_vllm(config({"kv_lease_duration": "45"}), environ=env).lease == 45.0
    assert Settings.from_vllm(config(), environ=env).lease == 480.0
    assert Settings.from_vllm(config(), environ={"KVXFER_LEASE_TIMEOUT": "99"}).lease == 99.0


@pytest.mark.parametrize("bad", [0, -5, "soon", True, float("nan")])
def test_bad_kv_lease_duration_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="kv_lease_duration"):
        Settings.from_vllm(config({"kv_lease_duration": bad}), environ={})


def _queued(request_id, remote_id, port=5600):
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_request_id": remote_id,
              "remote_host": "127.0.0.1", "remote_port": port, "remote_engine_id": "p", "tp_size": 1}
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, num_prompt_tokens=8,
                           status=None)


def test_a_decode_heartbeats_queued_requests_every_sixth_of_the_lease():
    now = [100.0]
    s = Settings.from_vllm(config({"kv_lease_duration": 6}, kv_role="kv_consumer"), environ={})
    sched = KvxferScheduler(s, engine_id="d", tp_size=1, block_size=4, clock=lambda: now[0])
    sched.on_new_request(_queued("a", "ra"))
    sched.on_new_request(_queued("b", "rb", port=5700))
    sched.on_new_request(SimpleNamespace(request_id="c", kv_transfer_params=None))  # not P/D: ignored
    now[0] += 0.5
    assert sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).heartbeats == []  # < 1 s
    now[0] += 0.6
    beats = sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).heartbeats
    assert sorted(beats, key=lambda b: b.port) == [HeartbeatOrder("127.0.0.1", 5600, ("ra",)),
                                                   HeartbeatOrder("127.0.0.1", 5700, ("rb",))]
    sched.finished(sched_request := _queued("a", "ra"), [])  # aborted while queued: no more beats
    assert sched_request.kv_transfer_params["do_remote_prefill"] is False
    now[0] += 1.1
    beats = sched.build_orders(SimpleNamespace(num_scheduled_tokens={})).heartbeats
    assert beats == [HeartbeatOrder("127.0.0.1", 5700, ("rb",))]


def test_heartbeats_keep_a_producers_hold_past_its_lease():
    peers = _Peers()
    try:
        prod, _ = peers.agent("p", 7100, seed=1, lease_timeout=1.0)
        cons, _ = peers.agent("d", 7101, seed=2)
        prod.hold("kept", [1, 2])
        prod.hold("forgotten", [3])
        worker = _worker(cons)
        end = time.monotonic() + 2.5
        while time.monotonic() < end:  # the scheduler's orders, one every 0.2 s
            worker.apply(StepOrders(heartbeats=[HeartbeatOrder("127.0.0.1", 7100, ("kept",))]))
            time.sleep(0.2)
        assert wait_for(lambda: not prod.holding("forgotten"), 5)
        assert prod.holding("kept")
        worker.close()
    finally:
        peers.close()


# ---- engine_ttl, enforce_handshake_compat, bidirectional_kv_xfer ----------------------------

@pytest.mark.parametrize("extra, key", [
    ({"engine_ttl": 3600}, "engine_ttl"),
    ({"engine_ttl": "1.5"}, "engine_ttl"),
    ({"engine_ttl": "never"}, "engine_ttl"),
    ({"enforce_handshake_compat": False}, "enforce_handshake_compat"),
    ({"enforce_handshake_compat": "false"}, "enforce_handshake_compat"),
    ({"enforce_handshake_compat": "sometimes"}, "enforce_handshake_compat"),
    ({"bidirectional_kv_xfer": True}, "bidirectional_kv_xfer"),
    ({"bidirectional_kv_xfer": "True", "decoder_kv_blocks_ttl": 480}, "bidirectional_kv_xfer"),
    ({"decoder_kv_blocks_ttl": "long"}, "decoder_kv_blocks_ttl"),
    ({"kv_recompute_threshold": -1}, "kv_recompute_threshold"),
    ({"num_threads": -1}, "num_threads"),
    ({"num_threads": "four"}, "num_threads"),
])
def test_keys_kvxfer_cannot_honour_are_refused_at_start_up_naming_them(extra, key):
    with pytest.raises(ConfigError, match=key):
        Settings.from_vllm(config(extra), environ={})


@pytest.mark.parametrize("extra", [
    {"engine_ttl": 0}, {"engine_ttl": -1},           # vLLM: never forget a remote engine, as kvxfer
    {"enforce_handshake_compat": True},              # vLLM's default: kvxfer always checks
    {"bidirectional_kv_xfer": False, "decoder_kv_blocks_ttl": 480, "kv_recompute_threshold": 64},
])
def test_values_kvxfer_honours_are_accepted(extra):
    Settings.from_vllm(config(extra), environ={})


# ---- num_threads --------------------------------------------------------------------------

def test_num_threads_defaults_to_vllms_4_and_reaches_the_agent_config():
    assert Settings.from_vllm(config(), environ={}).agent_config().num_threads == 4
    assert Settings.from_vllm(config({"num_threads": "2"}), environ={}).agent_config().num_threads == 2


def test_num_threads_reaches_the_nixl_backend():
    pytest.importorskip("nixl._api")
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=2, dtype="float16", model="m")
    with Agent("threads", spec, AgentConfig(num_threads=2, nixl_progress_thread=False)) as agent:
        assert agent._backend.num_threads == 2


# ---- unknown keys ---------------------------------------------------------------------------

def test_an_unknown_key_is_logged_once_as_vllm_ignores_it(caplog, monkeypatch):
    monkeypatch.setattr(settings_module, "_warned_unknown", set())
    with caplog.at_level(logging.WARNING, logger="vllm.kvxfer_vllm.settings"):
        Settings.from_vllm(config({"kv_lease_duraton": 10}), environ={})
        Settings.from_vllm(config({"kv_lease_duraton": 10}), environ={})
    warned = [r for r in caplog.records if "kv_lease_duraton" in r.getMessage()]
    assert len(warned) == 1
