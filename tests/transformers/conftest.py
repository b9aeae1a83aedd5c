"""Fixtures for the transformers adapter's end-to-end tests: the tiny model and two kvxfer-hf servers.

The two servers are session-scoped so the tf -> tf module and the cross-engine module share
them: ``hf16`` (block size 16, ``kv_load_failure_policy: fail``, a 6 s producer lease) and ``hf32`` (block size 32,
the vLLM servers' size, ``recompute``), both on core 0 (vLLM servers take core 1). ``granite_pd`` and
``gemma3_pd`` are vLLM P/D pairs shared with tests/vllm's modules of the same models: a cross module
uses the pair's prefill instance (core 1) as its vLLM peer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from hf_harness import HF16_LEASE_S, HF_CORE, HFServer, hf_config, make_tiny_model, port_run, quiet_env, start_all
from shared_servers import SharedPair, use_pair   # tests/vllm (on sys.path through hf_harness)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of REFERENCE §5 (real random weights, seed 0; every server runs it in float32)."""
    return make_tiny_model(tmp_path_factory.mktemp("hf-tiny-qwen3"))


@pytest.fixture(scope="session")
def hf_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = os.environ.get("KVXFER_VLLM_LOGS")
    return Path(path) if path else tmp_path_factory.mktemp("hf-logs")


@pytest.fixture(scope="session")
def hf_servers(hf_model: Path, hf_logs: Path) -> Iterator[dict[str, HFServer]]:
    side = port_run(8)
    servers = {
        "hf16": HFServer("hf16", hf_model, hf_logs, cpu_bind=HF_CORE,
                         env={**quiet_env(side), "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(HF16_LEASE_S)},
                         args=("--block-size", "16", "--kv-transfer-config", hf_config("fail"))),
        "hf32": HFServer("hf32", hf_model, hf_logs, cpu_bind=HF_CORE, env=quiet_env(side + 4),
                         args=("--block-size", "32", "--kv-transfer-config", hf_config("recompute"))),
    }
    start_all(list(servers.values()), timeout=180)
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def granite_pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               hf_logs: Path) -> Iterator[SharedPair]:
    """The tiny GraniteMoeHybrid's vLLM P/D pair, shared with tests/vllm (tests/vllm/shared_servers.py)."""
    yield from use_pair(request, tmp_path_factory, hf_logs)


@pytest.fixture(scope="module")
def gemma3_pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              hf_logs: Path) -> Iterator[SharedPair]:
    """The tiny Gemma 3's vLLM P/D pair, shared with tests/vllm (tests/vllm/shared_servers.py)."""
    yield from use_pair(request, tmp_path_factory, hf_logs)
