"""Harness for ``kvxfer-hf serve`` processes in tests: reuses tests/vllm/vllm_harness.py's server, client and proxy.

``HFServer`` is a ``VllmServer`` whose command is ``python -m kvxfer_transformers serve``: the
same health wait, log file, process-group stop and token-id client. Each server is bound to
CPU cores as the vLLM harness binds vLLM (here with ``sched_setaffinity`` and one torch thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

from vllm_harness import (  # noqa: E402  (re-exported for the test modules)
    SERVED_NAME, Client, Completion, ProxyServer, RequestFailed, VllmServer, free_port, make_tiny_model,
    post_json, prefill, prompt_of, route_pd, run_concurrently, start_all,
)

__all__ = ["HF16_LEASE_S", "HF_CORE", "SERVED_NAME", "Client", "Completion", "HFServer", "ProxyServer", "RequestFailed", "VllmServer",
           "free_port", "hf_config", "hf_pd_clients", "port_run", "make_tiny_model", "post_json", "prefill", "prompt_of", "quiet_env",
           "route_pd", "run_concurrently", "start_all"]

#: Core of every kvxfer-hf server in the tests (vLLM servers take core 1, as in tests/vllm).
HF_CORE = "0"

#: hf16's producer lease (seconds a prefill holds blocks nobody claims), short for the expiry test.
HF16_LEASE_S = 6



def port_run(n: int) -> int:
    """A base port with ``n`` consecutive ports free, drawn below the kernel's ephemeral range
    (32768+), which heavy connection churn on a shared CI host can fill with TIME-WAIT sockets."""
    import random
    import socket

    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found in [20000, 32000)")


def quiet_env(side_port: int) -> dict[str, str]:
    """Environment of a server whose side channel listens at 127.0.0.1:side_port."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}


def hf_config(policy: str = "fail", role: str = "kv_both", **extra: Any) -> str:
    """A --kv-transfer-config JSON for kvxfer-hf (vLLM's keys)."""
    return json.dumps({"kv_connector": "KvxferConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"transfer_timeout": 60, "handshake_timeout": 4}, **extra})


@dataclass
class HFServer(VllmServer):
    """One ``kvxfer-hf serve`` process (``cpu_bind``: comma-separated cores; ``args``: extra CLI flags).

    ``launcher`` is how it is started: ``python -m kvxfer_transformers`` by default;
    ``HFScriptServer`` runs the installed ``kvxfer-hf`` console script itself."""

    launcher = (sys.executable, "-m", "kvxfer_transformers")  # a class attribute, not a field

    def start(self) -> "HFServer":
        if not self.port:
            self.port = port_run(1)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.env)
        cores = {int(c) for c in self.cpu_bind.split(",") if c.strip()} & os.sched_getaffinity(0)
        cmd = [*self.launcher, "serve", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", SERVED_NAME, "--threads", "1", "--max-model-len", "2048",
               "--log-level", "warning", *self.args]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        return self


@contextlib.contextmanager
def hf_pd_clients(tag: str, model: Path, logs: Path, *args: str) -> Iterator[tuple[Client, Client]]:
    """A ``kvxfer-hf`` prefill and decode instance (core ``HF_CORE``, side channels on a fresh run
    of ports, server ``args``), started together; yields their clients, stops both."""
    side = port_run(8)
    servers = [HFServer(f"{tag}-{role}", model, logs, cpu_bind=HF_CORE, env=quiet_env(side + 4 * i), args=args)
               for i, role in enumerate(("prefill", "decode"))]
    start_all(servers, timeout=180)
    try:
        yield servers[0].client(), servers[1].client()
    finally:
        for s in servers:
            s.stop()


class HFScriptServer(HFServer):
    """An ``HFServer`` started through the ``kvxfer-hf`` console script the package installs."""

    launcher = (str(Path(sys.executable).with_name("kvxfer-hf")),)
