"""Hold tokens on one GPU (issue 35, marked gpu): IPC reads by token, with the producer's engine
reusing blocks (GPU writes) the moment ``finished()`` lists them.

The producer runs in a spawned process on GPU 0 (``ownership_peers``; its engine overwrites freed
blocks with ``REUSED`` on the GPU); the consumer is this process on GPU 0, reading over CUDA IPC
(``transfer_path="ipc"``) with the producer's token: no claim is sent, and the read succeeds only if
the producer's hold word still equals the token once the copy kernel completed. Each case three
times: exact by token; release, expiry and the consumer's abort before, during and after the
kernel ("after": the kernel completed, the word not yet looked at; ``token_faults.after_the_move``);
SIGSTOP of the producer before, during and after (it stays stopped until the read ended: an IPC
read and its look need no producer CPU); SIGKILL of the producer before, during and after (each
read in a process of its own). Every read exact (the held bytes) or typed, none with reused
bytes. Skipped, saying why, without CUDA (tests/gpu/conftest.py). The matrix: docs/reliability.md.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from token_faults import TYPED, after_the_move, count_claims, freeze, outcome, split_ids, wait_until

from .agent_peers import device_cache, free_port_block, host_cache, logical
from .ownership_peers import OwnerProducer

pytestmark = pytest.mark.gpu

BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2560, dtype="bfloat16",
           model="gpu-tokens")
TRIALS = 3
N = 512      # blocks a read: 128 MiB, long enough for a release or a signal to land mid-kernel
SEED = 10
ANY = TYPED | {"exact"}
#: the lease of a hold that must outlive its kernel and end before the look ("expiry after")
AFTER_LEASE = 1.0


@pytest.fixture
def claims(monkeypatch):
    """Counts the claims this (consumer) process sends: a token read sends none."""
    return count_claims(monkeypatch.setattr)


@pytest.fixture(scope="module")
def gpu_pair(cuda):
    """One producer (its engine reusing freed blocks on the GPU) and this process's consumer, for
    every case of the module but SIGKILL's."""
    import torch

    from kvxfer import Agent, AgentConfig, KVSpec

    spec = KVSpec(**BIG)
    prod = OwnerProducer(spec, SEED, free_port_block(), 0)
    torch.cuda.set_device(0)
    cons = Agent("gpu-token-consumer", spec, AgentConfig(side_channel_host="127.0.0.1",
                                                         side_channel_port=free_port_block(1), transfer_path="ipc"))
    cache = device_cache(spec, 99, 0)
    torch.cuda.synchronize()
    cons.register(cache)
    cons.connect(*prod.address)   # handshaken: a token read starts at once, with no claim
    try:
        yield spec, prod, cons, cache, host_cache(spec, SEED)
    finally:
        cons.close()
        prod.stop()


def _reused(prod, rid, timeout=20.0) -> bool:
    return wait_until(lambda: rid in prod.ask(("reused",)), timeout)


#: (event, moment) -> the outcomes each trial may have ("exact": the held bytes, checked)
EXPECTED = {
    ("none", "-"): {"exact"},
    ("release", "before"): {"LeaseExpiredError"},
    ("release", "during"): ANY,
    ("release", "after"): {"LeaseExpiredError"},
    ("expiry", "before"): {"LeaseExpiredError"},
    ("expiry", "during"): ANY,
    ("expiry", "after"): {"LeaseExpiredError"},
    ("abort", "before"): {"LeaseExpiredError", "AbortedError"},
    ("abort", "during"): ANY,
    ("abort", "after"): {"LeaseExpiredError", "AbortedError"},
    ("sigstop", "before"): ANY,
    ("sigstop", "during"): ANY,
    ("sigstop", "after"): ANY,
}


@pytest.mark.parametrize("event,when", list(EXPECTED), ids=[f"{e}-{w}" for e, w in EXPECTED])
def test_ipc_token_read_is_exact_or_typed_never_reused(gpu_pair, claims, event, when):
    import torch

    from kvxfer import HoldToken, ReadRequest

    spec, prod, cons, cache, seeded = gpu_pair
    outcomes = []
    for trial in range(TRIALS):
        src, dst = split_ids(spec.num_blocks, N, trial, 20 + list(EXPECTED).index((event, when)))
        rid = f"{event}-{when}-{trial}"
        want = logical(spec, seeded, src)
        lease = {"before": 0.3, "during": 0.02, "after": AFTER_LEASE}[when] if event == "expiry" else None
        wire = prod.ask(("hold_token", rid, src, lease))
        assert wire is not None, "a plain hold got no token"
        held = []

        def end():   # the hold ends (or the producer stops) and, where it ends, its blocks are reused
            if event == "release":
                prod.ask(("release", rid))
            elif event == "abort":
                cons.abort(rid, remote=prod.address, wait=False)
            elif event == "sigstop":
                freeze(prod.proc.pid)
                return
            if when != "during":
                assert _reused(prod, rid), f"{rid}: the hold did not end"

        def after():
            held.append(prod.ask(("status", rid)))   # the hold still stood when the kernel completed
            end()

        if when == "before":
            end()
        try:
            with after_the_move(after if when == "after" else (lambda: None)):
                handle = cons.read_many([ReadRequest(prod.address, dst, src, rid, 10.0,
                                                     token=HoldToken.from_wire(wire))])[0]
            if when == "during" and event != "expiry":
                end()

            def check():
                torch.cuda.synchronize()
                got = [t.cpu().numpy() for t in cache]
                np.testing.assert_array_equal(logical(spec, got, dst), want,
                                              err_msg=f"{rid}: a token read succeeded with other bytes")

            outcomes.append(outcome(handle, check, 20.0))
        finally:
            if event == "sigstop":
                os.kill(prod.proc.pid, signal.SIGCONT)
        if when == "after":
            assert held == ["held"], f"{rid}: the hold had ended before its kernel completed ({held})"
        if outcomes[-1] != "exact" and event in ("none", "sigstop"):
            prod.ask(("release", rid))   # a failed read sent no done notice: the hold is still up
        # every hold ends and its blocks are reused before the cache is refilled (a late reuse
        # would otherwise land in a later trial's held blocks)
        assert _reused(prod, rid), f"{rid}: its blocks never came back"
        # an abort(wait=False) goes out on the producer's lane; a lane still busy with it would
        # send the next read through the claim (docs/reliability.md, the claim's fallbacks)
        assert wait_until(lambda: cons._lanes.idle(tuple(prod.address)), 10)
        prod.ask(("reset",))
    assert set(outcomes) <= EXPECTED[(event, when)], outcomes
    assert claims["n"] == 0, f"token reads sent {claims['n']} claims"
    print(f"{event} {when}:", outcomes)


def _dead(pid: int) -> bool:
    """``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _killing_consumer(out, address, pid, src, dst, rid, wire, when, spec_kwargs) -> None:
    """One token read in a process of its own (a fault in CUDA's context here cannot spoil the test
    process's): SIGKILL the producer ``before`` it, ``during`` it or ``after`` its kernel (before
    its look); reports the outcome."""
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

            def kill():
                os.kill(pid, signal.SIGKILL)
                assert wait_until(lambda: _dead(pid), 10), "the producer did not die"

            if when == "before":
                kill()
            with after_the_move(kill if when == "after" else (lambda: None)):
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


@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_ipc_token_reads_with_the_producer_killed_are_exact_or_typed(cuda, when):
    """SIGKILL of the producer before, during or after an IPC token read's kernel: the held bytes
    (nobody reused them: the engine died with the process) or a typed error, three times."""
    from kvxfer import KVSpec
    from kvxfer.testing import run_reporting

    spec = KVSpec(**BIG)
    kwargs = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    seen = []
    for trial in range(TRIALS):
        prod = OwnerProducer(spec, SEED, free_port_block(), 0)
        try:
            src, dst = split_ids(spec.num_blocks, N, trial, {"before": 8, "during": 9, "after": 10}[when])
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
