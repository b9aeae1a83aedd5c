"""Harness for end-to-end runs against real vLLM servers: a tiny real model, server processes, a token-id client.

Imports only the standard library at module level (torch/transformers load inside
``make_tiny_model``), so the benchmark and the tests share it without pulling vLLM in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvxfer.testing import free_port_block

#: The parameters vLLM's own proxy sends to the prefill instance (REFERENCE §3).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

SERVED_NAME = "tiny"


def make_tiny_model(path: Path) -> Path:
    """Write the tiny Qwen3 with real random weights (seed 0) of REFERENCE §5 to ``path``; return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def free_port(span: int = 1) -> int:
    """A TCP port p such that p .. p+span-1 are free on 127.0.0.1 right now."""
    return free_port_block(span)


def shim_pythonpath() -> str | None:
    """A directory that makes ``import kvxfer_vllm`` work, or None when it already does.

    Until packaging maps ``kvxfer_vllm`` to ``adapters/vllm``, a temp dir holding a
    symlink ``kvxfer_vllm -> adapters/vllm`` is put on PYTHONPATH (putting ``adapters/``
    itself there would shadow the real ``vllm``).
    """
    import importlib.util

    if importlib.util.find_spec("kvxfer_vllm") is not None:
        return None
    adapter = Path(__file__).resolve().parents[2] / "adapters" / "vllm"
    shim = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvxfer_path_{os.getuid()}"
    shim.mkdir(exist_ok=True)
    link = shim / "kvxfer_vllm"
    if not link.exists():
        try:
            link.symlink_to(adapter, target_is_directory=True)
        except FileExistsError:
            pass
    return str(shim)


@dataclass
class VllmServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process with its own log file.

    The process is the leader of a new session, so ``stop`` ends its engine-core and
    worker children with it.
    """

    name: str
    model: Path
    log_dir: Path
    cpu_bind: str = "0"
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> "VllmServer":
        """Spawn the server (returns at once; see ``wait_ready``)."""
        if not self.port:
            self.port = free_port()
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        })
        shim = shim_pythonpath()
        if shim:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
        env.update(self.env)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "2048",
            "--enable-prompt-tokens-details", *self.args,
        ]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        return self

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers 200; raise RuntimeError (with the log tail) on exit or at ``deadline``."""
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; harmless twice."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # children may outlive the leader for a moment; take the whole group down
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> "Client":
        return Client(self.url)


@dataclass
class ProxyServer:
    """``python -m kvxfer.proxy`` in front of prefill and decode servers (its own process group and log)."""

    prefill: Sequence[VllmServer]
    decode: Sequence[VllmServer]
    log_dir: Path
    name: str = "proxy"
    port: int = 0
    proc: subprocess.Popen | None = None

    url = VllmServer.url
    log_path = VllmServer.log_path
    log_tail = VllmServer.log_tail
    wait_ready = VllmServer.wait_ready
    stop = VllmServer.stop
    client = VllmServer.client

    def start(self) -> "ProxyServer":
        if not self.port:
            self.port = free_port()
        cmd = [sys.executable, "-m", "kvxfer.proxy", "--host", "127.0.0.1", "--port", str(self.port),
               "--prefiller-hosts", *["127.0.0.1"] * len(self.prefill),
               "--prefiller-ports", *[str(s.port) for s in self.prefill],
               "--decoder-hosts", *["127.0.0.1"] * len(self.decode),
               "--decoder-ports", *[str(s.port) for s in self.decode],
               "--health-interval", "1"]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self


def start_all(servers: Sequence[VllmServer], timeout: float = 300.0) -> None:
    """Start every server, then wait for all; on failure stop them all and re-raise."""
    try:
        for s in servers:
            s.start()
        deadline = time.monotonic() + timeout
        for s in servers:
            s.wait_ready(deadline)
    except BaseException:
        for s in servers:
            s.stop()
        raise


@dataclass(frozen=True)
class Completion:
    """What a /v1/completions call returned that the tests look at."""

    token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int | None
    raw: dict[str, Any]


class RequestFailed(RuntimeError):
    """The server answered with an HTTP error."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Client:
    """Sends token-id prompts to one server and returns the generated token ids."""

    url: str
    timeout: float = 120.0

    def complete(self, prompt: Sequence[int], max_tokens: int,
                 kv_transfer_params: dict[str, Any] | None = None,
                 **extra: Any) -> Completion:
        body: dict[str, Any] = {
            "model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": False,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        body.update(extra)
        data = post_json(self.url + "/v1/completions", body, self.timeout)
        choice = data["choices"][0]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return Completion(
            token_ids=list(choice.get("token_ids") or []),
            finish_reason=choice.get("finish_reason"),
            kv_transfer_params=data.get("kv_transfer_params"),
            cached_tokens=details.get("cached_tokens"),
            raw=data,
        )

    def metric(self, name: str) -> float:
        """Sum of the Prometheus samples called ``name`` (all label sets) on this server."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON; return the decoded answer or raise RequestFailed."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RequestFailed(e.code, e.read().decode(errors="replace")) from None


def prefill(prefiller: Client, prompt: Sequence[int]) -> Completion:
    """The proxy's first leg: one token on the prefill instance, asking it to keep the KV for a decoder."""
    return prefiller.complete(prompt, 1, kv_transfer_params=dict(PREFILL_PARAMS))


def route_pd(prefiller: Client, decoder: Client, prompt: Sequence[int], max_tokens: int,
             params_override: dict[str, Any] | None = None) -> Completion:
    """What vLLM's proxy does: prefill on P, then the original request with P's kv_transfer_params on D."""
    first = prefill(prefiller, prompt)
    params = first.kv_transfer_params
    if not params:
        raise RuntimeError(f"prefill answered without kv_transfer_params: {first.raw}")
    if params_override:
        params = {**params, **params_override}
    return decoder.complete(prompt, max_tokens, kv_transfer_params=params)


def run_concurrently(fn, items: Sequence[Any], workers: int = 8) -> list[Any]:
    """``[fn(x) for x in items]`` run on a thread pool, results in order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def prompt_of(length: int, seed: int, last: int | None = None, vocab: int = 1024) -> list[int]:
    """A deterministic pseudo-random token-id prompt; ``last`` fixes its final token."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(1, vocab) for _ in range(length)]
    if last is not None:
        ids[-1] = last
    return ids
