"""NixlBackend over real NIXL/UCX between this process and a peer process on loopback."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from nixl_peer import PeerProcess, pattern

from kvxfer.backend.base import Backend, descs
from kvxfer.backend.nixl import NixlBackend
from kvxfer.errors import ClosedError, ConfigError, KvxferError, PeerLostError, RegistrationError
from kvxfer.types import Direction, MemKind, Region, XferState

DRAM = MemKind.DRAM
SIZE = 64 << 20
SEED = 1234


def wait(backend: NixlBackend, xfer: int, timeout: float = 30.0) -> XferState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = backend.state(xfer)
        if state is not XferState.PENDING:
            return state
    return XferState.PENDING


@pytest.fixture(scope="module")
def link():
    """This process's agent 'local' and a peer process 'remote' holding 64 MiB of seeded bytes."""
    peer = PeerProcess("remote")
    local = NixlBackend("local")
    buf = np.zeros(SIZE, np.uint8)
    handle = local.register([Region(buf.ctypes.data, buf.nbytes, 0, DRAM)])
    try:
        info = peer.call("setup", nbytes=SIZE, seed=SEED)
        assert local.add_peer(bytes.fromhex(info["metadata"])) == "remote"
        assert peer.call("add_peer", metadata=local.metadata().hex())["name"] == "local"
        yield local, peer, buf, info["addr"], handle
    finally:
        local.close()
        peer.close()


def test_nixl_backend_is_a_backend(link):
    assert isinstance(link[0], Backend)


def test_read_64mib_with_several_descriptors(link):
    local, peer, buf, remote_addr, _ = link
    chunk = SIZE // 16
    perm = np.random.default_rng(0).permutation(16)  # local chunk i <- remote chunk perm[i]
    loc = descs(buf.ctypes.data + np.arange(16, dtype=np.uint64) * chunk, chunk, 0)
    rem = descs(remote_addr + perm.astype(np.uint64) * chunk, chunk, 0)
    buf[:] = 0
    x = local.post(Direction.READ, loc, DRAM, rem, DRAM, "remote", b"read-64")
    assert wait(local, x) is XferState.DONE
    local.release(x)
    expected = pattern(SIZE, SEED).reshape(16, chunk)[perm].reshape(-1)
    assert np.array_equal(buf, expected)
    got = peer.call("notifs", want=1, timeout=10)["notifs"]
    assert got == [["local", b"read-64".hex()]]


def test_prepared_write_lands_in_peer(link):
    local, peer, buf, remote_addr, _ = link
    n, size = 64, 4096
    buf[: n * size] = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
    lp = local.prepare(None, descs(buf.ctypes.data + np.arange(n, dtype=np.uint64) * size, size, 0), DRAM)
    rp = local.prepare("remote", descs(remote_addr + np.arange(n, dtype=np.uint64) * size, size, 0), DRAM)
    # local row i goes to remote row n-1-i: the peer's first n*size bytes become our rows reversed
    x = local.post_prepared(Direction.WRITE, lp, np.arange(n), rp, np.arange(n)[::-1], "remote", b"w")
    assert wait(local, x) is XferState.DONE
    local.release(x)
    expected = buf[: n * size].reshape(n, size)[::-1].tobytes()
    assert peer.call("digest", offset=0, length=n * size)["sha256"] == hashlib.sha256(expected).hexdigest()
    assert peer.call("notifs", want=1, timeout=10)["notifs"] == [["local", b"w".hex()]]
    with pytest.raises(ConfigError, match=r"remote indices must lie in \[0, 64\); got range \[0, 64\]"):
        local.post_prepared(Direction.WRITE, lp, np.arange(2), rp, np.array([0, 64]), "remote", b"")
    local.unprepare(lp)
    local.unprepare(rp)


def test_notifications_both_ways(link):
    local, peer, *_ = link
    local.notify("remote", b"ping")
    assert peer.call("notifs", want=1, timeout=10)["notifs"] == [["local", b"ping".hex()]]
    peer.call("notify", peer="local", msg=b"pong".hex())
    got, deadline = [], time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = local.notifications()
    assert got == [("remote", b"pong")]


def _runs_beside_a_stuck_call(local: NixlBackend, nixl_call: str, stuck, beside) -> bool:
    """Run ``stuck()`` on a thread, its first ``nixl_call`` into NIXL held inside NIXL, and then
    ``beside()`` on another thread; True when ``beside`` finished while the first was held."""
    inside, let_go = threading.Event(), threading.Event()
    real = getattr(local._agent, nixl_call)

    def held(*args, **kwargs):  # the first call to come through stays inside until let go
        if not inside.is_set():
            inside.set()
            let_go.wait(20)
        return real(*args, **kwargs)

    setattr(local._agent, nixl_call, held)
    first, runner = threading.Thread(target=stuck), threading.Thread(target=beside)
    try:
        first.start()
        assert inside.wait(10)
        runner.start()
        runner.join(8)
        return not runner.is_alive()
    finally:
        let_go.set()
        first.join(20)
        if runner.ident is not None:
            runner.join(20)
        delattr(local._agent, nixl_call)


def test_a_stalled_post_holds_up_no_other_transfer(link):
    """One thread's post stuck inside NIXL (a slow peer) must not stop another thread from
    posting, polling and releasing its own transfer: data calls run side by side. With one
    agent-wide lock around every NIXL call (before), the second read waited for the first."""
    local, _, buf, remote_addr, _ = link
    chunk = 1 << 20
    stalled_ids, other = [], {}

    def stalled():
        stalled_ids.append(local.post(Direction.READ, descs(np.array([buf.ctypes.data]), chunk, 0), DRAM,
                                      descs(np.array([remote_addr + 32 * chunk]), chunk, 0), DRAM, "remote", b"stall"))

    def second():
        x = local.post(Direction.READ, descs(np.array([buf.ctypes.data + chunk]), chunk, 0), DRAM,
                       descs(np.array([remote_addr + 37 * chunk]), chunk, 0), DRAM, "remote", b"other")
        other["state"] = wait(local, x, timeout=10)
        local.release(x)

    buf[: 2 * chunk] = 0
    assert _runs_beside_a_stuck_call(local, "transfer", stalled, second), "the second read waited for the stalled post"
    assert other["state"] is XferState.DONE
    assert np.array_equal(buf[chunk: 2 * chunk], pattern(SIZE, SEED)[37 * chunk: 38 * chunk])
    assert wait(local, stalled_ids[0]) is XferState.DONE
    local.release(stalled_ids[0])
    assert np.array_equal(buf[:chunk], pattern(SIZE, SEED)[32 * chunk: 33 * chunk])


def test_a_list_being_prepared_holds_up_no_transfer(link):
    """Preparing a peer's descriptor list (NIXL's ``prep_xfer_dlist``, stuck inside NIXL here)
    must not stop another thread's read: NIXL prepares under its shared lock. While ``prepare``
    was a control call, every transfer of the agent waited for the list (an engine's ``read()``
    blocked behind another link's first prepared read)."""
    local, _, buf, remote_addr, _ = link
    chunk, n = 1 << 20, 8
    prepared, other = [], {}

    def preparing():
        prepared.append(local.prepare("remote", descs(remote_addr + np.arange(n, dtype=np.uint64) * chunk, chunk, 0),
                                      DRAM))

    def reading():
        x = local.post(Direction.READ, descs(np.array([buf.ctypes.data + chunk]), chunk, 0), DRAM,
                       descs(np.array([remote_addr + 41 * chunk]), chunk, 0), DRAM, "remote", b"beside")
        other["state"] = wait(local, x, timeout=10)
        local.release(x)

    buf[chunk: 2 * chunk] = 0
    assert _runs_beside_a_stuck_call(local, "prep_xfer_dlist", preparing, reading), \
        "a read waited for a list being prepared"
    assert other["state"] is XferState.DONE
    assert np.array_equal(buf[chunk: 2 * chunk], pattern(SIZE, SEED)[41 * chunk: 42 * chunk])
    local.unprepare(prepared[0])


def test_many_threads_post_poll_and_release_together(link):
    """Eight threads each post, poll (racing each other's polls of the same transfer) and
    release reads of distinct slices: every read lands exactly, no call fails."""
    local, _, buf, remote_addr, _ = link
    size, n, base = 256 << 10, 8, 40 << 20  # remote slices no other test writes
    buf[: n * size] = 0
    expected = pattern(SIZE, SEED)
    errors, xids = [], [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        try:
            barrier.wait(10)
            xids[i] = local.post(Direction.READ, descs(np.array([buf.ctypes.data + i * size]), size, 0), DRAM,
                                 descs(np.array([remote_addr + base + (n - 1 - i) * size]), size, 0), DRAM, "remote", b"")
            peer_id = xids[(i + 1) % n]  # poll a neighbour's transfer too, when it exists
            while local.state(xids[i]) is XferState.PENDING:
                if peer_id is not None:
                    try:
                        local.state(peer_id)
                    except ConfigError:
                        pass  # released by its owner meanwhile: unknown, as documented
            assert local.state(xids[i]) is XferState.DONE
            local.release(xids[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for i in range(n):
        assert np.array_equal(buf[i * size: (i + 1) * size], expected[base + (n - 1 - i) * size: base + (n - i) * size])


def test_unregistered_remote_range_is_registration_error(link):
    local, _, buf, remote_addr, _ = link
    with pytest.raises(RegistrationError, match="nixlNotFoundError") as info:
        local.post(Direction.READ, descs(np.array([buf.ctypes.data]), 4096, 0), DRAM,
                   descs(np.array([remote_addr + SIZE]), 4096, 0), DRAM, "remote", b"")
    assert type(info.value.__cause__).__name__ == "nixlNotFoundError"


def test_deregistered_local_memory_is_refused(link):
    local, _, _, remote_addr, _ = link
    extra = np.zeros(1 << 16, np.uint8)
    h = local.register([Region(extra.ctypes.data, extra.nbytes, 0, DRAM)])
    row = descs(np.array([extra.ctypes.data]), 4096, 0)
    remote = descs(np.array([remote_addr + SIZE - 4096]), 4096, 0)  # a slice no test writes
    x = local.post(Direction.READ, row, DRAM, remote, DRAM, "remote", b"")
    assert wait(local, x) is XferState.DONE
    local.release(x)
    assert np.array_equal(extra[:4096], pattern(SIZE, SEED)[-4096:])
    local.deregister(h)
    with pytest.raises(RegistrationError):
        local.post(Direction.READ, row, DRAM, remote, DRAM, "remote", b"")
    with pytest.raises(ConfigError, match="unknown registration handle"):
        local.deregister(h)


def test_bad_input_is_typed(link):
    local, _, buf, remote_addr, _ = link
    one = descs(np.array([buf.ctypes.data]), 64, 0)
    with pytest.raises(ConfigError, match="unknown peer 'nobody'"):
        local.post(Direction.READ, one, DRAM, one, DRAM, "nobody", b"")
    with pytest.raises(ConfigError, match=r"shape \[N, 3\]; got \(3,\)"):
        local.post(Direction.READ, one[0], DRAM, one, DRAM, "remote", b"")
    with pytest.raises(ConfigError, match="at least 1 row; got 0"):
        local.post(Direction.READ, one[:0], DRAM, one[:0], DRAM, "remote", b"")
    with pytest.raises(ConfigError, match=r"direction must be one of \['READ', 'WRITE'\]; got 'PULL'"):
        local.post("PULL", one, DRAM, one, DRAM, "remote", b"")
    with pytest.raises(ConfigError, match="unknown transfer id 999999"):
        local.state(999999)


def test_unknown_backend_lists_available():
    with pytest.raises(ConfigError, match=r"unknown NIXL backend\(s\) \['NOPE'\].*'UCX'"):
        NixlBackend("cfg-check", backends=("UCX", "NOPE"))


def test_close_is_idempotent_and_final():
    b = NixlBackend("closing")
    buf = np.zeros(4096, np.uint8)
    b.register([Region(buf.ctypes.data, buf.nbytes, 0, DRAM)])
    b.close()
    b.close()
    for call in (b.metadata, b.notifications, lambda: b.register([Region(buf.ctypes.data, 64, 0, DRAM)])):
        with pytest.raises(ClosedError):
            call()
    assert issubclass(ClosedError, KvxferError)


def test_dead_peer_process_is_peer_lost():
    peer = PeerProcess("doomed")
    local = NixlBackend("survivor")
    buf = np.zeros(1 << 16, np.uint8)
    local.register([Region(buf.ctypes.data, buf.nbytes, 0, DRAM)])
    try:
        info = peer.call("setup", nbytes=1 << 16, seed=3)
        local.add_peer(bytes.fromhex(info["metadata"]))
        loc = descs(np.array([buf.ctypes.data]), 4096, 0)
        rem = descs(np.array([info["addr"]]), 4096, 0)
        x = local.post(Direction.READ, loc, DRAM, rem, DRAM, "doomed", b"")
        assert wait(local, x) is XferState.DONE
        local.release(x)
        peer.proc.kill()
        peer.proc.wait()
        with pytest.raises(PeerLostError, match="nixlRemoteDisconnectError"):
            x = local.post(Direction.READ, loc, DRAM, rem, DRAM, "doomed", b"")
            # should UCX notice only later, the transfer must fail, not hang
            assert wait(local, x) is XferState.FAILED
            raise local.failure(x)
        with pytest.raises(PeerLostError):
            local.notify("doomed", b"anyone?")
    finally:
        local.close()
        peer.close()


def test_progress_thread_option_starts_nixls_thread_or_not():
    import os

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    agents = [NixlBackend("warm", progress_thread=False)]  # process-wide UCX threads start here
    try:
        added = {}
        for flag in (False, True):
            before = threads()
            agents.append(NixlBackend(f"thread-{flag}", progress_thread=flag))
            added[flag] = threads() - before
        assert (added[False], added[True]) == (0, 1)
    finally:
        for agent in agents:
            agent.close()


def _new_threads_cpu(make, seconds: float = 1.0) -> float:
    """Cores' worth of CPU taken, while idle for ``seconds``, by the threads ``make()`` starts."""
    import os

    def ticks(tids) -> int:
        total = 0
        for tid in tids:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return total

    NixlBackend("warm-ucx", progress_thread=False).close()  # process-wide UCX threads start here
    before = set(os.listdir("/proc/self/task"))
    backend = make()
    try:
        new = set(os.listdir("/proc/self/task")) - before
        assert new, "the backend started no thread"
        start = ticks(new)
        time.sleep(seconds)
        return (ticks(new) - start) / os.sysconf("SC_CLK_TCK") / seconds
    finally:
        backend.close()


def test_a_progress_thread_with_a_delay_waits_for_events_instead_of_spinning():
    """NIXL's Python API always makes its progress thread spin (a core per agent); kvxfer's
    ``progress_delay_us`` makes it sleep in poll() until UCX has work (config: auto on < 8 cores)."""
    spinning = _new_threads_cpu(lambda: NixlBackend("spins", progress_thread=True))
    waiting = _new_threads_cpu(lambda: NixlBackend("waits", progress_thread=True, progress_delay_us=1000))
    # the spinning thread's share depends on how loaded the host is; the waiting one's does not
    assert waiting < 0.1 and spinning > 5 * waiting, (spinning, waiting)
    with pytest.raises(ConfigError, match="progress_delay_us must be an int >= 0; got -1"):
        NixlBackend("bad", progress_delay_us=-1)
