"""A new process's first read across two "hosts", side by side with later first contacts.

Two network namespaces joined by a veth pair (root; UCX over TCP). One producer process holds
every request for the whole run. Then ``--consumers`` consumer processes start one after the
other; each makes two agents in turn (``a0``, ``a1``), and each agent reads once as a first
contact (no ``connect()``: the handshake is in the read) and once warm, the same ids. So:

* consumer 0, agent a0: a new consumer process's first read, served by a new producer process's
  first serve (both sides' first use; what a fresh prefill/decode pair meets);
* consumer k > 0, agent a0: a new consumer process against a producer process that already served
  (the consumer side's first use alone);
* agent a1 of any consumer: a new agent in a process that already read (a new peer, no
  per-process first use).

Per read: wall time, set-up (call to post), post to done, the consumer's CPU time and page
faults (``ru_minflt``, all its threads), and for a0's
first read the Python modules the consumer imported during it (lazy imports on the read path);
the producer reports the modules it imported while serving its first read. ``--untouched``
leaves the consumer's cache pages untouched before the reads (``np.zeros``: the first read then
also pays the kernel's page faults), as a fresh ``np.zeros`` cache would; engines write their
cache (``torch.zeros`` fills it) and ``kvxfer bench`` writes it before every read.

Run:  .venv/bin/python benchmarks/new_process_first_read.py [--mib 64] [--consumers 3]
"""

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import numpy as np

SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
PORT = 47650


def _ids(seed: int, blocks: int, n: int) -> list[int]:
    return np.random.default_rng(seed).permutation(blocks)[:n].tolist()


def _rid(c: int, a: int, kind: str) -> str:
    return f"c{c}-a{a}-{kind}"


def _producer(host, blocks: int, n: int, consumers: int, ready, stop, out) -> None:
    host.enter()
    os.environ.setdefault("UCX_TLS", "tcp")
    from kvxfer import Agent, AgentConfig, KVSpec

    spec = KVSpec(num_blocks=blocks, **SHAPE)
    config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT, handshake_timeout=60.0)
    with Agent("npf-producer", spec, config) as agent:
        agent.register([np.ones(s, dtype=np.uint16) for s in spec.tensor_shapes()])
        agent.listen()
        for c in range(consumers):
            for a in (0, 1):
                for kind in ("first", "warm"):
                    agent.hold(_rid(c, a, kind), _ids(c * 2 + a, blocks, n), consumers=1, lease=600)
        before = set(sys.modules)
        ready.set()
        stop.wait(1800)
        out.put({"producer_imported": sorted(set(sys.modules) - before)})


def _consumer(host, c: int, producer_address: str, blocks: int, n: int, untouched: bool, out) -> None:
    host.enter()
    os.environ.setdefault("UCX_TLS", "tcp")
    t_import = time.perf_counter()
    from kvxfer import Agent, AgentConfig, KVSpec

    t_import = time.perf_counter() - t_import
    spec = KVSpec(num_blocks=blocks, **SHAPE)
    cache = [np.zeros(s, dtype=np.uint16) for s in spec.tensor_shapes()]
    if not untouched:
        for t in cache:
            t.fill(3)
    remote = (producer_address, PORT)

    def usage() -> tuple[float, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime, r.ru_minflt

    def one(agent, rid: str, local, remote_ids) -> dict:
        (c0, f0), t0 = usage(), time.perf_counter()
        stats = agent.read(remote, local, remote_ids, rid, timeout=300).wait()
        wall, (c1, f1) = time.perf_counter() - t0, usage()
        return {"ms": wall * 1e3, "setup": stats.setup_seconds * 1e3, "post_to_done": stats.seconds * 1e3,
                "cpu_ms": (c1 - c0) * 1e3, "faults": f1 - f0}

    rows = []
    for a in (0, 1):
        config = AgentConfig(side_channel_host=host.address, side_channel_port=PORT + 10 + a, handshake_timeout=60.0)
        t0 = time.perf_counter()
        agent = Agent(f"npf-consumer-{c}-{a}", spec, config)
        t_agent = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            agent.register(cache)
            t_register = time.perf_counter() - t0
            local, remote_ids = _ids(10_000 + c * 2 + a, blocks, n), _ids(c * 2 + a, blocks, n)
            before = set(sys.modules)
            first = one(agent, _rid(c, a, "first"), local, remote_ids)
            imported = sorted(set(sys.modules) - before)
            warm = one(agent, _rid(c, a, "warm"), local, remote_ids)
        finally:
            agent.close()
        rows.append({"consumer": c, "agent": a, "first": first, "warm": warm, "imported": imported,
                     "agent_ms": t_agent * 1e3, "register_ms": t_register * 1e3, "import_ms": t_import * 1e3,
                     "load": os.getloadavg()[0]})
    out.put(rows)


def _line(name: str, rs: list[dict]) -> str:
    def med(side, key):
        return statistics.median(x[side][key] for x in rs)

    gaps = [round(x["first"]["ms"] - x["warm"]["ms"], 1) for x in rs]
    return (f"{name:>44}: n={len(rs)} first {med('first', 'ms'):.1f} ms, warm {med('warm', 'ms'):.1f} ms, "
            f"first - warm {statistics.median(gaps):+.1f} ms {gaps}; first: setup {med('first', 'setup'):.1f}, "
            f"post->done {med('first', 'post_to_done'):.1f} (warm {med('warm', 'post_to_done'):.1f}), "
            f"CPU {med('first', 'cpu_ms'):.1f} (warm {med('warm', 'cpu_ms'):.1f}), "
            f"page faults {med('first', 'faults'):.0f} (warm {med('warm', 'faults'):.0f}); "
            f"Agent() {statistics.median(x['agent_ms'] for x in rs):.1f} ms, "
            f"register {statistics.median(x['register_ms'] for x in rs):.1f} ms")


def main() -> None:
    from kvxfer.bench.hosts import two_hosts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="bytes per read (32 KiB pieces)")
    p.add_argument("--consumers", type=int, default=3, help="consumer processes, one after the other")
    p.add_argument("--untouched", action="store_true", help="leave the consumer's cache pages untouched")
    p.add_argument("--json", help="write every read here")
    args = p.parse_args()
    n = args.mib * 1024 // (32 * 2 * 32)
    blocks = 2 * n
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    print(f"load before: {os.getloadavg()}")
    rows: list[dict] = []
    with two_hosts() as (producer_host, consumer_host):
        producer = ctx.Process(target=_producer,
                               args=(producer_host, blocks, n, args.consumers, ready, stop, out))
        producer.start()
        try:
            if not ready.wait(600):
                raise RuntimeError("the producer did not start")
            for c in range(args.consumers):
                consumer = ctx.Process(target=_consumer, args=(consumer_host, c, producer_host.address, blocks, n,
                                                               args.untouched, out))
                consumer.start()
                got = out.get(timeout=600)
                consumer.join(60)
                for row in got:
                    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                      if k not in ("first", "warm", "imported")}
                                     | {"first_ms": round(row["first"]["ms"], 1),
                                        "warm_ms": round(row["warm"]["ms"], 1)}))
                    if row["imported"]:
                        print(f"   imported during consumer {c} agent {row['agent']}'s first read: {row['imported']}")
                rows.extend(got)
            stop.set()
            print(f"   producer imported while serving: {out.get(timeout=60)['producer_imported']}")
        finally:
            stop.set()
            producer.join(60)
            if producer.is_alive():
                producer.kill()
    print(f"load after: {os.getloadavg()}")
    print(_line("new consumer process, new producer process",
                [r for r in rows if r["consumer"] == 0 and not r["agent"]]))
    print(_line("new consumer process, producer already served", [r for r in rows if r["consumer"] and not r["agent"]]))
    print(_line("second agent of a consumer process", [r for r in rows if r["agent"]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
