"""Hold tokens across two "hosts" (issue 35): after the move, one small NIXL READ of the producer's word.

The producer runs in one network namespace and the consumer in the other (UCX over TCP between
10.88.0.1 and 10.88.0.2). The namespaces share one kernel and /dev/shm, so the consumer is told not
to map the producer's table (``TokenReads.map_same_host = False``): it looks at the word as a
consumer on another machine must, with a 16-byte NIXL READ posted after the data READ completed.
The producer's engine overwrites a hold's blocks with ``REUSED`` the moment ``finished()`` lists it
(tests/chaos/chaos_peers.py), so a read that succeeded with bytes of an ended hold shows up as wrong
bytes. Each case runs three times: a token read is exact and sends no claim; release, expiry, the
consumer's abort, SIGSTOP (1 s) and SIGKILL of the producer before or during the move fail typed or
(a release or kill that came after the move and the look, a stopped producer that ran again) are
exact; none succeeds with other bytes; a stale token fails typed and leaves the new hold alone.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "chaos"))

from chaos_peers import BIG, Peer, _serve  # noqa: E402
from kvxfer import KVSpec  # noqa: E402
from kvxfer.testing import ProducerProcess  # noqa: E402

TRIALS = 3
PORT = 47371      # inside the pair's own namespaces
SIZE = 120        # blocks per read: 120 x 256 KiB = 30 MiB, so a signal can land mid-move
TYPED = {"LeaseExpiredError", "AbortedError", "PeerLostError", "TransferTimeoutError", "TransferFailedError"}


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _producer(cmd, out, host, spec_kwargs, seed, port) -> None:
    host.enter()
    os.environ["UCX_TLS"] = "tcp"
    _serve(cmd, out, spec_kwargs, seed, port, {"side_channel_host": host.address, "handshake_timeout": 30.0})


class _NsPeer(Peer):
    """A chaos peer (its engine reuses freed blocks) inside ``host``'s namespace."""

    def __init__(self, host, seed: int) -> None:
        self.spec = KVSpec(**BIG)
        kwargs = {k: getattr(self.spec, k) for k in self.spec.__dataclass_fields__}
        ProducerProcess.__init__(self, _producer, host, kwargs, seed, PORT)


def _consumer(cmd, out, host, spec_kwargs) -> None:
    """A consumer agent in ``host``'s namespace that looks at hold words over NIXL. Commands:
    ``("read", address, dst, src, rid, token, timeout)`` starts a token read; ``("abort", rid, address)``;
    ``("wait", timeout)``: the last read's outcome, ``(name, digest of dst, by_token, claims sent)``."""
    host.enter()
    os.environ["UCX_TLS"] = "tcp"
    from kvxfer import Agent, AgentConfig, HoldToken, KvxferError, ReadRequest
    from kvxfer.agent.claims import Claims
    from kvxfer.agent.tokens import TokenReads

    from chaos_peers import SENTINEL, cache_for

    TokenReads.map_same_host = False  # as on another machine: the word is read over NIXL
    claims = {"n": 0}
    for name in ("try_send_many", "send_many"):
        real = getattr(Claims, name)

        def counted(self, items, *args, _real=real, **kw):
            claims["n"] += len(items)
            return _real(self, items, *args, **kw)

        setattr(Claims, name, counted)
    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT + 10, handshake_timeout=30.0)
    with Agent("mh-token-consumer", spec, config) as agent:
        cache = cache_for(spec, 99)
        agent.register(cache)
        out.put(("ready", host.address))
        handle, dst = None, []
        while True:
            what = cmd.get(timeout=600)
            if what == "stop":
                return
            op, args = what[0], what[1:]
            if op == "connect":
                link = agent.connect(*args[0], refresh=True)
                out.put(bool(link.info.hold_words_addr))
            elif op == "read":
                address, dst, src, rid, wire, timeout = args
                for t in cache:
                    t[:, dst] = SENTINEL
                token = HoldToken.from_wire(wire) if wire is not None else None
                handle = agent.read_many([ReadRequest(tuple(address), dst, src, rid, timeout, token=token)])[0]
                out.put("started")
            elif op == "abort":
                agent.abort(args[0], remote=tuple(args[1]), wait=False)
                out.put(True)
            elif op == "wait":
                try:
                    stats = handle.wait(args[0])
                    name, by_token = "exact", stats.by_token
                except KvxferError as exc:
                    name, by_token = type(exc).__name__, False
                out.put((name, _digest(t[:, dst] for t in cache), by_token, claims["n"]))
            else:
                out.put(ValueError(f"unknown command {what!r}"))


class _Consumer(ProducerProcess):
    def __init__(self, host) -> None:
        spec = KVSpec(**BIG)
        super().__init__(_consumer, host, {k: getattr(spec, k) for k in spec.__dataclass_fields__})


def _ids(trial: int, salt: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(1000 * salt + trial)
    ids = rng.permutation(BIG["num_blocks"])[: 2 * SIZE]
    return ids[:SIZE].tolist(), ids[SIZE:].tolist()


def _wait_until(fn, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pair(hosts):
    producer_host, consumer_host = hosts
    started = []
    try:
        prod = _NsPeer(producer_host, seed=11)
        started.append(prod)
        cons = _Consumer(consumer_host)
        started.append(cons)
        yield producer_host, prod, cons, started
    finally:
        for proc in reversed(started):
            proc.stop()


def _read(prod, cons, src, dst, rid, lease=None, during=None, before=None, timeout=20.0):
    """Hold ``src`` with a token, optionally act ``before`` the read or ``during`` it, read by the
    token; returns (outcome, by_token, claims, the held bytes' digest, the destination's digest)."""
    want = _digest(prod.ask(("blocks", src)))
    wire = prod.ask(("hold_token", rid, src, lease, True))
    assert wire is not None, "a plain hold got no token"
    if before is not None:
        before()
    assert cons.ask(("read", prod.address_tuple, dst, src, rid, wire, timeout)) == "started"
    if during is not None:
        during()
    name, got, by_token, claims = cons.ask(("wait", timeout + 10), timeout=timeout + 30)
    return name, by_token, claims, want, got


def _settle(prod, rid) -> None:
    """Wait until the hold of ``rid`` ended and its blocks were reused, then refill the cache (a late
    reuse would otherwise land in a later trial's held blocks)."""
    assert _wait_until(lambda: rid in prod.ask(("reused",)), 20), f"{rid}: its blocks never came back"
    prod.ask(("reset",))


def test_token_reads_across_hosts_are_exact_or_typed_never_reused(pair):
    producer_host, prod, cons, started = pair
    prod.address_tuple = (producer_host.address, PORT)
    assert cons.ask(("connect", prod.address_tuple)), "the producer announced no NIXL address for its hold words"
    outcomes: dict[str, list[str]] = {}

    def case(label, salt, **kw):
        for trial in range(TRIALS):
            src, dst = _ids(trial, salt)
            name, by_token, claims, want, got = _read(prod, cons, src, dst, f"{label}-{trial}", **kw)
            outcomes.setdefault(label, []).append(name)
            if name == "exact":
                assert got == want, f"{label} trial {trial}: a token read succeeded with other bytes than the held ones"
                assert by_token, f"{label} trial {trial}: an exact read did not go by its token"
            else:
                assert name in TYPED, f"{label} trial {trial}: {name}"
            assert claims == 0, f"{label}: a token read sent a claim"
            _settle(prod, f"{label}-{trial}")

    # the plain case: exact, by the token, no claim
    case("exact", 1)
    assert outcomes["exact"] == ["exact"] * TRIALS

    # release before the move: the blocks were reused; the look sees 0 in the word
    def release_first(rid):
        return lambda: (prod.ask(("release", rid)),
                        _wait_until(lambda: rid in prod.ask(("reused",))))

    for trial in range(TRIALS):
        src, dst = _ids(trial, 2)
        rid = f"rel-before-{trial}"
        name, _, claims, want, got = _read(prod, cons, src, dst, rid, before=release_first(rid))
        assert name == "LeaseExpiredError" and claims == 0, name
        outcomes.setdefault("release before", []).append(name)
        _settle(prod, rid)

    # release during the move: exact (the release came after the look) or typed, never reused bytes
    for trial in range(TRIALS):
        src, dst = _ids(trial, 3)
        rid = f"rel-during-{trial}"
        name, by_token, claims, want, got = _read(prod, cons, src, dst, rid,
                                                  during=lambda rid=rid: prod.ask(("release", rid)))
        assert (name == "exact" and got == want and by_token) or name in TYPED, name
        assert claims == 0
        outcomes.setdefault("release during", []).append(name)
        _settle(prod, rid)

    # expiry before the move (a 0.3 s lease, waited out)
    for trial in range(TRIALS):
        src, dst = _ids(trial, 4)
        rid = f"exp-{trial}"
        name, _, claims, _, _ = _read(prod, cons, src, dst, rid, lease=0.3,
                                      before=lambda rid=rid: _wait_until(lambda: rid in prod.ask(("reused",))))
        assert name == "LeaseExpiredError" and claims == 0, name
        outcomes.setdefault("expiry before", []).append(name)
        _settle(prod, rid)

    # the consumer's abort during the move: typed, or exact if the move and the look came first
    for trial in range(TRIALS):
        src, dst = _ids(trial, 5)
        rid = f"abort-{trial}"
        name, by_token, claims, want, got = _read(
            prod, cons, src, dst, rid, during=lambda rid=rid: cons.ask(("abort", rid, prod.address_tuple)))
        assert (name == "exact" and got == want and by_token) or name in TYPED, name
        assert claims == 0
        outcomes.setdefault("abort during", []).append(name)
        _settle(prod, rid)

    # a stale token (the request held again since: an old epoch in its slot) fails typed, and the
    # new hold is untouched: still held, and read exactly by its own token
    for trial in range(TRIALS):
        src, dst = _ids(trial, 8)
        rid = f"stale-{trial}"
        old = prod.ask(("hold_token", rid, src, None, False))
        prod.ask(("release", rid))
        want = _digest(prod.ask(("blocks", src)))
        new = prod.ask(("hold_token", rid, src, None, True))
        assert new != old
        assert cons.ask(("read", prod.address_tuple, dst, src, rid, old, 20.0)) == "started"
        name, _, _, claims = cons.ask(("wait", 30), timeout=60)
        assert name == "LeaseExpiredError" and claims == 0, name
        assert prod.ask(("status", rid)) == "held", "a stale token's read changed the producer's new hold"
        assert cons.ask(("read", prod.address_tuple, dst, src, rid, new, 20.0)) == "started"
        name, got, by_token, claims = cons.ask(("wait", 30), timeout=60)
        assert name == "exact" and got == want and by_token and claims == 0, name
        outcomes.setdefault("stale token", []).append("LeaseExpiredError")
        _settle(prod, rid)

    # SIGSTOP of the producer before and during the move, for 1 s (its UCX answers neither the move nor
    # the look meanwhile): exact once it runs again (nothing could reuse the blocks while it was
    # stopped) or typed, never reused bytes
    def stop():
        os.kill(prod.proc.pid, signal.SIGSTOP)

    def resume_after_a_second():
        time.sleep(1.0)
        os.kill(prod.proc.pid, signal.SIGCONT)

    for when in ("before", "during"):
        for trial in range(TRIALS):
            src, dst = _ids(trial, 9 if when == "before" else 10)
            rid = f"stop-{when}-{trial}"
            acts = ({"before": stop, "during": resume_after_a_second} if when == "before"
                    else {"during": lambda: (stop(), resume_after_a_second())})
            name, by_token, claims, want, got = _read(prod, cons, src, dst, rid, **acts)
            assert (name == "exact" and got == want and by_token) or name in TYPED, name
            assert claims == 0
            outcomes.setdefault(f"SIGSTOP {when}", []).append(name)
            _settle(prod, rid)

    # SIGKILL of the producer before and during the move: typed (or exact: the move and the look were done)
    for when in ("before", "during"):
        for trial in range(TRIALS):
            src, dst = _ids(trial, 6 if when == "before" else 7)
            rid = f"kill-{when}-{trial}"
            kill = lambda: (os.kill(prod.proc.pid, signal.SIGKILL), prod.proc.join(10))  # noqa: E731
            name, by_token, claims, want, got = _read(prod, cons, src, dst, rid, timeout=8.0 if when == "during" else 3.0,
                                                      **{when: kill})
            if when == "before":
                assert name in TYPED, name
            else:
                assert (name == "exact" and got == want and by_token) or name in TYPED, name
            assert claims == 0
            outcomes.setdefault(f"SIGKILL {when}", []).append(name)
            started.remove(prod)
            prod = _NsPeer(producer_host, seed=11)      # a new producer at the same address
            started.append(prod)
            prod.address_tuple = (producer_host.address, PORT)
            assert cons.ask(("connect", prod.address_tuple))
    print("outcomes:", outcomes)
