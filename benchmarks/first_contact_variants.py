"""Where a fresh consumer's first read across two "hosts" spends its time, against a warm read.

Two network namespaces joined by a veth pair (root; UCX over TCP), one producer ``Agent`` that
holds every request for the whole run, and per round a *new* consumer ``Agent`` (new NIXL agent,
UCX worker and endpoint) that reads once as a first contact and once warm, the same size. Rounds
cycle through the variants:

* ``none``: the first read goes out with no ``connect()`` (as users meet it; the handshake is in
  the read);
* ``connect``: ``Agent.connect()`` first (its probe reads wire the endpoint up), timed with the read.

Per read it records the wall time, the read's ``setup`` and ``post_to_done`` (``TransferStats``),
the consumer process's CPU time, and from the backend: how long NIXL's post took, on which
thread, and how many status polls the transfer needed until done (a post that returns at once
and many polls: UCX queued the operations behind the endpoint's wire-up and they drained one
progress call at a time). The first round is the process's first agent and is reported apart.
The consumer's cache is a fresh ``np.zeros``, never written: before ``register()`` faulted such
pages in (kvxfer/memory/prefault.py), the first reads here paid the kernel's page faults for
their destination blocks (the +162 ms of a process's first agent; ``KVXFER_PREFAULT=0`` shows it
again; benchmarks/new_process_first_read.py counts them).
Medians per variant; first - warm is the median of each round's pair.

Run:  .venv/bin/python benchmarks/first_contact_variants.py [--mib 64] [--rounds 12]
"""

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import threading
import time

import numpy as np

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
PORT = 47600
VARIANTS = ("none", "connect")


def _ids(seed: int, blocks: int, n: int) -> list[int]:
    return np.random.default_rng(seed).permutation(blocks)[:n].tolist()


def _producer(host, blocks: int, n: int, rounds: int, ready, stop) -> None:
    host.enter()
    os.environ.setdefault("UCX_TLS", "tcp")
    from kvxfer import Agent, AgentConfig, KVSpec

    spec = KVSpec(num_blocks=blocks, **SHAPE)
    config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT, handshake_timeout=60.0)
    with Agent("fcv-producer", spec, config) as agent:
        agent.register([np.ones(s, dtype=np.uint16) for s in spec.tensor_shapes()])
        agent.listen()
        for r in range(rounds):
            for kind in ("first", "warm"):
                agent.hold(f"r{r}-{kind}", _ids(r, blocks, n), consumers=1, lease=600)
        ready.set()
        stop.wait(1800)


def _instrument(backend_cls, log: list) -> None:
    """Record each post's duration and thread, and count status polls per transfer."""
    post, state = backend_cls.post, backend_cls.state

    def timed_post(self, *args, **kwargs):
        t0 = time.perf_counter()
        xid = post(self, *args, **kwargs)
        log.append(("post", xid, time.perf_counter() - t0, threading.current_thread().name))
        return xid

    def counted_state(self, xid):
        log.append(("poll", xid))
        return state(self, xid)

    backend_cls.post, backend_cls.state = timed_post, counted_state


def _consumer(host, producer_address: str, blocks: int, n: int, rounds: int, ready, out) -> None:
    host.enter()
    os.environ.setdefault("UCX_TLS", "tcp")
    from kvxfer import Agent, AgentConfig, KVSpec
    from kvxfer.backend.nixl import NixlBackend

    log: list = []
    _instrument(NixlBackend, log)
    spec = KVSpec(num_blocks=blocks, **SHAPE)
    cache = [np.zeros(s, dtype=np.uint16) for s in spec.tensor_shapes()]
    remote = (producer_address, PORT)
    ready.wait(600)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def one(agent, rid: str, local, remote_ids, connect: bool) -> dict:
        del log[:]
        c0, t0 = cpu(), time.perf_counter()
        if connect:
            agent.connect(*remote)
            del log[:]  # the probe's own posts and polls are not the read's
        stats = agent.read(remote, local, remote_ids, rid, timeout=300).wait()
        wall, c1 = time.perf_counter() - t0, cpu()
        posts = [e for e in log if e[0] == "post" and e[1] is not None]
        xids = {e[1] for e in posts}
        return {"ms": wall * 1e3, "setup": stats.setup_seconds * 1e3, "post_to_done": stats.seconds * 1e3,
                "cpu_ms": (c1 - c0) * 1e3, "nixl_post_ms": sum(e[2] for e in posts) * 1e3,
                "posted_on": sorted({e[3] for e in posts}),
                "polls": sum(1 for e in log if e[0] == "poll" and e[1] in xids)}

    for r in range(rounds):
        variant = VARIANTS[(r - 1) % len(VARIANTS)] if r else "none"
        config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT + 10 + r, handshake_timeout=60.0)
        with Agent(f"fcv-consumer-{r}", spec, config) as agent:
            agent.register(cache)
            local, remote_ids = _ids(10_000 + r, blocks, n), _ids(r, blocks, n)
            first = one(agent, f"r{r}-first", local, remote_ids, variant == "connect")
            warm = one(agent, f"r{r}-warm", local, remote_ids, False)
        out.put({"round": r, "variant": variant, "first": first, "warm": warm, "load": os.getloadavg()[0]})
    out.put(None)


def _summary(rows: list[dict]) -> None:
    def med(rs, side, key):
        return statistics.median(x[side][key] for x in rs)

    for name, rs in [("process's first agent", rows[:1])] + [(v, [x for x in rows[1:] if x["variant"] == v])
                                                              for v in VARIANTS]:
        if not rs:
            continue
        gaps = [round(x["first"]["ms"] - x["warm"]["ms"], 1) for x in rs]
        print(f"{name:>22}: n={len(rs)} first {med(rs, 'first', 'ms'):.1f} ms, warm {med(rs, 'warm', 'ms'):.1f} ms, "
              f"first - warm {statistics.median(gaps):+.1f} ms {gaps}; first: setup {med(rs, 'first', 'setup'):.1f}, "
              f"post->done {med(rs, 'first', 'post_to_done'):.1f} (warm {med(rs, 'warm', 'post_to_done'):.1f}), "
              f"NIXL post {med(rs, 'first', 'nixl_post_ms'):.1f} ms (warm {med(rs, 'warm', 'nixl_post_ms'):.1f}), "
              f"polls {med(rs, 'first', 'polls'):.0f} (warm {med(rs, 'warm', 'polls'):.0f}), "
              f"CPU {med(rs, 'first', 'cpu_ms'):.1f} ms (warm {med(rs, 'warm', 'cpu_ms'):.1f}); "
              f"posted on {rs[-1]['first']['posted_on']} (warm {rs[-1]['warm']['posted_on']})")


def main() -> None:
    from kvxfer.bench.hosts import two_hosts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="bytes per read (32 KiB pieces)")
    p.add_argument("--rounds", type=int, default=12, help="fresh consumer agents (the first is the process's first)")
    p.add_argument("--json", help="write every round here")
    args = p.parse_args()
    n = args.mib * 1024 // (32 * 2 * 32)  # blocks: 32 layers x K/V x 32 KiB
    blocks = 2 * n
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    print(f"load before: {os.getloadavg()}")
    with two_hosts() as (producer_host, consumer_host):
        producer = ctx.Process(target=_producer, args=(producer_host, blocks, n, args.rounds, ready, stop))
        consumer = ctx.Process(target=_consumer,
                               args=(consumer_host, producer_host.address, blocks, n, args.rounds, ready, out))
        producer.start()
        consumer.start()
        rows = []
        try:
            while (row := out.get(timeout=1800)) is not None:
                rows.append(row)
                print(json.dumps({"round": row["round"], "variant": row["variant"], "load": row["load"],
                                  "first_ms": round(row["first"]["ms"], 1), "warm_ms": round(row["warm"]["ms"], 1)}))
        finally:
            stop.set()
            consumer.join(60)
            producer.join(60)
            for proc in (consumer, producer):
                if proc.is_alive():
                    proc.kill()
    print(f"load after: {os.getloadavg()}")
    _summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
