"""Side-channel address resolution: arguments, kvxfer and vLLM variables, rank offsets, bad values."""

from __future__ import annotations

import socket

import pytest

from kvxfer.errors import ConfigError
from kvxfer.transport.address import routable_host, side_channel_address


def test_explicit_arguments_win_over_environment():
    env = {"KVXFER_SIDE_CHANNEL_HOST": "10.0.0.9", "KVXFER_SIDE_CHANNEL_PORT": "7000"}
    assert side_channel_address("192.168.1.5", 6000, environ=env) == ("192.168.1.5", 6000)


def test_kvxfer_variables_win_over_vllm_variables():
    env = {"KVXFER_SIDE_CHANNEL_HOST": "10.0.0.9", "KVXFER_SIDE_CHANNEL_PORT": "7000",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "8000"}
    assert side_channel_address(None, None, environ=env) == ("10.0.0.9", 7000)


def test_vllm_variables_are_the_fallback():
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "8000"}
    assert side_channel_address(None, None, environ=env) == ("10.0.0.1", 8000)


def test_default_port_and_rank_offsets():
    env = {"KVXFER_SIDE_CHANNEL_HOST": "h"}
    assert side_channel_address(None, None, environ=env) == ("h", 5600)
    # dp_rank 1 of a TP-4 instance, tp_rank 2: 5600 + 1*4 + 2
    assert side_channel_address(None, None, dp_rank=1, tp_rank=2, tp_size=4, environ=env) == ("h", 5606)
    ports = {side_channel_address("h", 5600, dp, tp, 2, environ={})[1] for dp in range(3) for tp in range(2)}
    assert ports == set(range(5600, 5606))


def test_port_zero_means_ephemeral_for_every_rank():
    assert side_channel_address("h", 0, dp_rank=3, tp_rank=1, tp_size=2, environ={}) == ("h", 0)


def test_default_host_is_a_routable_ipv4_address():
    host, _ = side_channel_address(None, 5600, environ={})
    socket.inet_aton(host)
    assert host == routable_host()


@pytest.mark.parametrize(
    "env, match",
    [({"KVXFER_SIDE_CHANNEL_PORT": "56oo"}, "KVXFER_SIDE_CHANNEL_PORT must be an integer port; got '56oo'"),
     ({"VLLM_NIXL_SIDE_CHANNEL_PORT": "70000"}, r"VLLM_NIXL_SIDE_CHANNEL_PORT must be in \[0, 65535\]; got '70000'"),
     ({"KVXFER_SIDE_CHANNEL_PORT": "-1"}, "got '-1'")],
)
def test_bad_port_variables_name_the_variable_and_value(env, match):
    with pytest.raises(ConfigError, match=match):
        side_channel_address("h", None, environ=env)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="65535"):
        side_channel_address("h", 65535, dp_rank=1, environ={})
    with pytest.raises(ConfigError, match="tp_rank=2, tp_size=2"):
        side_channel_address("h", 5600, tp_rank=2, tp_size=2, environ={})
    with pytest.raises(ConfigError, match="port argument must be an integer port; got '5600x'"):
        side_channel_address("h", "5600x", environ={})
    with pytest.raises(ConfigError, match="host"):
        side_channel_address("", 5600, environ={})
