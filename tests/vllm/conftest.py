"""Fixtures for the real-vLLM end-to-end tests: the tiny model, a log folder, P/D server pairs (some shared with tests/transformers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from shared_servers import BLOCK_SIZE, SharedPair, group_sharing_modules, kv_config_args, pd_servers, use_pair
from vllm_harness import make_tiny_model

__all__ = ["BLOCK_SIZE", "kv_config_args", "pd_servers"]   # re-exported: the test modules import them from here


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if item.get_closest_marker("timeout") is None:
                # the first test of a module also pays for starting its servers (slow when the
                # two cores are shared)
                item.add_marker(pytest.mark.timeout(600))
    group_sharing_modules(items)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of REFERENCE §5 (real random weights, seed 0), written once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go: $KVXFER_VLLM_LOGS if set (kept for inspection), else a temp dir."""
    path = os.environ.get("KVXFER_VLLM_LOGS")
    return Path(path) if path else tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def granite_pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               vllm_logs: Path) -> Iterator[SharedPair]:
    """The tiny GraniteMoeHybrid's P/D pair, shared with tests/transformers (shared_servers.py)."""
    yield from use_pair(request, tmp_path_factory, vllm_logs)


@pytest.fixture(scope="module")
def gemma3_pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              vllm_logs: Path) -> Iterator[SharedPair]:
    """The tiny Gemma 3's P/D pair, shared with tests/transformers (shared_servers.py)."""
    yield from use_pair(request, tmp_path_factory, vllm_logs)
