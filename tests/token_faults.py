"""The hold-token fault tests' shared parts (issue 35; test support, imports kvxfer's agent but no test module).

Used by tests/chaos/test_tokens_chaos.py (the CPU host), tests/multihost/test_tokens_across_hosts.py
(two network namespaces) and tests/gpu/test_tokens_gpu.py (CUDA IPC), and by their producers
(tests/chaos/chaos_peers.py, tests/gpu/ownership_peers.py):

* ``ReusingEngine``: the serving engine around a producer agent; it overwrites a hold's blocks the
  moment ``finished()`` lists the request (sent, expired or aborted), so a read that succeeded with
  bytes of a hold that had ended shows up as wrong bytes;
* ``token_command``: the producer's answers to the commands every token test sends (``hold``,
  ``hold_token``, ``release``, ``token``, ``reused``, ``freed``, ``status``, ``stats``);
* ``count_claims``: counts the claims a consumer process sends (a token read sends none);
* ``after_the_move``: runs an action in the consumer at the moment a token read's move has completed
  and before it looks at the producer's hold word (the "after the move" cells of the matrix in
  docs/reliability.md), whatever thread polls the read;
* ``split_ids``, ``outcome``, ``freeze`` (SIGSTOP, returning once stopped), ``wait_until``, ``TYPED``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

#: The typed errors a token read may fail with in these tests (never a success with other bytes).
TYPED = frozenset({"LeaseExpiredError", "AbortedError", "PeerLostError", "TransferTimeoutError",
                   "TransferFailedError"})

#: ``token_command``'s answer to a command that is not one of its own.
NOT_MINE = object()


def split_ids(num_blocks: int, size: int, trial: int, salt: int) -> tuple[list[int], list[int]]:
    """Two disjoint random lists of ``size`` block ids (source, destination) for one trial of one case."""
    rng = np.random.default_rng(1000 * salt + trial)
    ids = rng.permutation(num_blocks)[: 2 * size]
    return ids[:size].tolist(), ids[size:].tolist()


class ReusingEngine:
    """The serving engine around a producer agent: calls ``overwrite(block ids)`` for a hold's blocks
    as soon as ``finished()`` reports the request (``reused``: the rids overwritten, in order;
    ``freed``: ``(rid, why)`` of every report). Like a real engine's block table it never
    overwrites a block that a later hold of its own still covers (a test may hold the same block
    again for a new request before the old one's release is reported)."""

    def __init__(self, agent, overwrite: Callable[[list[int]], None]) -> None:
        self.agent, self._overwrite = agent, overwrite
        self.blocks: dict[str, list[int]] = {}
        self.reused: list[str] = []
        self.freed: list[tuple[str, str]] = []
        self.lock = threading.Lock()  # a hold is taken and recorded, or a release reused, as one step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def hold(self, rid: str, blocks, lease, reuse: bool) -> None:
        """``agent.hold``, recorded for reuse once released (``reuse``)."""
        with self.lock:
            self.agent.hold(rid, blocks, lease=lease)
            if reuse:
                self.blocks[rid] = list(blocks)

    def _loop(self) -> None:
        while not self._stop.is_set():
            fin = self.agent.finished()
            for why, rids in (("sent", fin.sent), ("expired", fin.expired), ("aborted", fin.aborted)):
                for rid in sorted(rids):
                    self.freed.append((rid, why))
                    with self.lock:
                        ids = self.blocks.pop(rid, None)
                        if ids is None:
                            continue
                        held = {b for other in self.blocks.values() for b in other}
                        free = [b for b in ids if b not in held]
                        if free:
                            self._overwrite(free)
                        self.reused.append(rid)
            self._stop.wait(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def token_command(agent, engine: ReusingEngine, op: str, args: tuple):
    """The producer's answer to ``(op, *args)``, or ``NOT_MINE``. ``("hold", rid, blocks, lease[, reuse])``
    and ``("hold_token", ...)`` (the same, answering ``hold_token(rid).wire()`` or None: a short lease
    may end before a second ask) hold ``blocks``; with ``reuse`` (the default) the engine overwrites
    them once ``finished()`` lists ``rid``."""
    if op in ("hold", "hold_token"):
        rid, blocks, lease = args[:3]
        engine.hold(rid, blocks, lease, args[3] if len(args) > 3 else True)
        if op == "hold":
            return True
        op, args = "token", (rid,)
    if op == "token":
        token = agent.hold_token(args[0])
        return token.wire() if token is not None else None
    if op == "release":
        return agent.release(args[0])
    if op == "reused":
        return list(engine.reused)
    if op == "freed":
        return list(engine.freed)
    if op == "status":
        return agent.status(args[0]).value
    if op == "stats":
        return dataclasses.asdict(agent.stats())
    return NOT_MINE


def count_claims(setattr_=setattr) -> dict:
    """Count the claims this process sends from now on (``seen["n"]``): pass ``monkeypatch.setattr``
    in a test's own process (undone after the test), plain ``setattr`` in a process of its own."""
    from kvxfer.agent.claims import Claims

    seen = {"n": 0}
    for name in ("try_send_many", "send_many"):
        real = getattr(Claims, name)

        def counted(self, items, *args, _real=real, **kw):
            seen["n"] += len(items)
            return _real(self, items, *args, **kw)

        setattr_(Claims, name, counted)
    return seen


@contextlib.contextmanager
def after_the_move(action: Callable[[], None]):
    """Token reads started inside this block run ``action()`` once their move has completed and
    before their look at the producer's hold word (on whichever thread polls them; a second poller
    waits for the action). The reads keep the hook after the block."""
    from kvxfer.agent.tokens import TokenReads, Verifier

    class Hooked(Verifier):
        def __init__(self, view, request_id, token) -> None:
            super().__init__(view, request_id, token)
            self._action, self._acted = action, threading.Lock()

        def __call__(self):
            with self._acted:
                todo, self._action = self._action, None
                if todo is not None:
                    todo()
            return super().__call__()

    real = TokenReads.__dict__["verifier"]
    TokenReads.verifier = staticmethod(Hooked)
    try:
        yield
    finally:
        TokenReads.verifier = real


def outcome(handle, check: Callable[[], None], timeout: float = 25.0, by_token: bool = True) -> str:
    """Wait for a read: ``"exact"`` (``check()`` asserted the destination holds the held bytes, and
    the read went by its token unless ``by_token`` is False) or the typed error's name (one of ``TYPED``)."""
    from kvxfer import KvxferError

    try:
        stats = handle.wait(timeout)
    except KvxferError as exc:
        assert type(exc).__name__ in TYPED, repr(exc)
        return type(exc).__name__
    check()
    assert stats.by_token == by_token, f"an exact read's by_token is {stats.by_token}, expected {by_token}"
    return "exact"


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (``kill`` returns before the
    target has stopped, and its threads stop one by one: a UCX progress thread could still answer a
    request sent in between)."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
            except FileNotFoundError:   # a thread that exited meanwhile
                continue
        return True

    if not wait_until(stopped, timeout, step=0.001):
        raise RuntimeError(f"process {pid} did not stop within {timeout} s")


def wait_until(fn, timeout: float = 10.0, step: float = 0.02):
    """Poll ``fn`` until it returns something truthy (returned) or ``timeout`` passes (its last value)."""
    deadline = time.monotonic() + timeout
    got = fn()
    while not got and time.monotonic() < deadline:
        time.sleep(step)
        got = fn()
    return got
