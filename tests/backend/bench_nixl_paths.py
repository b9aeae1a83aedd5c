"""Benchmark (not a test): NixlBackend.post vs prepare+post_prepared, real NIXL, two processes, DRAM.

    .venv/bin/python tests/backend/bench_nixl_paths.py [--mib 256] [--repeat 7]

READs ``--mib`` of DRAM from a peer process in 1, 64 and 8192 descriptors; remote rows are
shuffled so NIXL cannot merge neighbours. Each case times the posting call plus polling to DONE
and reports the median GB/s and the median time spent inside the posting call. ``raw-nixl`` is
the same request on the bare NIXL agent (initialize_xfer + transfer + poll), the baseline of the
same run. The three paths run interleaved (one of each per round) so load drifts hit all alike.
Bytes are checked after the warm-up round of every path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from nixl_peer import PeerProcess, pattern

from kvxfer.backend.base import descs
from kvxfer.backend.nixl import NixlBackend
from kvxfer.types import Direction, MemKind, Region

DRAM = MemKind.DRAM
PATHS = ("raw-nixl", "post", "prepared")


def posters(local, loc, rem):
    """For each path: a function that starts the request and returns a 'wait until done' function."""
    agent = local._agent  # the baseline deliberately bypasses kvxfer
    n = loc.shape[0]
    lp, rp = local.prepare(None, loc, DRAM), local.prepare("remote", rem, DRAM)
    idx = np.arange(n)

    def raw():
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(loc, "DRAM"),
                                  agent.get_xfer_descs(rem, "DRAM"), "remote", b"")
        st = agent.transfer(h)

        def finish():
            s = st
            while s == "PROC":
                s = agent.check_xfer_state(h)
            h.release()
            assert s == "DONE", s
        return finish

    def kvxfer_path(start):
        def go():
            x = start()

            def finish():
                while local.state(x).value == "pending":
                    pass
                assert local.state(x).value == "done"
                local.release(x)
            return finish
        return go

    post = kvxfer_path(lambda: local.post(Direction.READ, loc, DRAM, rem, DRAM, "remote", b""))
    prepared = kvxfer_path(lambda: local.post_prepared(Direction.READ, lp, idx, rp, idx, "remote", b""))
    return {"raw-nixl": raw, "post": post, "prepared": prepared}, (lp, rp)


def build_cost_us(local, loc, rem, repeat):
    """Median time to build (not post) one request: per-request lists vs prepared lists."""
    agent = local._agent
    lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
    rp = agent.prep_xfer_dlist("remote", rem, "DRAM")
    idx = np.arange(loc.shape[0])
    builds = {
        "post": lambda: agent.initialize_xfer("READ", agent.get_xfer_descs(loc, "DRAM"),
                                              agent.get_xfer_descs(rem, "DRAM"), "remote", b""),
        "prepared": lambda: agent.make_prepped_xfer("READ", lp, idx, rp, idx, b""),
    }
    out = {}
    for path, build in builds.items():
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            h = build()
            times.append((time.perf_counter() - t) * 1e6)
            h.release()
        out[path] = statistics.median(times)
    lp.release()
    rp.release()
    return out


def run_case(local, buf, remote_addr, expected, n, repeat):
    size = buf.nbytes // n
    perm = np.random.default_rng(n).permutation(n)
    loc = descs(buf.ctypes.data + np.arange(n, dtype=np.uint64) * size, size, 0)
    rem = descs(remote_addr + perm.astype(np.uint64) * size, size, 0)
    t = time.perf_counter()
    funcs, preps = posters(local, loc, rem)
    prep_ms = (time.perf_counter() - t) * 1e3
    rates = {p: [] for p in PATHS}
    post_us = {p: [] for p in PATHS}
    for rnd in range(repeat + 1):
        for path in PATHS:
            buf[:] = 0
            t0 = time.perf_counter()
            finish = funcs[path]()
            t1 = time.perf_counter()
            finish()
            t2 = time.perf_counter()
            if rnd == 0:  # warm-up round: check the bytes instead of timing
                assert np.array_equal(buf.reshape(n, size), expected.reshape(n, size)[perm]), path
                continue
            rates[path].append(buf.nbytes / (t2 - t0) / 1e9)
            post_us[path].append((t1 - t0) * 1e6)
    for p in preps:
        local.unprepare(p)
    build = build_cost_us(local, loc, rem, repeat)
    return {p: (statistics.median(rates[p]), statistics.median(post_us[p]), build.get(p))
            for p in PATHS}, prep_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    nbytes = args.mib << 20
    peer = PeerProcess("remote")
    local = NixlBackend("local")
    buf = np.zeros(nbytes, np.uint8)
    local.register([Region(buf.ctypes.data, nbytes, 0, DRAM)])
    try:
        info = peer.call("setup", nbytes=nbytes, seed=7)
        local.add_peer(bytes.fromhex(info["metadata"]))
        expected = pattern(nbytes, 7)
        print(f"| descriptors | size each | path | GB/s (median of {args.repeat}) | vs raw | "
              "time in posting call (ms) | building the request, no transfer (us) |")
        print("|---|---|---|---|---|---|---|")
        for n in (1, 64, 8192):
            res, prep_ms = run_case(local, buf, info["addr"], expected, n, args.repeat)
            for path in PATHS:
                gbs, us, build = res[path]
                each = nbytes // n
                size = f"{each >> 10} KiB" if each >= 1024 else f"{each} B"
                build_s = "" if build is None else f"{build:.0f}"
                print(f"| {n} | {size} | {path} | {gbs:.2f} | {gbs / res['raw-nixl'][0]:.2f} | "
                      f"{us / 1e3:.1f} | {build_s} |", flush=True)
            print(f"|  |  | (prepare both lists once: {prep_ms:.1f} ms) |  |  |  |  |")
    finally:
        local.close()
        peer.close()


if __name__ == "__main__":
    main()
