"""Every public call refuses a malformed argument at once with ConfigError naming the argument
and the value, and changes nothing: no request booked, held or cancelled, so the same id works
right after. (Block ids have their own tests: tests/layout.)"""

import numpy as np
import pytest

from kvxfer import AgentConfig, ConfigError, KVSpec, LayoutError, ReadRequest, RequestState

from agent_helpers import spec, wait_for

NOT_AN_ID = [None, 7, b"r", ("r",), ""]
NOT_SECONDS = ["5", -1.0, 0, True, float("nan"), float("inf"), [1]]
NOT_AN_ADDRESS = ["host:5600", None, ("h",), ("h", 1, 2), ("", 5600), (None, 5600), ("h", "port"), ("h", 70000),
                  ("h", -1), ("h", True), ("h", 1.5)]


@pytest.fixture
def pair(harness):
    s = spec()
    cons, ccache = harness.agent(s, seed=2)
    prod, pcache = harness.agent(s, seed=1)
    return s, cons, ccache, prod, pcache


def _unchanged(*agents):
    return [a.stats() for a in agents]


def _read_works(s, cons, ccache, prod, pcache, rid="r"):
    prod.hold(rid, [1, 2])
    cons.read(prod.address, [3, 4], [1, 2], rid).wait(5)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [3, 4]], pcache[layer][:, [1, 2]])


@pytest.mark.parametrize("bad", NOT_AN_ID)
def test_a_request_id_that_is_not_a_non_empty_str_is_refused_by_every_call(pair, bad):
    s, cons, ccache, prod, pcache = pair
    before = _unchanged(cons, prod)
    calls = {
        "hold": lambda: prod.hold(bad, [1]),
        "release": lambda: prod.release(bad),
        "holding": lambda: prod.holding(bad),
        "status": lambda: prod.status(bad),
        "read": lambda: cons.read(prod.address, [3], [1], bad),
        "read_many": lambda: cons.read_many([ReadRequest(prod.address, [3], [1], "ok"),
                                             ReadRequest(prod.address, [4], [2], bad)]),
        "write": lambda: prod.write(cons.address, [1], [0], bad),
        "open_writes": lambda: prod.open_writes(cons.address, bad),
        "announce": lambda: cons.announce(prod.address, bad, [0]),
        "expect_writes": lambda: cons.expect_writes(bad),
        "abort": lambda: cons.abort(bad, prod.address, wait=False),
        "keepalive": lambda: cons.keepalive(prod.address, ["ok", bad]),
        "take_aux": lambda: cons.take_aux(bad),
        "announced": lambda: prod.announced(bad),
    }
    for name, call in calls.items():
        with pytest.raises(ConfigError, match=r"request_id|request ids") as info:
            call()
        assert repr(bad) in str(info.value), (name, str(info.value))
    assert _unchanged(cons, prod) == before
    assert cons.status("ok") is RequestState.UNKNOWN      # the batch's good read was not booked
    _read_works(s, cons, ccache, prod, pcache, "ok")


@pytest.mark.parametrize("bad", NOT_SECONDS)
def test_a_timeout_or_lease_that_is_not_positive_finite_seconds_is_refused(pair, bad):
    s, cons, ccache, prod, pcache = pair
    before = _unchanged(cons, prod)
    calls = {
        "read": lambda: cons.read(prod.address, [3], [1], "r", timeout=bad),
        "read_many": lambda: cons.read_many([ReadRequest(prod.address, [3], [1], "r", timeout=bad)]),
        "write": lambda: prod.write(cons.address, [1], [0], "r", timeout=bad),
        "open_writes": lambda: prod.open_writes(cons.address, "r", timeout=bad),
        "announce": lambda: cons.announce(prod.address, "r", [0], timeout=bad),
        "hold": lambda: prod.hold("r", [1], lease=bad),
    }
    for name, call in calls.items():
        with pytest.raises(ConfigError, match=r"(timeout|lease) must be a positive, finite number of seconds") as info:
            call()
        assert repr(bad) in str(info.value), (name, str(info.value))
    assert _unchanged(cons, prod) == before and prod.status("r") is RequestState.UNKNOWN
    _read_works(s, cons, ccache, prod, pcache)


@pytest.mark.parametrize("bad", NOT_AN_ADDRESS)
def test_a_remote_that_is_not_a_host_and_port_is_refused_before_anything_changes(pair, bad):
    s, cons, ccache, prod, pcache = pair
    prod.hold("r", [1, 2])
    before = _unchanged(cons, prod)
    calls = {
        "read": lambda: cons.read(bad, [3], [1], "r"),
        "write": lambda: prod.write(bad, [1], [0], "w"),
        "open_writes": lambda: prod.open_writes(bad, "w"),
        "announce": lambda: cons.announce(bad, "a", [0]),
        "keepalive": lambda: cons.keepalive(bad, ["r"]),
    }
    if bad is not None:  # abort's remote may be None: "the producer this agent knows"
        calls["abort"] = lambda: cons.abort("r", bad)
    if isinstance(bad, tuple) and len(bad) == 2:
        calls["connect"] = lambda: cons.connect(*bad)
    for name, call in calls.items():
        with pytest.raises(ConfigError, match=r"must be a \(host, port\) pair|port number in \[0, 65535\]") as info:
            call()
        assert repr(bad) in str(info.value) or repr(bad[1]) in str(info.value), (name, str(info.value))
    assert _unchanged(cons, prod) == before and prod.status("r") is RequestState.HELD
    cons.read(prod.address, [3, 4], [1, 2], "r").wait(5)     # nothing was cancelled: the read works


def test_other_slips_are_refused_naming_the_value(pair):
    s, cons, ccache, prod, pcache = pair
    with pytest.raises(ConfigError, match="request_ids must be a list of request ids, not one str; got 'r'"):
        cons.keepalive(prod.address, "r")          # a lone id where a list belongs
    with pytest.raises(ConfigError, match="consumer engines must be a list of non-empty names; got 3"):
        prod.hold("r", [1], consumer_engines=3)
    with pytest.raises(ConfigError, match="read_many's requests must be a list; got None"):
        cons.read_many(None)
    with pytest.raises(ConfigError, match="same_format must be True or False; got 'no'"):
        cons.read_many([ReadRequest(prod.address, [3], [1], "sf", same_format="no")])  # "no" is truthy
    with pytest.raises(ConfigError, match="replace must be True or False; got 'no'"):
        prod.hold("sw", [1], replace="no")
    with pytest.raises(ConfigError, match="wait must be True or False; got 'no'"):
        cons.abort("sw", prod.address, wait="no")
    with pytest.raises(ConfigError, match="refresh must be True or False; got 1"):
        cons.connect(*prod.address, refresh=1)
    assert prod.status("sw") is RequestState.UNKNOWN
    with pytest.raises(ConfigError, match="payload must be bytes; got str"):
        cons.announce(prod.address, "a", [0], payload="text")
    prod.hold("r", [1, 2])
    handle = cons.read(prod.address, [3, 4], [1, 2], "r")
    with pytest.raises(ConfigError, match="a done-callback must be callable; got 1"):
        handle.add_done_callback(1)
    with pytest.raises(ConfigError, match="wait's timeout must be a number of seconds or None; got 'soon'"):
        handle.wait("soon")
    handle.wait(5)                                 # the read itself went on, exact
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [3, 4]], pcache[layer][:, [1, 2]])


def test_read_many_takes_any_iterable_of_requests_once(pair):
    s, cons, ccache, prod, pcache = pair
    prod.hold("g1", [1])
    prod.hold("g2", [2])
    handles = cons.read_many(ReadRequest(prod.address, [3 + i], [1 + i], f"g{1 + i}") for i in range(2))
    assert [h.request_id for h in handles] == ["g1", "g2"]
    for h in handles:
        h.wait(5)
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [3, 4]], pcache[layer][:, [1, 2]])


@pytest.mark.parametrize("field, bad", [
    ("side_channel_host", ""), ("side_channel_host", 5), ("side_channel_port", 70000), ("side_channel_port", "x"),
    ("side_channel_port", True), ("dp_rank", -1), ("dp_rank", True), ("backends", None), ("backends", ()),
    ("backends", "UCX"), ("lease_timeout", float("nan")), ("lease_timeout", True), ("handshake_timeout", float("inf")),
    ("transfer_timeout", "5"), ("transfer_timeout", 0), ("auth_key", 5), ("allow_conversion", "yes"),
    ("max_message_bytes", 1024), ("max_message_bytes", "4MiB"), ("staging_bytes", True), ("pipeline_slots", True),
])
def test_agent_config_refuses_a_malformed_field_naming_it_and_the_value(field, bad):
    with pytest.raises(ConfigError, match=field.replace("_", ".") if field != "auth_key" else "auth_key") as info:
        AgentConfig(**{field: bad})
    assert field in str(info.value)
    assert field == "auth_key" or repr(bad) in str(info.value)


def test_agent_config_keeps_good_values_and_normalizes_them():
    cfg = AgentConfig(side_channel_port="5600", lease_timeout=np.float32(2.5), dp_rank=np.int64(1),
                      backends=["UCX"], auth_key="k", transfer_timeout=None)
    assert (cfg.side_channel_port, cfg.lease_timeout, cfg.dp_rank, cfg.backends, cfg.auth_key) == \
        (5600, 2.5, 1, ("UCX",), b"k")
    assert type(cfg.dp_rank) is int and type(cfg.lease_timeout) is float


@pytest.mark.parametrize("field, bad", [("dtype", ["float16"]), ("model", None), ("model", 3), ("mla", "no")])
def test_kvspec_refuses_a_malformed_field_naming_it_and_the_value(field, bad):
    base = dict(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=8, dtype="float16")
    base[field] = bad
    with pytest.raises(LayoutError, match=field) as info:
        KVSpec(**base)
    assert repr(bad) in str(info.value)


def test_a_write_stream_refuses_an_aux_that_is_not_bytes_and_an_abort_that_is_no_error(pair):
    s, cons, ccache, prod, pcache = pair
    cons.announce(prod.address, "w", [0])
    stream = prod.open_writes(cons.address, "w")
    stream.write([1], [0])
    for bad in (5, "text", None):   # bytes(5) would have been five zero bytes
        with pytest.raises(ConfigError, match=f"aux payload must be bytes; got {type(bad).__name__}"):
            stream.finish(bad)
    with pytest.raises(ConfigError, match="abort takes the error to fail the stream with; got 'stop'"):
        stream.abort("stop")
    stream.finish(b"aux").wait(5)                # neither slip finished or failed the stream
    assert wait_for(lambda: cons.status("w") is RequestState.RECEIVED)   # once its write is counted too
    assert cons.take_aux("w") == {prod.engine_id: b"aux"}
    for layer in range(s.num_layers):
        np.testing.assert_array_equal(ccache[layer][:, [0]], pcache[layer][:, [1]])


def test_counts_may_be_numpy_integers(pair):
    s, cons, ccache, prod, pcache = pair
    prod.hold("c", [1], consumers=np.int64(1))
    cons.expect_writes("e", np.int64(1), writes=np.int32(1))
    cons.read(prod.address, [3], [1], "c").wait(5)
