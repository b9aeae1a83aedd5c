"""Hold tokens on one GPU (issue 35, marked gpu): IPC reads by token, with the producer's engine
reusing blocks (GPU writes) the moment ``finished()`` lists them.

The producer runs in a spawned process on GPU 0 (``ownership_peers``; its engine overwrites freed
blocks with ``REUSED`` on the GPU); the consumer is this process on GPU 0, reading over CUDA IPC
(``transfer_path="ipc"``) with the producer's token: no claim is sent, and the read succeeds only if
the producer's hold word still equals the token once the copy kernel completed. Each case three
times: exact by token; release before and during the kernel; expiry before; the consumer's abort
during; SIGKILL of the producer before and during. Every read exact (the held bytes) or typed, none
with reused bytes. Skipped, saying why, without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from .agent_peers import device_cache, free_port_block, host_cache, logical
from .ownership_peers import OwnerProducer

pytestmark = pytest.mark.gpu

BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2560, dtype="bfloat16",
           model="gpu-tokens")
TRIALS = 3
N = 512      # blocks a read: 128 MiB, long enough for a release or a signal to land mid-kernel
SEED = 10
TYPED = {"LeaseExpiredError", "AbortedError", "PeerLostError", "TransferTimeoutError", "TransferFailedError"}


@pytest.fixture
def claims(monkeypatch):
    """Counts the claims this (consumer) process sends: a token read sends none."""
    from kvxfer.agent.claims import Claims

    seen = {"n": 0}
    for name in ("try_send_many", "send_many"):
        real = getattr(Claims, name)

        def counted(self, items, *args, _real=real, **kw):
            seen["n"] += len(items)
            return _real(self, items, *args, **kw)

        monkeypatch.setattr(Claims, name, counted)
    return seen


@pytest.fixture
def gpu_pair(cuda):
    import torch

    from kvxfer import Agent, AgentConfig, KVSpec

    spec = KVSpec(**BIG)
    started = [OwnerProducer(spec, SEED, free_port_block(), 0)]
    torch.cuda.set_device(0)
    cons = Agent("gpu-token-consumer", spec, AgentConfig(side_channel_host="127.0.0.1",
                                                         side_channel_port=free_port_block(1), transfer_path="ipc"))
    cache = device_cache(spec, 99, 0)
    torch.cuda.synchronize()
    cons.register(cache)
    try:
        yield spec, started, cons, cache
    finally:
        cons.close()
        for prod in started:
            prod.stop()


def _wait(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
        got = fn()
    return got


def _ids(spec, trial: int, salt: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(100 * salt + trial)
    ids = rng.permutation(spec.num_blocks)[: 2 * N]
    return ids[:N].tolist(), ids[N:].tolist()


def _read(spec, prod, cons, cache, src, dst, rid, *, lease=None, before=None, during=None, timeout=20.0):
    """Hold ``src`` with a token, act ``before`` the read or ``during`` it, read by the token; returns
    the outcome ("exact", checked against the seeded bytes, or the typed error's name) and by_token."""
    import torch

    from kvxfer import HoldToken, KvxferError, ReadRequest

    want = logical(spec, host_cache(spec, SEED), src)
    wire = prod.ask(("hold_token", rid, src, lease))
    assert wire is not None, "a plain hold got no token"
    if before is not None:
        before()
    handle = cons.read_many([ReadRequest(prod.address, dst, src, rid, timeout, token=HoldToken.from_wire(wire))])[0]
    if during is not None:
        during()
    try:
        stats = handle.wait(timeout + 10)
    except KvxferError as exc:
        assert type(exc).__name__ in TYPED, repr(exc)
        return type(exc).__name__, False
    torch.cuda.synchronize()
    got = [t.cpu().numpy() for t in cache]
    np.testing.assert_array_equal(logical(spec, got, dst), want,
                                  err_msg=f"{rid}: a token read succeeded with other bytes than the held ones")
    return "exact", stats.by_token


def test_ipc_token_reads_are_exact_or_typed_never_reused(gpu_pair, claims):
    spec, started, cons, cache = gpu_pair
    outcomes: dict[str, list[str]] = {}

    def producer():
        return started[-1]

    def run(label, salt, **kw):
        for trial in range(TRIALS):
            src, dst = _ids(spec, trial, salt)
            rid = f"{label}-{trial}"
            prod = producer()
            cons.connect(*prod.address)   # handshaken: the token read starts at once, with no claim
            extra = {k: (v(prod, rid) if callable(v) else v) for k, v in kw.items()}
            name, by_token = _read(spec, prod, cons, cache, src, dst, rid, **extra)
            outcomes.setdefault(label, []).append(name)
            if name == "exact":
                assert by_token, f"{rid}: an exact read did not go by its token"
            # every hold ends (sent, released, aborted, expired) and its blocks are reused: wait for that
            # before the reset, or a late reuse would land in a later trial's held blocks
            assert _wait(lambda: rid in prod.ask(("reused",)), 20), f"{rid}: its blocks never came back"
            prod.ask(("reset",))

    def release_first(prod, rid):
        return lambda: (prod.ask(("release", rid)), _wait(lambda: rid in prod.ask(("reused",)), 10))

    def expire_first(prod, rid):
        return lambda: _wait(lambda: rid in prod.ask(("reused",)), 10)

    def release_now(prod, rid):
        return lambda: prod.ask(("release", rid))

    def abort_now(prod, rid):
        return lambda: cons.abort(rid)

    run("exact", 1)
    run("release-before", 2, before=release_first)
    run("release-during", 3, during=release_now)
    run("expiry-before", 4, lease=0.3, before=expire_first)
    run("abort-during", 5, during=abort_now)
    assert outcomes["exact"] == ["exact"] * TRIALS, outcomes
    for label in ("release-before", "expiry-before"):
        assert outcomes[label] == ["LeaseExpiredError"] * TRIALS, outcomes
    assert claims["n"] == 0, f"token reads sent {claims['n']} claims"
    print("outcomes:", outcomes)


def _killing_consumer(out, address, pid, src, dst, rid, wire, when, spec_kwargs) -> None:
    """One token read in a process of its own (a fault in CUDA's context here cannot spoil the test
    process's): SIGKILL the producer ``before`` or ``during`` it; reports the outcome."""
    try:
        import torch

        from kvxfer import Agent, AgentConfig, HoldToken, KvxferError, KVSpec, ReadRequest

        spec = KVSpec(**spec_kwargs)
        torch.cuda.set_device(0)
        with Agent("gpu-token-killer", spec, AgentConfig(side_channel_host="127.0.0.1",
                                                         side_channel_port=free_port_block(1),
                                                         transfer_path="ipc")) as agent:
            cache = device_cache(spec, 99, 0)
            torch.cuda.synchronize()
            agent.register(cache)
            agent.connect(*address)
            if when == "before":
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
            handle = agent.read_many([ReadRequest(tuple(address), dst, src, rid, 5.0,
                                                  token=HoldToken.from_wire(wire))])[0]
            if when == "during":
                os.kill(pid, signal.SIGKILL)
            try:
                stats = handle.wait(15)
            except KvxferError as exc:
                out.put(("typed", type(exc).__name__))
                return
            torch.cuda.synchronize()
            got = [t.cpu().numpy() for t in cache]
            exact = bool(np.array_equal(logical(spec, got, dst), logical(spec, host_cache(spec, SEED), src)))
            out.put(("exact" if exact else "WRONG BYTES", stats.by_token))
    except BaseException as exc:  # report it to the test instead of hanging it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("when", ["before", "during"])
def test_ipc_token_reads_with_the_producer_killed_are_exact_or_typed(cuda, when):
    """SIGKILL of the producer before or during an IPC token read: the held bytes (nobody reused
    them: the engine died with the process) or a typed error, three times."""
    from kvxfer import KVSpec
    from kvxfer.testing import run_reporting

    spec = KVSpec(**BIG)
    kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    seen = []
    for trial in range(TRIALS):
        prod = OwnerProducer(spec, SEED, free_port_block(), 0)
        try:
            src, dst = _ids(spec, trial, 8 if when == "before" else 9)
            rid = f"kill-{when}-{trial}"
            wire = prod.ask(("hold_token", rid, src, None))
            tag, what = run_reporting(_killing_consumer, prod.address, prod.proc.pid, src, dst, rid, wire, when,
                                      kwargs, timeout=120)
            assert tag in ("exact", "typed"), (tag, what)
            if tag == "exact":
                assert what is True, f"{rid}: an exact read did not go by its token"
            else:
                assert what in TYPED, what
            seen.append(tag if tag == "exact" else what)
        finally:
            prod.stop()
    print(f"SIGKILL {when}:", seen)
