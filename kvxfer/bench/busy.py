"""``kvxfer bench --busy-engine``: small reads while the engines around the agents are busy (layer: bench app).

A serving engine's own thread holds the Python interpreter most of the time; kvxfer's reads must
not wait for it. Two processes on one host (host memory, UCX's defaults), a cache of 2 layers x
2 KV heads x 64 dims x 16 tokens (bf16: 16 KiB a block), one read of 4 blocks (64 KiB) at a time:

* **producer busy**: the producer's main thread runs Python for a share of every 8 ms (0, 50 and
  100 %), as a scheduler loop does; the consumer reads with ``read(...).wait()``.
* **stepping consumer**: the consumer's main thread polls (``Agent.poll()`` where the agent has
  it, then ``handle.done()``; raw NIXL: its state check) and, while the read is not done, runs a
  step of 4 ms of Python before it polls again: the step at which the read is seen done (1: at
  the first look, before any step), and the time from the call to that look.
* **kvxfer token**: the same reads carrying the producer's hold token (``ReadRequest.token``,
  issue 35): no claim, the producer's hold word looked at once the move completed.
* **raw NIXL** in the same run, as stock vLLM's connector uses it: the same descriptors (one per
  layer x K/V x block), lists prepared once, one READ posted and polled with NIXL's state check by
  the engine's own thread, NIXL's progress thread on in both processes (as vLLM creates its NIXL
  agents; it waits for UCX's events between rounds exactly as kvxfer's agents' thread does, see
  ``AgentConfig.nixl_progress_delay_us``); no side channel, no producer CPU, and no protection
  against reused blocks. kvxfer's agents run with their defaults (``AgentConfig()``: NIXL's
  progress thread on; on a host of fewer than 8 cores it waits for UCX's events, up to 1 ms,
  instead of spinning).

Every read is checked byte for byte. The reads go to a producer the consumer has already read
from (warm): first contact is ``kvxfer bench --two-hosts``'s rows.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import statistics
import time
from typing import Any

import numpy as np

from kvxfer.layout.spec import KVSpec
from kvxfer.testing import spin_python

__all__ = ["producer_process", "run_busy"]

SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=256, dtype="bfloat16",
            model="busy-bench")
PERIOD = 0.008   # the producer's busy/idle cycle
STEP = 0.004     # the stepping consumer's Python per step
BLOCKS = 4


def _cache(spec: KVSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for s in spec.tensor_shapes()]


def _producer(cmd: Any, out: Any, port: int, thread: bool | None = None,
              switch_interval: float | None = None) -> None:
    """The producer process: an Agent and a raw NIXL agent over one cache; the main thread is the
    engine (busy for ``duty`` of every ``PERIOD``) and takes commands between its turns."""
    from kvxfer import Agent, AgentConfig  # noqa: PLC0415
    from kvxfer.backend.nixl import NixlBackend  # noqa: PLC0415

    spec = KVSpec(**SPEC)
    cache = _cache(spec, 1)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port, nixl_progress_thread=thread,
                         switch_interval=switch_interval)
    with Agent("busy-producer", spec, config) as agent:
        agent.register(cache)
        agent.listen()
        raw = NixlBackend("busy-raw-producer", progress_thread=True, progress_delay_us=_raw_delay())
        raw.register(_regions(agent))
        out.put((agent.address, raw.metadata(), agent.cache.geometry.bases.tolist()))
        duty = 0.0
        while True:
            try:
                what = cmd.get(timeout=0 if duty else 0.05)
            except queue.Empty:
                what = None
            if what == "stop":
                break
            if what is not None:
                op, arg = what
                if op == "duty":
                    duty = float(arg)
                elif op == "hold":  # answers the holds' tokens (issue 35), as they travel
                    for rid, ids in arg:
                        agent.hold(rid, ids)
                    arg = [(lambda t: t.wire() if t is not None else None)(agent.hold_token(rid)) for rid, _ in arg]
                elif op == "blocks":
                    arg = [t[:, list(arg)].copy() for t in cache]
                out.put(arg)
            if duty:
                spin_python(PERIOD * duty)
                if duty < 1:
                    time.sleep(PERIOD * (1 - duty))
            agent.finished()  # the engine drains its reports once per turn
        raw.close()


def _raw_delay() -> int:
    """The raw agents' progress thread waits for UCX's events exactly as kvxfer's agents' do
    (``nixl_progress_delay_us``, auto): stock vLLM's spinning thread would, on a small host, take
    the core the kvxfer rows run on for the whole run."""
    from kvxfer.config import AgentConfig, progress_delay_wanted  # noqa: PLC0415

    return progress_delay_wanted(AgentConfig.from_env().nixl_progress_delay_us)


def _regions(agent) -> list:
    from kvxfer.types import Region  # noqa: PLC0415

    geo, spec = agent.cache.geometry, agent.spec
    return [Region(int(a), spec.region_bytes, geo.device, geo.kind) for a in np.unique(geo.bases.reshape(-1))]


class _Raw:
    """Raw NIXL as stock vLLM posts it: one descriptor per layer x K/V x block, lists of the whole
    cache prepared once, then one ``make_prepped_xfer`` READ per read, polled by the caller."""

    def __init__(self, agent, meta: bytes, bases: list) -> None:
        from kvxfer.backend.nixl import NixlBackend  # noqa: PLC0415

        spec, geo = agent.spec, agent.cache.geometry
        self.backend = NixlBackend("busy-raw-consumer", progress_thread=True, progress_delay_us=_raw_delay())
        self.backend.register(_regions(agent))
        self.peer = self.backend.add_peer(meta)
        self.kind = geo.kind
        self.blocks = spec.num_blocks
        local = self._table(geo.bases, spec)
        remote = self._table(np.asarray(bases, dtype=np.uint64), spec)
        self.lp = self.backend.prepare(None, local, self.kind)
        self.rp = self.backend.prepare(self.peer, remote, self.kind)

    @staticmethod
    def _table(bases: np.ndarray, spec: KVSpec) -> np.ndarray:
        block = spec.region_bytes // spec.num_blocks
        addr = (bases.reshape(-1, 1).astype(np.uint64)
                + np.arange(spec.num_blocks, dtype=np.uint64) * np.uint64(block)).reshape(-1)
        out = np.zeros((addr.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1] = addr, block
        return out

    def read(self, local: np.ndarray, remote: np.ndarray, poll) -> None:
        from kvxfer.types import Direction, XferState  # noqa: PLC0415

        regions = np.arange(self.rp_regions, dtype=np.int64).reshape(-1, 1) * self.blocks
        li, ri = (regions + local).reshape(-1), (regions + remote).reshape(-1)
        xid = self.backend.post_prepared(Direction.READ, self.lp, li, self.rp, ri, self.peer, b"")
        try:
            while True:
                state = self.backend.state(xid)
                if state is XferState.DONE:
                    return
                if state is XferState.FAILED:
                    raise RuntimeError("raw NIXL read failed")
                poll()
        finally:
            self.backend.release(xid)

    @property
    def rp_regions(self) -> int:
        return SPEC["num_layers"] * 2

    def close(self) -> None:
        self.backend.close()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _has_poll(agent) -> bool:
    return callable(getattr(agent, "poll", None))


@contextlib.contextmanager
def producer_process(progress_thread: bool | None = None, switch_interval: float | None = None):
    """The producer process (``_producer``), started and, on leaving, stopped; yields
    ``(address, raw NIXL metadata, cache bases, ask)``, ``ask(command)`` returning its answer."""
    from kvxfer.testing import free_port_block  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    cmd, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(cmd, out, free_port_block(1), progress_thread, switch_interval),
                       daemon=True)
    proc.start()
    try:
        address, meta, bases = out.get(timeout=120)
        yield address, meta, bases, lambda what: (cmd.put(what), out.get(timeout=60))[1]
    finally:
        cmd.put("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def run_busy(reads: int = 20, duties: tuple[float, ...] = (0.0, 0.5, 1.0), progress=print,
             progress_thread: bool | None = None, switch_interval: float | None = None) -> dict:
    """Measure (see the module doc); returns ``{"rows": [...], "spec": ...}``. Raises
    RuntimeError when a read's bytes are wrong. ``progress_thread``: NIXL's progress thread in
    both kvxfer agents (``AgentConfig.nixl_progress_thread``; None: their default, auto);
    ``switch_interval``: ``AgentConfig.switch_interval`` in both processes (None: CPython's)."""
    from kvxfer import Agent, AgentConfig, HoldToken, ReadRequest  # noqa: PLC0415
    from kvxfer.testing import free_port_block  # noqa: PLC0415

    spec = KVSpec(**SPEC)
    rows: list[dict] = []
    with producer_process(progress_thread, switch_interval) as (address, meta, bases, ask):
        cache = _cache(spec, 2)
        config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1),
                             nixl_progress_thread=progress_thread, switch_interval=switch_interval)
        with Agent("busy-consumer", spec, config) as agent:
            agent.register(cache)
            raw = _Raw(agent, meta, bases)
            rng = np.random.default_rng(3)
            count = [0]

            def pick():
                count[0] += 1
                src = np.sort(rng.choice(spec.num_blocks, BLOCKS, replace=False))
                dst = np.sort(rng.choice(spec.num_blocks, BLOCKS, replace=False))
                return f"busy-{count[0]}", src, dst

            def check(src, dst) -> None:
                want = ask(("blocks", src.tolist()))
                for t, w in zip(cache, want):
                    if not np.array_equal(t[:, dst], w):
                        raise RuntimeError("a read's bytes differ from the producer's")

            def kvxfer_read(poll_between=None, token=False) -> tuple[float, int]:
                rid, src, dst = pick()
                wire = ask(("hold", [(rid, src.tolist())]))[0]
                for t in cache:
                    t[:, dst] = 0
                held = HoldToken.from_wire(wire) if token and wire is not None else None
                if token and held is None:
                    raise RuntimeError("the producer gave no hold token")
                started = time.perf_counter()
                handle = agent.read_many([ReadRequest(address, dst, src, rid, 10, token=held)])[0]
                steps = 0
                if poll_between is None:
                    handle.wait()
                else:  # as ``raw_read``: look first, and run a step while the read is not done
                    while True:
                        if _has_poll(agent):
                            agent.poll()
                        if handle.done():
                            handle.wait(0)
                            break
                        steps += 1
                        poll_between()
                seconds = time.perf_counter() - started
                check(src, dst)
                return seconds, steps + 1

            def raw_read(poll_between=None) -> tuple[float, int]:
                _, src, dst = pick()
                for t in cache:
                    t[:, dst] = 0
                steps = [0]

                def poll():
                    steps[0] += 1
                    if poll_between is not None:
                        poll_between()

                started = time.perf_counter()
                raw.read(dst, src, poll)
                seconds = time.perf_counter() - started
                check(src, dst)
                return seconds, steps[0] + 1

            token_read = lambda poll_between=None: kvxfer_read(poll_between, token=True)  # noqa: E731
            methods = (("kvxfer", kvxfer_read), ("kvxfer token", token_read), ("raw NIXL", raw_read))
            for _ in range(3):  # warm every path (handshake, endpoints, plans)
                kvxfer_read(), token_read(), raw_read()
            for duty in duties:
                ask(("duty", duty))
                for name, fn in methods:
                    times = [fn()[0] for _ in range(reads)]
                    rows.append({"case": f"producer {int(duty * 100)}% busy", "method": name,
                                 "p50_ms": _pct(times, 50) * 1e3, "p90_ms": _pct(times, 90) * 1e3})
                    progress(f"[busy] producer {int(duty * 100)}% busy, {name}: "
                             f"p50 {rows[-1]['p50_ms']:.3f} ms, p90 {rows[-1]['p90_ms']:.3f} ms")
            ask(("duty", 0.0))
            for name, fn in methods:
                got = [fn(lambda: spin_python(STEP)) for _ in range(reads)]
                steps = [s for _, s in got]
                rows.append({"case": f"consumer steps {STEP * 1e3:.0f} ms", "method": name,
                             "p50_ms": _pct([t for t, _ in got], 50) * 1e3,
                             "p90_ms": _pct([t for t, _ in got], 90) * 1e3,
                             "steps_p50": statistics.median(steps), "steps_max": max(steps)})
                progress(f"[busy] stepping consumer, {name}: done at step {rows[-1]['steps_p50']} (p50), "
                         f"{rows[-1]['p50_ms']:.2f} ms")
            raw.close()
    idle = {r["method"]: r["p50_ms"] for r in rows if r["case"] == "producer 0% busy"}
    for r in rows:
        if r["case"].startswith("producer"):
            r["vs_idle"] = r["p50_ms"] / idle[r["method"]]
            r["vs_raw"] = r["p50_ms"] / next(x["p50_ms"] for x in rows
                                              if x["case"] == r["case"] and x["method"] == "raw NIXL")
    return {"rows": rows, "spec": SPEC, "nixl_progress_thread": progress_thread, "switch_interval": switch_interval, "read_bytes": BLOCKS * KVSpec(**SPEC).region_bytes // SPEC["num_blocks"]
            * SPEC["num_layers"] * 2}


def table(report: dict) -> str:
    """The report as a markdown table."""
    lines = ["| case | method | p50 ms | p90 ms | p50 over idle | p50 over raw NIXL | done at step (p50, max) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        step = f"{r['steps_p50']:g}, {r['steps_max']}" if "steps_p50" in r else ""
        over = f"{r['vs_idle']:.2f}" if "vs_idle" in r else ""
        raw = f"{r['vs_raw']:.2f}" if "vs_raw" in r else ""
        lines.append(f"| {r['case']} | {r['method']} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | {over} | {raw} | {step} |")
    return "\n".join(lines)
