"""An engine's step through the public API: N reads submitted at once (``read_many``), against a
torch copy of the same bytes and against the same N reads issued one after another, waiting
for each (how the vLLM adapter moved a step before). Also single reads at a few sizes.

Two processes (the producer in a spawned one), Llama-3-8B-shaped cache (32 layers, 8 KV heads,
head dim 128, bf16, block size 16, NHD), fragmented block ids on both sides. Every timed
iteration is verified: each destination block must hold its source block's pattern.

    python benchmarks/step.py --device cuda --batch 32 --tokens 512 --single 512,2048,8192
    python benchmarks/step.py --device cpu --batch 32 --tokens 256 --layers 4   # a quick CPU look

Prints one JSON object (``--json``) or a table; ratios are against the copy in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from kvxfer import Agent, AgentConfig, KVSpec, ReadRequest
from kvxfer.testing import free_port_block


def _spec(args, num_blocks: int) -> KVSpec:
    return KVSpec(num_layers=args.layers, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=num_blocks,
                  dtype="bfloat16", layout="NHD", model="step-bench")


def _pattern(spec: KVSpec, layer: int, ids: torch.Tensor, salt: int) -> torch.Tensor:
    """The int16 content of blocks ``ids`` of ``layer``: a function of (block, layer, salt)."""
    per_block = spec.block_size * spec.num_kv_heads * spec.head_dim
    base = torch.arange(per_block, device=ids.device, dtype=torch.int32)
    vals = (base[None, :] + ids[:, None].to(torch.int32) * 7919 + layer * 104729 + salt) % 32749
    return vals.to(torch.int16)


def _cache(spec: KVSpec, device: str, salt: int) -> list[torch.Tensor]:
    ids = torch.arange(spec.num_blocks, device=device)
    out = []
    for layer, shape in enumerate(spec.tensor_shapes()):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        v = t.view(torch.int16).view(2, spec.num_blocks, -1)
        for kv in range(2):
            v[kv] = _pattern(spec, layer, ids, salt + kv)
        out.append(t)
    return out


def _producer(cmd, out, args, num_blocks: int, port: int) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(0)
    spec = _spec(args, num_blocks)
    cache = _cache(spec, args.device, salt=1)
    if args.device == "cuda":
        torch.cuda.synchronize()
    with Agent("step-producer", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port)) as agent:
        agent.register(cache)
        out.put(agent.listen())
        while True:
            what = cmd.get(timeout=600)
            if what == "stop":
                return
            for rid, ids in what:
                agent.hold(rid, ids)
            out.put("held")


def _copy_seconds(nbytes: int, device: str, iters: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(iters + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


class _Step:
    def __init__(self, args) -> None:
        self.args = args
        self.blocks = args.tokens // 16
        need = max(args.batch * self.blocks, max(args.single) // 16)
        self.num_blocks = need * 2 + 64
        ctx = mp.get_context("spawn")
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        port = free_port_block(1)
        self.proc = ctx.Process(target=_producer, args=(self.cmd, self.out, args, self.num_blocks, port), daemon=True)
        self.proc.start()
        self.address = tuple(self.out.get(timeout=300))
        if args.device == "cuda":
            torch.cuda.set_device(0)
        self.spec = _spec(args, self.num_blocks)
        self.cache = _cache(self.spec, args.device, salt=1000)
        self.agent = Agent("step-consumer", self.spec, AgentConfig(side_channel_host="127.0.0.1",
                                                                   side_channel_port=free_port_block(1)))
        self.agent.register(self.cache)
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0

    def _requests(self, count: int, blocks: int):
        """``count`` requests of ``blocks`` fragmented ids on each side, held by the producer."""
        src = torch.randperm(self.num_blocks, generator=self.gen)[: count * blocks].view(count, blocks)
        dst = torch.randperm(self.num_blocks, generator=self.gen)[: count * blocks].view(count, blocks)
        rids = []
        for _ in range(count):
            self.n += 1
            rids.append(f"s{self.n}")
        self.cmd.put([(rid, src[i].tolist()) for i, rid in enumerate(rids)])
        assert self.out.get(timeout=60) == "held"
        return [ReadRequest(self.address, dst[i].tolist(), src[i].tolist(), rid, timeout=60)
                for i, rid in enumerate(rids)], src, dst

    def _verify(self, src, dst) -> bool:
        dev = self.cache[0].device
        s, d = src.reshape(-1).to(dev), dst.reshape(-1).to(dev)
        for layer, t in enumerate(self.cache):
            v = t.view(torch.int16).view(2, self.num_blocks, -1)
            for kv in range(2):
                if not torch.equal(v[kv][d], _pattern(self.spec, layer, s, 1 + kv)):
                    return False
        return True

    def run(self, count: int, blocks: int, how: str) -> tuple[float, bool]:
        requests, src, dst = self._requests(count, blocks)
        if self.args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if how == "batch":
            for handle in self.agent.read_many(requests):
                handle.wait(60)
        else:
            for r in requests:
                self.agent.read(r.remote, r.local_blocks, r.remote_blocks, r.request_id, timeout=60).wait(60)
        seconds = time.perf_counter() - t0
        return seconds, self._verify(src, dst)

    def close(self) -> None:
        self.agent.close()
        self.cmd.put("stop")
        self.proc.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512, help="tokens per request of the step")
    p.add_argument("--single", type=lambda s: [int(x) for x in s.split(",") if x], default=[512, 2048, 8192])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    step = _Step(args)
    bytes_per_token = args.layers * 2 * 8 * 128 * 2
    rows = []
    try:
        for rnd in range(args.rounds):
            for label, count, blocks, how in ([("step-batch", args.batch, step.blocks, "batch"),
                                               ("step-serial", args.batch, step.blocks, "serial")]
                                              + [(f"single-{t}", 1, t // 16, "batch") for t in args.single]):
                nbytes = count * blocks * 16 * bytes_per_token
                times, ok = [], True
                for it in range(args.warmup + args.iters):
                    seconds, good = step.run(count, blocks, how)
                    ok &= good
                    if it >= args.warmup:
                        times.append(seconds)
                copy = _copy_seconds(nbytes, args.device, args.iters)
                med = statistics.median(times)
                rows.append(dict(round=rnd, method=label, requests=count, tokens=blocks * 16, bytes=nbytes,
                                 kvxfer_ms=med * 1e3, copy_ms=copy * 1e3, ratio=copy / med, verified=ok))
                if not args.json:
                    print(f"round {rnd} {label:12s} {count:3d} x {blocks * 16:5d} tok  {nbytes / 2**20:9.1f} MiB  "
                          f"kvxfer {med * 1e3:8.3f} ms  copy {copy * 1e3:8.3f} ms  ratio {copy / med:5.2f}  "
                          f"{'exact' if ok else 'WRONG BYTES'}", flush=True)
    finally:
        step.close()
    if args.json:
        print(json.dumps(dict(device=args.device, rows=rows)))


if __name__ == "__main__":
    main()
