"""SGLang prefill -> SGLang decode through kvxfer, behind SGLang's own mini load balancer (issue 26).

Real processes, real NIXL (UCX) and ZMQ, the tiny random Qwen3 of scripts/sglang_cpu/make_tiny.py.
Runs from ``make test-sglang`` (which builds .venv-sglang); skipped when that venv is absent.
One server process set at a time (2-core host): a plain server for the reference tokens, then
the P/D pair. The order is the argument:

1. it can fail: a prefill that moves no KV (``KVXFER_SGLANG_DROP_KV=1``) answers differently;
2. the KV moves: greedy tokens equal the plain server's on prompts of 40-1,000 tokens that
   cross page boundaries, one at a time and concurrently, the 1,000-token one in several
   chunked-prefill chunks (several writes of one request);
3. a prefill killed mid-request fails the request (HTTP error, a kvxfer or SGLang typed reason in
   decode's log, no hang) and decode's pages return.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
PY = VENV / "bin" / "python"
MODEL = VENV / "tiny-qwen3"

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not (VENV / ".kvxfer-sglang-installed").exists(),
                       reason="SGLang venv absent: `make test-sglang` builds .venv-sglang and runs this"),
]

PAGE = 16
CHUNK = 256          # chunked prefill: the 1,000-token prompt is written in 4 chunks
OUT_TOKENS = 8
LENGTHS = (40, 300, 1000)


def _env(extra=None) -> dict:
    env = dict(os.environ)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1",
                "PYTHONPATH": str(ROOT / "scripts" / "sglang_cpu"),
                # SGLang's early send of a cached prefix records a CUDA event: off on CPU
                "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
                "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"})
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One server process in its own session (killed with its children, whatever happens)."""

    def __init__(self, args, log: Path, env=None) -> None:
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=_env(env),
                                     start_new_session=True, cwd=str(ROOT))

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _server(port: int, log: Path, *extra: str, env=None) -> Proc:
    args = [str(PY), "-m", "sglang.launch_server", "--model-path", str(MODEL), "--device", "cpu",
            "--attention-backend", "torch_native", "--skip-tokenizer-init", "--host", "127.0.0.1",
            "--port", str(port), "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
            "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK), *extra]
    return Proc(args, log, env)


def _wait_ready(url: str, proc: Proc, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"{url} exited: {proc.text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not ready in {timeout}s: {proc.text()[-3000:]}")


def _generate(url: str, ids: list[int], timeout: float = 120) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": OUT_TOKENS, "temperature": 0,
                                                  "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["output_ids"]


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(26)
    out = {f"len{n}": [rng.randrange(1, 1000) for _ in range(n)] for n in LENGTHS}
    # same last token as len300: an answer that ignored the context would match it
    out["len300-other"] = [rng.randrange(1, 1000) for _ in range(299)] + [out["len300"][-1]]
    return out


def _used_tokens(decode_url: str) -> int:
    with urllib.request.urlopen(decode_url + "/v1/loads", timeout=5) as r:
        return int(json.loads(r.read())["loads"][0]["num_used_tokens"])


def _queued(decode_url: str) -> int:
    with urllib.request.urlopen(decode_url + "/v1/loads", timeout=5) as r:
        d = json.loads(r.read())["loads"][0]
    dis = d.get("disaggregation") or {}
    return int(d["num_running_reqs"]) + int(d["num_waiting_reqs"]) + sum(
        int(dis.get(k, 0)) for k in ("decode_prealloc_queue_reqs", "decode_transfer_queue_reqs"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain (non-disaggregated) server's greedy tokens for every prompt."""
    logs = tmp_path_factory.mktemp("plain")
    port = _free_port()
    proc = _server(port, logs / "plain.log")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        return {name: _generate(url, ids) for name, ids in _prompts().items()}
    finally:
        proc.kill()


class Pair:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.p_port, self.d_port, self.lb_port = _free_port(), _free_port(), _free_port()
        self.boot = _free_port()
        self.prefill: Proc | None = None
        self.decode = _server(self.d_port, logs / "decode.log", "--disaggregation-mode", "decode",
                              "--disaggregation-transfer-backend", "kvxfer",
                              "--disaggregation-decode-retraction-backup", "cpu_tensor")
        self.lb = Proc([str(PY), "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
                        "--prefill", f"http://127.0.0.1:{self.p_port}", str(self.boot),
                        "--decode", f"http://127.0.0.1:{self.d_port}", "--host", "127.0.0.1",
                        "--port", str(self.lb_port)], logs / "lb.log")

    def start_prefill(self, name: str, env=None) -> None:
        self.prefill = _server(self.p_port, self.logs / f"{name}.log", "--disaggregation-mode", "prefill",
                               "--disaggregation-transfer-backend", "kvxfer",
                               "--disaggregation-bootstrap-port", str(self.boot), env=env)
        _wait_ready(self.url(self.p_port), self.prefill)

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        for p in (self.lb, self.prefill, self.decode):
            if p is not None:
                p.kill()


@pytest.fixture(scope="module")
def pair(reference, tmp_path_factory):
    p = Pair(tmp_path_factory.mktemp("pd"))
    try:
        p.start_prefill("prefill-drop-kv", env={"KVXFER_SGLANG_DROP_KV": "1"})
        _wait_ready(p.url(p.d_port), p.decode)
        yield p
    finally:
        p.close()


def test_1_a_decode_that_gets_no_kv_answers_differently(pair, reference):
    prompts = _prompts()
    wrong = {name: _generate(pair.url(pair.lb_port), prompts[name]) for name in ("len300", "len1000")}
    assert wrong["len300"] != reference["len300"] and wrong["len1000"] != reference["len1000"], \
        f"the answers do not depend on the moved KV: {wrong} vs {reference}"
    assert reference["len300"] != reference["len300-other"]   # the context, not the last token, decides
    pair.prefill.kill()
    pair.start_prefill("prefill")


@pytest.mark.compat(producer="SGLang", consumer="SGLang", tp="1 -> 1",
                    layout="SGLang MHA pool (NHD, K and V per layer), page 16 -> same",
                    path="direct (decode announces, prefill writes each chunk)", device="CPU (`make test-sglang`)")
def test_2_tokens_equal_a_plain_server_one_at_a_time_and_concurrently(pair, reference):
    prompts = _prompts()
    lb = pair.url(pair.lb_port)
    for name, ids in prompts.items():
        assert _generate(lb, ids) == reference[name], name
    names = list(prompts) * 2
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: _generate(lb, prompts[n]), names))
    assert got == [reference[n] for n in names]
    assert "kvxfer decode rank" in pair.decode.text() and "kvxfer prefill rank" in pair.prefill.text()


def test_3_a_prefill_killed_mid_request_fails_it_and_decode_pages_return(pair, reference):
    rng = random.Random(3)
    ids = [rng.randrange(1, 1000) for _ in range(1800)]   # 8 chunks of prefill: time to kill it mid-way
    lb, decode = pair.url(pair.lb_port), pair.url(pair.d_port)
    mark = len(pair.prefill.text())
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(_generate, lb, ids, 90)
        deadline = time.monotonic() + 30
        while "Prefill batch" not in pair.prefill.text()[mark:] and time.monotonic() < deadline:
            time.sleep(0.01)
        pair.prefill.kill()
        with pytest.raises(urllib.error.HTTPError):
            future.result(timeout=100)
        assert time.monotonic() - started < 90
    # The load balancer answers as soon as the prefill's connection drops; decode learns of the
    # loss itself (kvxfer's typed error, or SGLang's heartbeat to the dead bootstrap server), fails
    # its side of the request and frees its pages.
    markers = ("KVTransferError", "kvxfer:", "Lost connection with prefill instance")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (any(m in pair.decode.text() for m in markers)
                                               and _used_tokens(decode) == 0 and _queued(decode) == 0):
        time.sleep(0.5)
    assert any(m in pair.decode.text() for m in markers), pair.decode.text()[-3000:]
    assert _used_tokens(decode) == 0, "decode kept pages of the failed request"
    assert _queued(decode) == 0, "decode kept the failed request queued"
