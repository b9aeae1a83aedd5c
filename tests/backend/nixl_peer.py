"""A NixlBackend in its own process, driven by JSON lines on stdin (test/bench helper, not a test).

Run as ``python nixl_peer.py NAME``. Each command line ``{"op": ...}`` gets one JSON reply line
on the process's original stdout; NIXL's own logging goes to stderr. Ops: ``setup`` (allocate
and register a buffer filled from a seed), ``add_peer``, ``notifs`` (wait for n notifications),
``notify``, ``digest`` (sha256 of a slice of the buffer), ``exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The bytes a peer's buffer is filled with (both sides can compute them)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class PeerProcess:
    """Parent-side handle: start ``nixl_peer.py`` and send it commands."""

    def __init__(self, name: str) -> None:
        import subprocess

        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def call(self, op: str, **args):
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.name} exited with {self.proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"peer {self.name}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def main(name: str) -> None:
    from kvxfer.backend.nixl import NixlBackend
    from kvxfer.types import MemKind, Region

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything NIXL prints goes to stderr, never into the reply stream
    backend = NixlBackend(name)
    buf = np.zeros(0, np.uint8)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "setup":
                buf = pattern(cmd["nbytes"], cmd["seed"])
                backend.register([Region(buf.ctypes.data, buf.nbytes, 0, MemKind.DRAM)])
                reply = {"addr": buf.ctypes.data, "metadata": backend.metadata().hex()}
            elif op == "add_peer":
                reply = {"name": backend.add_peer(bytes.fromhex(cmd["metadata"]))}
            elif op == "notifs":
                got, deadline = [], time.monotonic() + cmd["timeout"]
                while len(got) < cmd["want"] and time.monotonic() < deadline:
                    got += backend.notifications()
                    time.sleep(0.001)
                reply = {"notifs": [[peer, msg.hex()] for peer, msg in got]}
            elif op == "notify":
                backend.notify(cmd["peer"], bytes.fromhex(cmd["msg"]))
                reply = {}
            elif op == "digest":
                part = buf[cmd["offset"]:cmd["offset"] + cmd["length"]]
                reply = {"sha256": hashlib.sha256(part.tobytes()).hexdigest()}
            elif op == "exit":
                backend.close()
                out.write("{}\n")
                out.flush()
                return
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # report to the parent, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
