"""One benchmark process (a producer rank or the measured consumer rank), driven over a pipe (layer: bench app).

The orchestrator (``kvxfer.bench.run``) starts one process per NIXL agent, because UCX
cannot use CUDA IPC between two agents of one process. Each command is ``(name, kwargs)``;
the reply is ``("ok", result)`` or ``("err", traceback text)``. Commands: ``setup``,
``connect``, ``expect`` (consumer: build the expected cache for a request), ``measure``
(consumer: time one method), ``prepare`` (producer: what must be done before ``measure``
starts, e.g. holding the requests) and ``serve`` (producer: play its part in ``measure``).
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import numpy as np

from kvxfer.bench import agentmethods, firstcontact, methods, mooncake, netmethods, newprocess
from kvxfer.bench.caches import BenchCache, apply_expected, element_view, fill_random, make_cache
from kvxfer.bench.links import Mailbox
from kvxfer.layout.spec import KVSpec
from kvxfer.types import MemKind, Region

__all__ = ["worker_main", "Worker"]


def worker_main(conn: Any, env: dict[str, str], host: Any = None) -> None:
    """Process entry point: enter ``host``'s network namespace (a ``kvxfer.bench.hosts.Host``,
    two-hosts runs), apply ``env``, then serve commands until ``exit``."""
    if host is not None:
        host.enter()  # before any socket or NIXL agent exists in this process
    os.environ.update(env)
    worker = Worker()
    worker.interrupted = lambda: conn.poll(0)  # a command waits: a serve that runs until told ends
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            break
        if name == "exit":
            worker.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(worker, name)(**kwargs)))
        except BaseException:  # report everything to the orchestrator, keep serving
            conn.send(("err", traceback.format_exc()))


class Worker:
    """State of one benchmark process (see the module docstring)."""

    def __init__(self) -> None:
        self.backend: Any = None
        self.cache: BenchCache | None = None
        self.peers: dict[str, dict] = {}
        self.extra: dict[str, Any] = {}
        self.interrupted: Callable[[], bool] = lambda: False  # set by worker_main: a command waits

    # ---- set-up ----------------------------------------------------------------------
    def setup(self, name: str, spec: KVSpec, device: str, seed: int, link_bytes: int,
              slot_bytes: int, slots: int, ipc: bool) -> dict:
        """Allocate, fill and register this rank's cache, a link buffer and (GPU) a staging area."""
        import torch  # noqa: PLC0415

        from kvxfer.backend.nixl import NixlBackend  # noqa: PLC0415 - the raw baseline needs NIXL itself

        self.name, self.device, self.seed = name, device, seed
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        # The raw baseline's agent runs NIXL's progress thread exactly when kvxfer's agents do
        # (KVXFER_NIXL_PROGRESS_THREAD, default auto): an extra agent spinning beside the one
        # measured would tax only the other side of each ratio. Without the thread, a producer
        # polls its agent while a raw method is measured (``drive``), as a kvxfer producer does.
        from kvxfer.config import AgentConfig, progress_delay_wanted, progress_thread_wanted  # noqa: PLC0415

        env = AgentConfig.from_env()
        thread = progress_thread_wanted(env.nixl_progress_thread)
        self.backend = NixlBackend(name, progress_thread=thread,
                                   progress_delay_us=progress_delay_wanted(env.nixl_progress_delay_us) if thread else 0)
        self.mailbox = Mailbox(self.backend)
        self.cache = make_cache(spec, device)
        fill_random(self.cache, seed)
        kind = self.cache.geometry.kind
        dev = self.cache.geometry.device
        regions = [Region(t.data_ptr(), t.numel() * t.element_size(), dev, kind) for t in self.cache.tensors]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 1)
        self.link = torch.randint(0, 256, (max(link_bytes, 256),), dtype=torch.uint8, device=device,
                                  generator=gen)
        regions.append(Region(self.link.data_ptr(), self.link.numel(), dev, kind))
        self.backend.register(regions)
        info = {"name": name, "spec": spec, "device": dev, "kind": kind.value,
                "bases": self.cache.geometry.bases.copy(), "link": self.link.data_ptr(),
                "link_bytes": self.link.numel(), "seed": seed, "staging": 0, "slots": 0,
                "slot_bytes": slot_bytes}
        if kind is MemKind.VRAM:
            from kvxfer.gpu.ops import PairKernel  # noqa: PLC0415
            from kvxfer.engine.paths.pipeline import StagingArea  # noqa: PLC0415

            self.kernel = PairKernel(dev)
            self.area = StagingArea(self.backend, dev, slot_bytes, slots)
            info.update(staging=self.area.addr, slots=slots)
            if ipc:
                from kvxfer.gpu.ipc import export_cache  # noqa: PLC0415

                info["ipc"] = export_cache(self.cache.geometry).to_wire()
        info["metadata"] = self.backend.metadata()
        return info

    def connect(self, peers: list[dict]) -> list[str]:
        """Load peers' metadata (and, on a consumer, map same-host peers' caches through CUDA IPC)."""
        names = []
        for info in peers:
            name = self.backend.add_peer(info["metadata"])
            self.peers[name] = info
            names.append(name)
            if "ipc" in info and self.cache.geometry.kind is MemKind.VRAM and info.get("map_ipc"):
                from kvxfer.gpu.ipc import IpcExport, IpcPeerCache  # noqa: PLC0415

                info["mapped"] = IpcPeerCache(IpcExport.from_wire(info["ipc"]), self.cache.geometry.device)
        return names

    # ---- consumer ----------------------------------------------------------------------
    def expect(self, requests: list[dict], tokens: int, twin_layout: str | None = None) -> dict:
        """Build the expected cache after one request: ``requests`` lists, per producer, its
        name, spec, seed and block ids, and this rank's ids. ``twin_layout`` computes it as if
        this cache had the producer's layout (for raw byte-copy baselines)."""
        import dataclasses  # noqa: PLC0415

        import torch  # noqa: PLC0415

        spec = self.cache.spec
        if twin_layout is not None:
            spec = dataclasses.replace(spec, layout=twin_layout)
        background = make_cache(spec, self.device)
        fill_random(background, self.seed + 7)
        expected = make_cache(spec, self.device)
        for e, b in zip(expected.tensors, background.tensors):
            e.copy_(b)
        views = element_view(expected)
        for req in requests:
            replica = make_cache(req["spec"], self.device)
            fill_random(replica, req["seed"])
            apply_expected(replica, np.asarray(req["ids"]), views, spec, np.asarray(req["local_ids"]), tokens)
            del replica
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        key = twin_layout or "native"
        self.extra[key] = (background, expected)
        changed = sum(int((e.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).sum())
                      for e, b in zip(expected.tensors, background.tensors))
        return {"changed_bytes": changed}

    def poison(self, key: str = "native") -> None:
        """Overwrite this cache with the background (random, differs from what a transfer writes)."""
        background, _ = self.extra[key]
        for t, b in zip(self.cache.tensors, background.tensors):
            t.view(-1).copy_(b.view(-1))  # flat: a layout twin has the same bytes in another shape
        self._sync()

    def verify(self, key: str = "native") -> bool:
        """True when this cache equals the expected one byte for byte."""
        import torch  # noqa: PLC0415

        _, expected = self.extra[key]
        self._sync()
        return all(torch.equal(t.view(-1).view(torch.uint8), e.view(-1).view(torch.uint8))
                   for t, e in zip(self.cache.tensors, expected.tensors))

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch  # noqa: PLC0415

            torch.cuda.synchronize()

    def measure(self, method: str, requests: list[dict], tokens: int, iters: int, warmup: int,
                options: dict) -> dict:
        """Time ``method`` ``iters`` times (after ``warmup``), verifying every timed transfer."""
        fn = {**methods.CONSUMER, **agentmethods.CONSUMER, **netmethods.CONSUMER, **firstcontact.CONSUMER,
              **newprocess.CONSUMER,
              **mooncake.CONSUMER}[method]
        return fn(self, requests, tokens, iters, warmup, options)

    # ---- producer ----------------------------------------------------------------------
    def prepare(self, method: str, consumer: str, request: dict, tokens: int, rounds: int,
                options: dict) -> dict:
        """The producer's set-up for ``method`` that must be done before ``measure`` starts."""
        fn = {**methods.PREPARE, **agentmethods.PREPARE, **netmethods.PREPARE, **firstcontact.PREPARE,
              **newprocess.PREPARE,
              **mooncake.PREPARE}.get(method)
        return {} if fn is None else fn(self, consumer, request, tokens, rounds, options)

    def serve(self, method: str, consumer: str, request: dict, tokens: int, rounds: int,
              options: dict) -> dict:
        """Play the producer's part of ``method`` for ``rounds`` iterations (GO-driven)."""
        fn = {**methods.PRODUCER, **agentmethods.PRODUCER, **netmethods.PRODUCER, **firstcontact.PRODUCER,
              **newprocess.PRODUCER}.get(method)
        if fn is None:
            return {"rounds": 0}
        return fn(self, consumer, request, tokens, rounds, options)

    def release(self) -> None:
        """Sent after every ``measure``: its arrival ends a ``serve`` that runs until told."""

    def peer_copy(self, src_device: str, nbytes: int, iters: int, warmup: int) -> dict:
        """torch copy of ``nbytes`` from ``src_device`` into this GPU (the link's practical limit)."""
        return methods.peer_copy(self, src_device, nbytes, iters, warmup)

    def close(self) -> None:
        for key, value in list(self.extra.items()):
            if key.startswith("agent") or key == "tcp-socket":
                value.close()
        for info in self.peers.values():
            mapped = info.get("mapped")
            if mapped is not None:
                mapped.close()
        area = getattr(self, "area", None)
        if area is not None:
            area.close()
        if self.backend is not None:
            self.backend.close()
