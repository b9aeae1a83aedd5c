"""Test support for engines built on kvxfer (layer: testing; imports backend.fake only, never nixl).

``FakeBackend`` really copies bytes between registered buffers of agents in one process, with
fault injection (``fail_next``, ``hold_transfers``, ``kill``); see ``kvxfer.backend.fake``.
``free_port_block`` finds free side-channel ports; ``logical_kv`` and ``expected_read`` are a
tensor-level oracle for split-storage caches (what a read must leave in the consumer's blocks).
"""

from __future__ import annotations

import socket

import numpy as np

from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.layout import KVSpec

__all__ = ["FakeBackend", "FakeWorld", "expected_read", "free_port_block", "logical_kv"]


def free_port_block(n: int = 4) -> int:
    """A base port with ``n`` consecutive ports free on 127.0.0.1 right now (best effort)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no run of {n} free ports found")


def logical_kv(spec: KVSpec, tensors: list[np.ndarray], ids) -> np.ndarray:
    """``[layers, K/V, tokens, heads_per_rank, head_dim]`` of blocks ``ids`` (token order) of a
    split-storage cache given as host arrays shaped ``spec.tensor_shapes()``."""
    out = []
    for t in tensors:
        if spec.layout.value == "HND":
            t = t.transpose(0, 1, 3, 2, 4)   # [2, blocks, heads, bs, hd] -> [2, blocks, bs, heads, hd]
        sel = t[:, list(ids)]
        out.append(sel.reshape(2, -1, *sel.shape[3:]))
    return np.stack(out)


def expected_read(consumer: KVSpec, before: list[np.ndarray], c_ids,
                  producers: list[tuple[KVSpec, list[np.ndarray]]], p_ids) -> np.ndarray:
    """The consumer's ``logical_kv`` of ``c_ids`` after reading ``p_ids`` from every producer rank
    (``before``: its cache before the read; each rank supplies the heads it shares)."""
    want = logical_kv(consumer, before, c_ids).copy()
    c0 = consumer.first_head
    for spec, cache in producers:
        src = logical_kv(spec, cache, p_ids)
        p0 = spec.first_head
        lo, hi = max(p0, c0), min(p0 + spec.heads_per_rank, c0 + consumer.heads_per_rank)
        want[:, :, :, lo - c0:hi - c0] = src[:, :, :, lo - p0:hi - p0]
    return want
