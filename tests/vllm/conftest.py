"""Fixtures for the real-vLLM end-to-end tests: the tiny model, a log folder, P/D server pairs."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from vllm_harness import VllmServer, free_port, make_tiny_model, start_all

#: Block size for every test server: a multiple of 32 (the CPU kernel's rule), small enough
#: that a 300-token prompt spans ten blocks.
BLOCK_SIZE = 32


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if item.get_closest_marker("timeout") is None:
                # the first test of a module also pays for starting its servers (slow when the
                # two cores are shared)
                item.add_marker(pytest.mark.timeout(600))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of REFERENCE §5 (real random weights, seed 0), written once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go: $KVXFER_VLLM_LOGS if set (kept for inspection), else a temp dir."""
    path = os.environ.get("KVXFER_VLLM_LOGS")
    return Path(path) if path else tmp_path_factory.mktemp("vllm-logs")


def kv_config_args(config: dict[str, Any]) -> list[str]:
    return ["--kv-transfer-config", json.dumps(config)]


@contextlib.contextmanager
def pd_servers(tag: str, model: Path, logs: Path, p_config: dict[str, Any],
               d_config: dict[str, Any], p_args: tuple[str, ...] = (),
               d_args: tuple[str, ...] = (), p_bind: str = "0", d_bind: str = "1",
               p_env: dict[str, str] | None = None, d_env: dict[str, str] | None = None,
               ) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Start a prefill and a decode server (side channels on fresh ports), yield them, stop both."""
    # float32: in bf16 a batch of concurrent requests can round differently from the same
    # request alone and flip a greedy token; the comparisons here are about the KV moved.
    common = ("--block-size", str(BLOCK_SIZE), "--dtype", "float32")
    side = free_port(8)  # P's side channel at side, D's at side+4 (room for TP/DP ranks)
    p = VllmServer(f"{tag}-prefill", model, logs, cpu_bind=p_bind,
                   args=(*common, *kv_config_args(p_config), *p_args),
                   env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), **(p_env or {})})
    d = VllmServer(f"{tag}-decode", model, logs, cpu_bind=d_bind,
                   args=(*common, *kv_config_args(d_config), *d_args),
                   env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side + 4), **(d_env or {})})
    start_all([p, d], timeout=420)
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()
