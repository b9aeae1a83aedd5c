"""Instance pools, least-outstanding routing and health checks (layer: proxy app; imports httpx
lazily through the caller's client, nothing from kvxfer but the config).

One ``InstancePool`` per role (prefill, decode). ``pick`` chooses the healthy instance with the
fewest requests in flight, breaking ties round-robin so equal instances share load. An instance
leaves the pool when a health probe fails or a connection to it is refused, and comes back when
a probe succeeds. All state is touched from one event loop only, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvxfer.proxy.config import Endpoint

__all__ = ["HealthChecker", "Instance", "InstancePool", "NoHealthyInstance"]

log = logging.getLogger("kvxfer.proxy")


class NoHealthyInstance(RuntimeError):
    """Every instance of a role is out of the pool."""


@dataclass(eq=False)  # compared by identity, so instances can live in sets
class Instance:
    """One upstream instance and its live routing state."""

    role: str
    endpoint: Endpoint
    healthy: bool = True
    outstanding: int = 0
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return str(self.endpoint)


class InstancePool:
    """The instances of one role, with least-outstanding selection.

    ``on_change(instance)`` is called whenever an instance's health or outstanding count changes
    (the metrics layer hooks it); it must not raise.
    """

    def __init__(self, role: str, endpoints: tuple[Endpoint, ...], on_change: Callable[[Instance], None] | None = None):
        self.role = role
        self.instances = [Instance(role, ep) for ep in endpoints]
        self._on_change = on_change or (lambda inst: None)
        self._next = 0  # round-robin cursor for tie breaking
        for inst in self.instances:
            self._on_change(inst)

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def pick(self, exclude: frozenset[Instance] | set[Instance] = frozenset()) -> Instance:
        """The healthy instance (not in ``exclude``) with the fewest requests in flight.

        Ties go to the first candidate at or after the round-robin cursor. Raises
        ``NoHealthyInstance`` when no instance qualifies.
        """
        n = len(self.instances)
        best: Instance | None = None
        for k in range(n):
            inst = self.instances[(self._next + k) % n]
            if not inst.healthy or inst in exclude:
                continue
            if best is None or inst.outstanding < best.outstanding:
                best = inst
        if best is None:
            raise NoHealthyInstance(f"no healthy {self.role} instance (of {n})")
        self._next = (self.instances.index(best) + 1) % n
        return best

    @contextmanager
    def lease(self, inst: Instance) -> Iterator[Instance]:
        """Count one request in flight on ``inst`` for the duration of the block."""
        inst.outstanding += 1
        self._on_change(inst)
        try:
            yield inst
        finally:
            inst.outstanding -= 1
            self._on_change(inst)

    def mark(self, inst: Instance, healthy: bool, reason: str | None = None) -> None:
        """Set ``inst``'s health; logs transitions only."""
        if inst.healthy != healthy:
            inst.changed_at = time.monotonic()
            if healthy:
                log.info("%s instance %s is back in the pool", self.role, inst.label)
            else:
                log.warning("%s instance %s taken out of the pool: %s", self.role, inst.label, reason)
        inst.healthy = healthy
        inst.last_error = None if healthy else reason
        self._on_change(inst)


class HealthChecker:
    """Probes every instance with ``GET /health`` every ``interval`` seconds.

    A probe answering 2xx within ``timeout`` marks the instance healthy; anything else (error
    status, refused connection, timeout) marks it unhealthy. ``run`` loops until cancelled.
    """

    def __init__(self, pools: list[InstancePool], client: Any, interval: float, timeout: float):
        self.pools = pools
        self.client = client
        self.interval = interval
        self.timeout = timeout

    async def probe(self, pool: InstancePool, inst: Instance) -> bool:
        """Probe one instance once and record the result; returns its new health."""
        try:
            resp = await self.client.get(f"{inst.endpoint.base_url}/health", timeout=self.timeout)
        except Exception as exc:  # any transport failure means "not reachable now"
            pool.mark(inst, False, f"health probe failed: {type(exc).__name__}: {exc}")
            return False
        ok = 200 <= resp.status_code < 300
        pool.mark(inst, ok, None if ok else f"health probe answered HTTP {resp.status_code}")
        return ok

    async def check_all(self) -> None:
        """Probe every instance of every pool concurrently, once."""
        await asyncio.gather(*(self.probe(pool, inst) for pool in self.pools for inst in pool.instances))

    async def run(self) -> None:
        """Probe all instances now and then every ``interval`` seconds until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)
