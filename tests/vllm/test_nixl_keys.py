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
    ({"engine_ttl": "never"}, "engine_ttl"),
    ({"engine_ttl": True}, "engine_ttl"),
    ({"enforce_handshake_compat": False}, "enforce_handshake_compat"),
    ({"enforce_handshake_compat": "false"}, "enforce_handshake_compat"),
    ({"enforce_handshake_compat": "sometimes"}, "enforce_handshake_compat"),
    ({"bidirectional_kv_xfer": "maybe"}, "bidirectional_kv_xfer"),
    ({"decoder_kv_blocks_ttl": "long"}, "decoder_kv_blocks_ttl"),
    ({"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
    ({"kv_recompute_threshold": -1}, "kv_recompute_threshold"),
    ({"num_threads": -1}, "num_threads"),
    ({"num_threads": "four"}, "num_threads"),
])
def test_keys_kvxfer_cannot_honour_are_refused_at_start_up_naming_them(extra, key):
    with pytest.raises(ConfigError, match=key):
        Settings.from_vllm(config(extra), environ={})


@pytest.mark.parametrize("extra", [
    {"engine_ttl": 0}, {"engine_ttl": -1},           # vLLM: never forget a remote engine
    {"engine_ttl": 3600}, {"engine_ttl": "1.5"},      # forget one unused that long
    {"enforce_handshake_compat": True},              # vLLM's default: kvxfer always checks
    {"bidirectional_kv_xfer": False, "decoder_kv_blocks_ttl": 480, "kv_recompute_threshold": 64},
])
def test_values_kvxfer_honours_are_accepted(extra):
    Settings.from_vllm(config(extra), environ={})


def test_engine_ttl_defaults_to_vllms_hour_and_becomes_the_agents_peer_idle_ttl():
    assert Settings.from_vllm(config(), environ={}).agent_config().peer_idle_ttl == 3600.0
    assert Settings.from_vllm(config({"engine_ttl": "1.5"}), environ={}).agent_config().peer_idle_ttl == 1.5
    for never in (0, -1):
        assert Settings.from_vllm(config({"engine_ttl": never}), environ={}).agent_config().peer_idle_ttl is None


# ---- bidirectional_kv_xfer, decoder_kv_blocks_ttl, kv_recompute_threshold -----------------------

def test_bidirectional_keys_default_to_vllms_and_are_read():
    s = Settings.from_vllm(config(), environ={})
    assert (s.bidirectional, s.decoder_ttl, s.recompute_threshold) == (False, 480.0, 64)
    s = Settings.from_vllm(config({"bidirectional_kv_xfer": "True", "decoder_kv_blocks_ttl": "30",
                                   "kv_recompute_threshold": 0}), environ={})
    assert (s.bidirectional, s.decoder_ttl, s.recompute_threshold) == (True, 30.0, 0)


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return [list(self.ids)]

    def get_unhashed_block_ids_all_groups(self):
        return [list(self.ids)]


def _decoded(sched, request_id="d1"):
    """A request decoded here for a producer: queued, loaded, finished after 3 tokens of a 8-token prompt."""
    from vllm.v1.request import RequestStatus

    request = _queued(request_id, "p1")
    sched.after_alloc(request, _Blocks([5, 6, 7]), 8)
    sched.update(SimpleNamespace(finished_recving={request_id}, finished_sending=set()))
    request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 10
    return sched.finished(request, [[5, 6, 7]])


@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_decode_keeps_decoded_blocks_for_the_next_turn_only_with_bidirectional(bidirectional):
    from kvxfer_vllm.metadata import WorkerAddress

    s = Settings.from_vllm(config({"bidirectional_kv_xfer": bidirectional, "decoder_kv_blocks_ttl": 90},
                                  kv_role="kv_consumer"), environ={})
    sched = KvxferScheduler(s, engine_id="d", tp_size=1, block_size=4)
    sched.set_addresses({0: WorkerAddress("127.0.0.1", 5601, "d-engine")})
    keep, answer = _decoded(sched)
    orders = sched.build_orders(SimpleNamespace(num_scheduled_tokens={}))
    if not bidirectional:
        assert (keep, answer, orders.holds) == (False, None, {})
        return
    assert keep is True
    assert (answer["do_remote_decode"], answer["do_remote_prefill"]) == (True, False)
    assert (answer["remote_block_ids"], answer["remote_num_tokens"], answer["remote_port"]) == ([[5, 6, 7]], 10, 5601)
    assert orders.holds == {"d1": (5, 6, 7)} and orders.hold_leases == {"d1": 90.0} and orders.kept == {"d1"}


@pytest.mark.parametrize("threshold, loads", [(0, True), (10, True), (11, False)])
def test_a_prefill_loads_the_next_turn_unless_under_the_recompute_threshold(threshold, loads):
    """A kv_producer handed a decode instance's params loads its tokens (or, under the threshold,
    computes them and gives D's hold back), and holds its own blocks for the next decoder."""
    s = Settings.from_vllm(config({"bidirectional_kv_xfer": True, "kv_recompute_threshold": threshold},
                                  kv_role="kv_producer"), environ={})
    sched = KvxferScheduler(s, engine_id="p", tp_size=1, block_size=4)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[5, 6, 7]],
              "remote_request_id": "d1", "remote_host": "127.0.0.1", "remote_port": 5601,
              "remote_engine_id": "d", "tp_size": 1, "remote_num_tokens": 10, "remote_block_size": 4}
    request = SimpleNamespace(request_id="p2", kv_transfer_params=params, num_prompt_tokens=20,
                              num_computed_tokens=0)
    count, is_async = sched.matched_tokens(request, 0)
    assert (count, is_async) == ((10, True) if loads else (0, False))
    sched.after_alloc(request, _Blocks([1, 2, 3, 4, 8]), count)
    orders = sched.build_orders(SimpleNamespace(num_scheduled_tokens={}))
    if loads:
        (load,) = orders.loads
        assert (load.remote_request_id, load.local_blocks, load.remote_blocks) == ("d1", (1, 2, 3), (5, 6, 7))
        assert orders.releases == []
    else:
        assert orders.loads == [] and [r.remote_request_id for r in orders.releases] == ["d1"]
    assert sched.matched_tokens(request, 0) == (0, False)   # one load per request
    assert "p2" in sched._producing                          # its own blocks are held for the decoder


def test_without_bidirectional_a_prefill_ignores_a_decode_instances_params():
    s = Settings.from_vllm(config(kv_role="kv_producer"), environ={})
    sched = KvxferScheduler(s, engine_id="p", tp_size=1, block_size=4)
    params = {"do_remote_decode": True, "remote_block_ids": [[5]], "remote_request_id": "d1",
              "remote_host": "127.0.0.1", "remote_port": 5601, "remote_num_tokens": 4}
    assert sched.matched_tokens(SimpleNamespace(request_id="p", kv_transfer_params=params, num_prompt_tokens=9), 0) \
        == (0, False)


def test_a_next_turn_hold_lives_for_its_own_lease():
    """The worker holds with the order's lease (decoder_kv_blocks_ttl), not the agent's."""
    peers = _Peers()
    try:
        agent, _ = peers.agent("d", 7150, seed=1, lease_timeout=60.0)
        worker = _worker(agent)
        worker.apply(StepOrders(holds={"turn": (1, 2)}, hold_leases={"turn": 0.3}, kept={"turn"}))
        assert wait_for(lambda: "turn" in (agent.finished().expired or ()), timeout=5)
    finally:
        peers.close()


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


# ---- --kv-cache-dtype ------------------------------------------------------------------------

def _with_cache_dtype(name):
    cfg = config()
    cfg.cache_config = SimpleNamespace(cache_dtype=name)
    return cfg


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_4over6", "nvfp4_ds_mla", "int8_per_token_head", "turboquant_k8v4"])
def test_a_cache_dtype_kvxfer_cannot_describe_is_refused_at_start_up_naming_it(name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        Settings.from_vllm(_with_cache_dtype(name), environ={})


@pytest.mark.parametrize("name", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", None])
def test_cache_dtypes_kvxfer_describes_are_taken(name):
    assert Settings.from_vllm(_with_cache_dtype(name), environ={}).role == "kv_both"


def test_every_cache_dtype_of_this_vllm_is_taken_or_refused_by_name():
    cache = pytest.importorskip("vllm.config.cache")
    names = cache.CacheDType.__args__
    assert "nvfp4" in names and "fp8_e4m3" in names
    for name in names:
        if name in settings_module.CACHE_DTYPES:
            Settings.from_vllm(_with_cache_dtype(name), environ={})
        else:
            with pytest.raises(ConfigError, match=f"'{name}'"):
                Settings.from_vllm(_with_cache_dtype(name), environ={})
