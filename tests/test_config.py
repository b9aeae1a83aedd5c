"""AgentConfig: environment variables and validation (typed errors naming the bad value)."""

import os

import pytest

from kvxfer import AgentConfig, ConfigError
from kvxfer.config import (PROGRESS_DELAY_US, PROGRESS_THREAD_MIN_CORES, parse_seconds, progress_delay_wanted,
                           progress_thread_wanted)


@pytest.mark.parametrize("raw,want", [("0", False), ("off", False), ("1", True), ("True", True), ("auto", None)])
def test_nixl_progress_thread_from_env(monkeypatch, raw, want):
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_THREAD", raw)
    assert AgentConfig.from_env().nixl_progress_thread is want


def test_nixl_progress_thread_defaults_to_auto_and_rejects_junk(monkeypatch):
    monkeypatch.delenv("KVXFER_NIXL_PROGRESS_THREAD", raising=False)
    assert AgentConfig.from_env().nixl_progress_thread is None
    assert AgentConfig().nixl_progress_thread is None
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_THREAD", "sometimes")
    with pytest.raises(ConfigError, match="KVXFER_NIXL_PROGRESS_THREAD must be 0, 1 or auto; got 'sometimes'"):
        AgentConfig.from_env()
    with pytest.raises(ConfigError, match=r"nixl_progress_thread must be True, False or None \(auto\); got 'yes'"):
        AgentConfig(nixl_progress_thread="yes")


@pytest.mark.parametrize("cores,want", [(1, PROGRESS_DELAY_US), (2, PROGRESS_DELAY_US),
                                        (PROGRESS_THREAD_MIN_CORES - 1, PROGRESS_DELAY_US),
                                        (PROGRESS_THREAD_MIN_CORES, 0), (64, 0)])
def test_auto_lets_the_progress_thread_spin_only_with_enough_cores(monkeypatch, cores, want):
    """Auto runs the thread everywhere; it counts the cores this process may run on (its
    affinity, not the machine's) to choose between spinning and waiting for UCX's events."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert progress_thread_wanted(None) is True
    assert progress_thread_wanted(True) is True and progress_thread_wanted(False) is False
    assert progress_delay_wanted(None) == want
    assert progress_delay_wanted(0) == 0 and progress_delay_wanted(5000) == 5000


def test_progress_delay_from_env_and_its_errors(monkeypatch):
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_DELAY_US", "250")
    assert AgentConfig.from_env().nixl_progress_delay_us == 250
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_DELAY_US", "auto")
    assert AgentConfig.from_env().nixl_progress_delay_us is None
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_DELAY_US", "1ms")
    with pytest.raises(ConfigError, match="KVXFER_NIXL_PROGRESS_DELAY_US must be a whole number of microseconds or auto; got '1ms'"):
        AgentConfig.from_env()
    with pytest.raises(ConfigError, match="nixl_progress_delay_us"):
        AgentConfig(nixl_progress_delay_us=-1)


@pytest.mark.parametrize("raw,want", [("9100", 9100), (" 0 ", 0), ("", None)])
def test_metrics_port_from_env(monkeypatch, raw, want):
    monkeypatch.setenv("KVXFER_METRICS_PORT", raw)
    assert AgentConfig.from_env().metrics_port == want


def test_metrics_port_defaults_off_and_overrides_win(monkeypatch):
    monkeypatch.delenv("KVXFER_METRICS_PORT", raising=False)
    assert AgentConfig().metrics_port is None and AgentConfig.from_env().metrics_port is None
    monkeypatch.setenv("KVXFER_METRICS_PORT", "9100")
    assert AgentConfig.from_env(metrics_port=None).metrics_port is None


@pytest.mark.parametrize("raw", ["http", "-1", "65536", "9100.5"])
def test_metrics_port_env_junk_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KVXFER_METRICS_PORT", raw)
    with pytest.raises(ConfigError, match=f"KVXFER_METRICS_PORT must be a port number in \\[0, 65535\\]; got '{raw}'"):
        AgentConfig.from_env()


@pytest.mark.parametrize("bad", [-1, 65536, True, 9100.0, "9100"])
def test_metrics_port_field_is_checked(bad):
    with pytest.raises(ConfigError, match="metrics_port must be an integer in \\[0, 65535\\] or None"):
        AgentConfig(metrics_port=bad)


@pytest.mark.parametrize("raw,want", [("7600", 7600), (" 0 ", 0), ("off", None), ("OFF", None), ("none", None)])
def test_express_port_from_env(monkeypatch, raw, want):
    monkeypatch.setenv("KVXFER_EXPRESS_PORT", raw)
    assert AgentConfig.from_env().express_port == want


def test_express_port_defaults_to_a_free_port_and_overrides_win(monkeypatch):
    monkeypatch.delenv("KVXFER_EXPRESS_PORT", raising=False)
    assert AgentConfig().express_port == 0 and AgentConfig.from_env().express_port == 0
    monkeypatch.setenv("KVXFER_EXPRESS_PORT", "off")
    assert AgentConfig.from_env(express_port=7600).express_port == 7600


@pytest.mark.parametrize("raw", ["tcp", "-1", "65536", "76.5"])
def test_express_port_env_junk_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KVXFER_EXPRESS_PORT", raw)
    with pytest.raises(ConfigError, match=f"KVXFER_EXPRESS_PORT must be a port number in \\[0, 65535\\] or 'off'; got '{raw}'"):
        AgentConfig.from_env()


@pytest.mark.parametrize("bad", [-1, 65536, False, 7600.0, "7600"])
def test_express_port_field_is_checked(bad):
    with pytest.raises(ConfigError, match="express_port must be an integer in \\[0, 65535\\] or None"):
        AgentConfig(express_port=bad)


@pytest.mark.parametrize("raw,want", [("0", 0.0), (" 0.0001 ", 0.0001), ("1", 1.0)])
def test_progress_interval_from_env(monkeypatch, raw, want):
    monkeypatch.setenv("KVXFER_PROGRESS_INTERVAL", raw)
    assert AgentConfig.from_env().progress_interval == want
    assert AgentConfig.from_env(progress_interval=0.5).progress_interval == 0.5  # an explicit value wins


@pytest.mark.parametrize("raw", ["fast", "-0.1", "2", "nan"])
def test_progress_interval_env_junk_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KVXFER_PROGRESS_INTERVAL", raw)
    with pytest.raises(ConfigError, match=f"KVXFER_PROGRESS_INTERVAL must be a number of seconds in \\[0, 1\\]; got '{raw}'"):
        AgentConfig.from_env()


@pytest.mark.parametrize("bad", [-0.001, 1.5, True, "0.001", None])
def test_progress_interval_field_is_checked(bad):
    with pytest.raises(ConfigError, match="progress_interval must be a number of seconds in \\[0, 1\\]"):
        AgentConfig(progress_interval=bad)


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "soon"])
def test_lease_timeout_env_junk_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KVXFER_LEASE_TIMEOUT", raw)
    with pytest.raises(ConfigError, match=f"KVXFER_LEASE_TIMEOUT must be a .*; got '{raw}'"):
        AgentConfig.from_env()


def test_backends_env_naming_none_is_refused(monkeypatch):
    monkeypatch.setenv("KVXFER_BACKENDS", " , ")
    with pytest.raises(ConfigError, match="KVXFER_BACKENDS must name at least one backend; got ' , '"):
        AgentConfig.from_env()


@pytest.mark.parametrize("raw", [float("inf"), "nan", True, "-2", None])
def test_parse_seconds_refuses_what_is_not_positive_finite_seconds(raw):
    with pytest.raises(ConfigError, match="kv_lease_timeout must be a"):
        parse_seconds(raw, "kv_lease_timeout")
    assert parse_seconds("2.5", "kv_lease_timeout") == 2.5 == parse_seconds(2.5, "x")


def test_switch_interval_is_checked_and_read_from_env(monkeypatch):
    assert AgentConfig().switch_interval is None
    assert AgentConfig(switch_interval=0.0005).switch_interval == 0.0005
    for bad in (0, -1, 0.5, "fast", True):
        with pytest.raises(ConfigError, match="switch_interval"):
            AgentConfig(switch_interval=bad)
    monkeypatch.setenv("KVXFER_SWITCH_INTERVAL", "0.001")
    assert AgentConfig.from_env().switch_interval == 0.001
    monkeypatch.setenv("KVXFER_SWITCH_INTERVAL", "soon")
    with pytest.raises(ConfigError, match="KVXFER_SWITCH_INTERVAL"):
        AgentConfig.from_env()
