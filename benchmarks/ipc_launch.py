"""Host cost of one same-host IPC read's launch, step by step, on one GPU (issue 15).

One process, two Llama-3-8B-shaped caches on the same GPU (the kernel reads the "producer"
cache directly, as it reads a peer's cache through its CUDA IPC mapping), a fresh set of
fragmented block ids for every request (as in serving: no two requests share ids). Per size:

* ``tables``: ``direct_pairs`` (the request's pair table, host numpy);
* ``launch``: ``PairKernel.launch`` as shipped (block ids in one async copy from pinned memory);
* ``launch, sync ids``: the same with the ids uploaded as before (two synchronous cudaMemcpy);
* ``event``: recording the completion event;
* ``request``: tables + launch + event + polling the event until done (what ``kvxfer-ipc``
  pays per request), against ``torch`` copying the same bytes contiguously on the same GPU;
* ``kernel``: the gather kernel alone (CUDA events around it) and its GB/s.

``--beside agent`` measures the same with an idle kvxfer ``Agent`` (its progress thread, a
listening side channel) in the process, as in a serving engine; ``--beside thread`` with a plain
Python thread that wakes every millisecond for ~50 us of work (what any such thread costs the
launch, through the GIL).

``--beside gpu-agent`` puts an idle ``Agent`` over a GPU cache in the process (UCX's CUDA
transports in NIXL's progress thread); ``--beside gpu-process`` the same in another process on
GPU 0 (as the bench's producer); ``--beside cuda-process`` another process holding only a CUDA
context on GPU 0.

Run:  python3 benchmarks/ipc_launch.py [--tokens 512,2048,8192] [--reads 50] [--beside none|agent|thread|gpu-agent|gpu-process|cuda-process] [--json PATH]
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvxfer.bench.caches import fill_random, make_cache
from kvxfer.gpu.ops import PairKernel
from kvxfer.layout.pairs import direct_pairs
from kvxfer.layout.spec import KVSpec


class SyncIdsKernel(PairKernel):
    """The ids upload as it was before: one synchronous cudaMemcpy per side."""

    def _ids(self, sides, stream, keep):
        ptrs = []
        for side in sides:
            if side.bases is None:
                continue
            host = np.ascontiguousarray(side.ids, dtype=np.int64)
            dev = self.cp.empty(host.shape, dtype=host.dtype)
            self.cp.cuda.runtime.memcpy(dev.data.ptr, host.ctypes.data, host.nbytes,
                                        self.cp.cuda.runtime.memcpyHostToDevice)
            keep.append(dev)
            ptrs.append(dev.data.ptr)
        return ptrs


def _us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(tokens: int, reads: int, kernel: PairKernel, sync_kernel: PairKernel) -> dict:
    import cupy as cp

    n = tokens // 16
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=4 * n,
                  dtype="bfloat16", model="llama-3-8b")
    src, dst = make_cache(spec, "cuda:0"), make_cache(spec, "cuda:0")
    fill_random(src, 1)
    rng = np.random.default_rng(tokens)
    id_sets = [(rng.permutation(4 * n)[:n], rng.permutation(4 * n)[:n]) for _ in range(reads + 3)]
    nbytes = spec.num_layers * 2 * n * spec.block_bytes
    stream = cp.cuda.Stream(non_blocking=True)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    flat_dst = torch.empty_like(flat_src)
    spans: dict[str, list[float]] = {k: [] for k in ("tables", "launch", "launch, sync ids", "event",
                                                      "request", "contiguous copy", "kernel")}
    for i, (s_ids, d_ids) in enumerate(id_sets):
        warm = i < 3
        t0 = time.perf_counter()
        copy = direct_pairs(spec, src.geometry, s_ids, spec, dst.geometry, d_ids)
        t1 = time.perf_counter()
        keep = kernel.launch(copy, stream.ptr)
        t2 = time.perf_counter()
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        t3 = time.perf_counter()
        while not event.done:
            pass
        t4 = time.perf_counter()
        del keep
        # The old upload, same ids (after the stream is idle, as above).
        t5 = time.perf_counter()
        keep = sync_kernel.launch(copy, stream.ptr)
        t6 = time.perf_counter()
        stream.synchronize()
        del keep
        # The kernel alone, between CUDA events.
        a, b = cp.cuda.Event(), cp.cuda.Event()
        keep = kernel.launch(copy, stream.ptr)  # ids upload first, outside the timed span
        a.record(stream)
        keep2 = kernel.launch(copy, stream.ptr)
        b.record(stream)
        b.synchronize()
        del keep, keep2
        kernel_s = cp.cuda.get_elapsed_time(a, b) / 1e3  # includes the second launch's id copy
        torch.cuda.synchronize()
        t7 = time.perf_counter()
        flat_dst.copy_(flat_src)
        torch.cuda.synchronize()
        t8 = time.perf_counter()
        if not warm:
            for key, value in (("tables", t1 - t0), ("launch", t2 - t1), ("event", t3 - t2), ("request", t4 - t0),
                               ("launch, sync ids", t6 - t5), ("contiguous copy", t8 - t7), ("kernel", kernel_s)):
                spans[key].append(value)
    # Verify the last request moved the right bytes (compared as integers: random bf16 has NaNs).
    s_ids, d_ids = (torch.as_tensor(x, device="cuda:0") for x in id_sets[-1])
    ok = all(bool(torch.equal(s.view(torch.int16).view(2, spec.num_blocks, -1)[:, s_ids],
                              d.view(torch.int16).view(2, spec.num_blocks, -1)[:, d_ids]))
             for s, d in zip(src.tensors, dst.tensors))
    row = {"tokens": tokens, "mib": nbytes / 2**20, "verified": ok}
    row.update({f"{k}_us": round(_us(v), 1) for k, v in spans.items()})
    row["kernel_gbps"] = round(nbytes / statistics.median(spans["kernel"]) / 1e9, 1)
    row["request_vs_copy"] = round(statistics.median(spans["contiguous copy"]) / statistics.median(spans["request"]), 3)
    return row


def _beside(what: str):
    """Start what runs beside the measurements; returns a function that stops it (or None)."""
    import threading

    if what == "agent":
        from kvxfer import Agent, AgentConfig, KVSpec as Spec

        spec = Spec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=64, dtype="float16")
        agent = Agent("beside", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0))
        agent.register([np.zeros(s, dtype=np.float16) for s in spec.tensor_shapes()])
        agent.listen()
        agent.hold("idle", [1, 2])  # a held request: the progress loop polls every millisecond
        return agent.close
    if what == "gpu-agent":  # an Agent over a GPU cache in this process: UCX's CUDA transports
        import torch as t
        from kvxfer import Agent, AgentConfig, KVSpec as Spec

        spec = Spec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=64, dtype="float16")
        agent = Agent("beside", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0))
        agent.register([t.zeros(s, dtype=t.float16, device="cuda:0") for s in spec.tensor_shapes()])
        agent.listen()
        agent.hold("idle", [1, 2])
        return agent.close
    if what in ("gpu-process", "cuda-process"):  # another process on GPU 0, as the bench's producer
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_other_process, args=(what == "gpu-process", ready, stop), daemon=True)
        proc.start()
        ready.wait(120)

        def end() -> None:
            stop.set()
            proc.join(30)
        return end
    if what == "thread":
        stop = threading.Event()

        def work() -> None:
            while not stop.wait(0.001):
                end = time.perf_counter() + 50e-6
                while time.perf_counter() < end:
                    pass

        threading.Thread(target=work, daemon=True).start()
        return stop.set
    return None


def _other_process(with_agent: bool, ready, stop) -> None:
    """A second process on GPU 0: with a VRAM ``Agent`` (NIXL's progress thread polling UCX,
    a held request) or with only a CUDA context; it sits idle until ``stop``."""
    import torch as t

    t.zeros(1, device="cuda:0")
    closer = None
    if with_agent:
        from kvxfer import Agent, AgentConfig, KVSpec as Spec

        spec = Spec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=64, dtype="float16")
        agent = Agent("beside-p", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0))
        agent.register([t.zeros(s, dtype=t.float16, device="cuda:0") for s in spec.tensor_shapes()])
        agent.listen()
        agent.hold("idle", [1, 2])
        closer = agent.close
    ready.set()
    stop.wait(600)
    if closer is not None:
        closer()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reads", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--beside", choices=("none", "agent", "thread", "gpu-agent", "gpu-process", "cuda-process"),
                    default="none")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    beside = _beside(args.beside)
    kernel, sync_kernel = PairKernel(0), SyncIdsKernel(0)
    rows = [measure(int(t), args.reads, kernel, sync_kernel) for t in args.tokens.split(",")]
    for row in rows:
        row["beside"] = args.beside
    if beside is not None:
        beside()
    keys = [k for k in rows[0] if k != "tokens"]
    print("tokens | " + " | ".join(keys))
    for row in rows:
        print(f"{row['tokens']} | " + " | ".join(str(row[k]) for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
