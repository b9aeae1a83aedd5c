"""Hold tokens across two "hosts" (issue 35): after the move, one small NIXL READ of the producer's word.

The producer runs in one network namespace and the consumer in the other (UCX over TCP between
10.88.0.1 and 10.88.0.2). The namespaces share one kernel and /dev/shm, so the consumer is told not
to map the producer's table (``TokenReads.map_same_host = False``): it looks at the word as a
consumer on another machine must, with a 16-byte NIXL READ posted after the data READ completed.
The producer's engine overwrites a hold's blocks with ``REUSED`` the moment ``finished()`` lists it
(``token_faults.ReusingEngine``), so a read that succeeded with bytes of an ended hold shows up as
wrong bytes. One producer and one consumer serve the module (a new producer after each SIGKILL).
Each case runs three times: a token read is exact and sends no claim; release, expiry, the
consumer's abort, SIGSTOP and SIGKILL of the producer, each before, during and after the move
("after": the data READ completed, the word not yet read; the consumer stops there until the
test has acted, ``token_faults.after_the_move``): typed or exact as the matrix in
docs/reliability.md says, none succeeds with other bytes; a stale token fails typed and leaves the
new hold alone.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
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
from kvxfer.bench.hosts import HostsUnavailableError, two_hosts  # noqa: E402
from kvxfer.testing import ProducerProcess  # noqa: E402
from token_faults import TYPED, freeze, split_ids, wait_until  # noqa: E402

TRIALS = 3
PORT = 47371      # inside the pair's own namespaces
SIZE = 120        # blocks per read: 120 x 256 KiB = 30 MiB, so a signal can land mid-move
#: the lease of a hold that must outlive its move and end before the look ("expiry after")
AFTER_LEASE = 1.5


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
        self.address_tuple = (host.address, PORT)


def _consumer(cmd, out, host, spec_kwargs, moved, go) -> None:
    """A consumer agent in ``host``'s namespace that looks at hold words over NIXL. Commands:
    ``("read", address, dst, src, rid, token, timeout, hook)`` starts a token read (with ``hook``,
    once its move completed it sets ``moved`` and waits for ``go`` before its look);
    ``("abort", rid, address)``; ``("wait", timeout)``: the last read's outcome,
    ``(name, digest of dst, by_token, claims sent since the read started)``."""
    host.enter()
    os.environ["UCX_TLS"] = "tcp"
    from kvxfer import Agent, AgentConfig, HoldToken, KvxferError, ReadRequest
    from kvxfer.agent.tokens import TokenReads

    from chaos_peers import SENTINEL, cache_for
    from token_faults import after_the_move, count_claims

    TokenReads.map_same_host = False  # as on another machine: the word is read over NIXL
    claims = count_claims()

    def stop_after_the_move():
        moved.set()
        go.wait(120)

    spec = KVSpec(**spec_kwargs)
    config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT + 10, handshake_timeout=30.0)
    with Agent("mh-token-consumer", spec, config) as agent:
        cache = cache_for(spec, 99)
        agent.register(cache)
        out.put(("ready", host.address))
        handle, dst, base = None, [], 0
        while True:
            what = cmd.get(timeout=600)
            if what == "stop":
                return
            op, args = what[0], what[1:]
            if op == "connect":
                link = agent.connect(*args[0], refresh=True)
                out.put(bool(link.info.hold_words_addr))
            elif op == "read":
                base = claims["n"]   # the claims this read sends are counted from here
                address, dst, src, rid, wire, timeout, hook = args
                for t in cache:
                    t[:, dst] = SENTINEL
                token = HoldToken.from_wire(wire) if wire is not None else None
                with after_the_move(stop_after_the_move if hook else (lambda: None)):
                    handle = agent.read_many([ReadRequest(tuple(address), dst, src, rid, timeout, token=token)])[0]
                out.put("started")
            elif op == "abort":
                # wait=True: the abort goes out on this thread, not on the producer's lane; a lane
                # still busy with it would send the next read through the claim (submit.py's
                # ``lanes.idle``), which is not the token path these cases test
                agent.abort(args[0], remote=tuple(args[1]))
                out.put(True)
            elif op == "wait":
                try:
                    stats = handle.wait(args[0])
                    name, by_token = "exact", stats.by_token
                except KvxferError as exc:
                    name, by_token = type(exc).__name__, False
                out.put((name, _digest(t[:, dst] for t in cache), by_token, claims["n"] - base))
            else:
                out.put(ValueError(f"unknown command {what!r}"))


class _Consumer(ProducerProcess):
    def __init__(self, host) -> None:
        spec = KVSpec(**BIG)
        ctx = mp.get_context("spawn")
        self.moved, self.go = ctx.Event(), ctx.Event()
        self._started = 0   # "started" answers that came while the test asked something else
        super().__init__(_consumer, host, {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                         self.moved, self.go)

    def ask(self, what, timeout: float = 120.0):
        """The answer to ``what``; a read's "started" that comes first (the read's move completed and
        the test acted on it before taking that answer) is kept for ``started``."""
        self.cmd.put(what)
        while True:
            got = self.out.get(timeout=timeout)
            if got == "started" and what[0] != "read":
                self._started += 1
                continue
            return got

    def started(self) -> None:
        """Take a read's "started" answer."""
        if self._started:
            self._started -= 1
            return
        assert self.out.get(timeout=60) == "started"


class _Pair:
    """The module's producer (replaced after a SIGKILL) and consumer."""

    def __init__(self, producer_host, consumer_host) -> None:
        self.host = producer_host
        self.prod = _NsPeer(producer_host, seed=11)
        self.cons = _Consumer(consumer_host)
        self.connect()

    def connect(self) -> None:
        assert self.cons.ask(("connect", self.prod.address_tuple)), \
            "the producer announced no NIXL address for its hold words"

    def new_producer(self) -> None:
        """A new producer at the same address (the last one was killed)."""
        self.prod.stop()
        self.prod = _NsPeer(self.host, seed=11)
        self.connect()


@pytest.fixture(scope="module")
def pair():
    try:
        with two_hosts() as (producer_host, consumer_host):
            made = _Pair(producer_host, consumer_host)
            try:
                yield made
            finally:
                made.cons.stop()
                made.prod.stop()
    except HostsUnavailableError as exc:
        pytest.skip(str(exc))


def _reused(prod, rid, timeout: float = 15.0) -> bool:
    return wait_until(lambda: rid in prod.ask(("reused",)), timeout)


def _read(pair, src, dst, rid, *, lease=None, before=None, during=None, after=None, timeout=20.0):
    """Hold ``src`` with a token, act ``before`` the read, ``during`` it (once it is posted) or
    ``after`` its move (before its look), read by the token; returns (outcome, by_token, claims,
    the held bytes' digest, the destination's digest)."""
    prod, cons = pair.prod, pair.cons
    want = _digest(prod.ask(("blocks", src)))
    wire = prod.ask(("hold_token", rid, src, lease, True))
    assert wire is not None, "a plain hold got no token"
    if before is not None:
        before()
    cons.moved.clear()
    cons.go.clear()
    cons.cmd.put(("read", prod.address_tuple, dst, src, rid, wire, timeout, after is not None))
    moved = True
    if after is not None:
        try:
            moved = cons.moved.wait(timeout + 10)
            if moved:
                after()
        finally:
            cons.go.set()
    cons.started()
    if during is not None:
        during()
    name, got, by_token, claims = cons.ask(("wait", timeout + 10), timeout=timeout + 30)
    assert moved, f"{rid}: the read never reached its look (outcome {name}, {claims} claims sent)"
    return name, by_token, claims, want, got


#: (event, moment) -> the outcomes each trial may have ("exact": the held bytes, checked)
ANY = TYPED | {"exact"}
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
    # the look needs the producer's UCX: a stopped producer cannot answer it, the read fails closed
    ("sigstop", "after"): TYPED,
    ("sigkill", "before"): TYPED,
    ("sigkill", "during"): ANY,
    ("sigkill", "after"): TYPED,
}


@pytest.mark.parametrize("event,when", list(EXPECTED), ids=[f"{e}-{w}" for e, w in EXPECTED])
def test_token_read_across_hosts_is_exact_or_typed_never_reused(pair, event, when):
    outcomes = []
    for trial in range(TRIALS):
        src, dst = split_ids(BIG["num_blocks"], SIZE, trial, 20 + list(EXPECTED).index((event, when)))
        rid = f"{event}-{when}-{trial}"
        prod = pair.prod
        held = []

        def status():
            held.append(prod.ask(("status", rid)))

        def stop():
            freeze(prod.proc.pid)

        def resume_after_a_second():
            time.sleep(1.0)   # the producer stays stopped for a second: the case's own duration
            os.kill(prod.proc.pid, signal.SIGCONT)

        def kill():
            os.kill(prod.proc.pid, signal.SIGKILL)
            prod.proc.join(10)

        kw: dict = {}
        timeout = 20.0
        if event == "release":
            end = {"before": lambda: (prod.ask(("release", rid)), _reused(prod, rid)),
                   "during": lambda: prod.ask(("release", rid)),
                   "after": lambda: (status(), prod.ask(("release", rid)), _reused(prod, rid))}
            kw[when] = end[when]
        elif event == "expiry":
            kw["lease"] = {"before": 0.3, "during": 0.02, "after": AFTER_LEASE}[when]
            if when != "during":
                kw[when] = ((lambda: _reused(prod, rid)) if when == "before"
                            else (lambda: (status(), _reused(prod, rid))))
        elif event == "abort":
            abort = lambda: pair.cons.ask(("abort", rid, prod.address_tuple))  # noqa: E731
            kw[when] = {"before": lambda: (abort(), _reused(prod, rid)), "during": abort,
                        "after": lambda: (status(), abort(), _reused(prod, rid))}[when]
        elif event == "sigstop":
            kw.update({"before": {"before": stop, "during": resume_after_a_second},
                       "during": {"during": lambda: (stop(), resume_after_a_second())},
                       "after": {"after": lambda: (status(), stop())}}[when])
            if when == "after":
                timeout = 5.0   # the read's deadline binds while its look is out
        elif event == "sigkill":
            kw[when] = (lambda: (status(), kill())) if when == "after" else kill
            timeout = 3.0 if when == "before" else 8.0
        try:
            name, by_token, claims, want, got = _read(pair, src, dst, rid, timeout=timeout, **kw)
        finally:
            if event == "sigstop":
                os.kill(prod.proc.pid, signal.SIGCONT)
        outcomes.append(name)
        if name == "exact":
            assert got == want, f"{rid}: a token read succeeded with other bytes than the held ones"
            assert by_token, f"{rid}: an exact read did not go by its token"
        assert name in EXPECTED[(event, when)], f"{rid}: {name}"
        assert claims == 0, f"{rid}: a token read sent a claim"
        if when == "after":
            assert held == ["held"], f"{rid}: the hold had ended before its move completed ({held})"
        if event == "sigkill":
            pair.new_producer()
            continue
        if event == "sigstop" and name != "exact":
            prod.ask(("release", rid))   # the failed read sent no done notice: the hold is still up
        # every hold ends and its blocks are reused before the cache is refilled (a late reuse
        # would otherwise land in a later trial's held blocks)
        assert _reused(prod, rid, 20), f"{rid}: its blocks never came back"
        prod.ask(("reset",))
    print(f"{event} {when}:", outcomes)


def test_a_stale_token_across_hosts_fails_typed_and_leaves_the_new_hold_alone(pair):
    """The request held again since (an old epoch in its slot): typed, the new hold still held, and
    read exactly by its own token."""
    prod, cons = pair.prod, pair.cons
    for trial in range(TRIALS):
        src, dst = split_ids(BIG["num_blocks"], SIZE, trial, 8)
        rid = f"stale-{trial}"
        old = prod.ask(("hold_token", rid, src, None, False))
        prod.ask(("release", rid))
        want = _digest(prod.ask(("blocks", src)))
        new = prod.ask(("hold_token", rid, src, None, True))
        assert new != old
        assert cons.ask(("read", prod.address_tuple, dst, src, rid, old, 20.0, False)) == "started"
        name, _, _, claims = cons.ask(("wait", 30), timeout=60)
        assert name == "LeaseExpiredError" and claims == 0, name
        assert prod.ask(("status", rid)) == "held", "a stale token's read changed the producer's new hold"
        assert cons.ask(("read", prod.address_tuple, dst, src, rid, new, 20.0, False)) == "started"
        name, got, by_token, claims = cons.ask(("wait", 30), timeout=60)
        assert name == "exact" and got == want and by_token and claims == 0, name
        assert _reused(prod, rid, 20)
        prod.ask(("reset",))
