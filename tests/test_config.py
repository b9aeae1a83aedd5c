"""AgentConfig: environment variables and validation (typed errors naming the bad value)."""

import pytest

from kvxfer import AgentConfig, ConfigError


@pytest.mark.parametrize("raw,want", [("0", False), ("off", False), ("1", True), ("True", True)])
def test_nixl_progress_thread_from_env(monkeypatch, raw, want):
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_THREAD", raw)
    assert AgentConfig.from_env().nixl_progress_thread is want


def test_nixl_progress_thread_defaults_on_and_rejects_junk(monkeypatch):
    monkeypatch.delenv("KVXFER_NIXL_PROGRESS_THREAD", raising=False)
    assert AgentConfig.from_env().nixl_progress_thread is True
    monkeypatch.setenv("KVXFER_NIXL_PROGRESS_THREAD", "sometimes")
    with pytest.raises(ConfigError, match="KVXFER_NIXL_PROGRESS_THREAD must be 0 or 1; got 'sometimes'"):
        AgentConfig.from_env()
    with pytest.raises(ConfigError, match="nixl_progress_thread must be True or False; got 'yes'"):
        AgentConfig(nixl_progress_thread="yes")
