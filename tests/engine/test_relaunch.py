"""An IPC read whose kernel was launched on links replaced since (its producer restarted, its
session was lost) and is retried on fresh links fails typed (``PeerLostError``): its first
kernel is its request's part, so a second launch is never attached to it. Before, the relaunch
broke the engine's phase table (a RuntimeError that crashed the lane's batch) after replacing
the first read's parts, and the step's other reads ended while the second kernel still wrote
their blocks."""

import time
import types

import numpy as np

from kvxfer import PeerLostError
from kvxfer.agent.reads import PendingRead
from kvxfer.engine.transfers import Part
from kvxfer.types import Direction, TransferPath

from agent_helpers import spec


class Kernel:
    """An IPC launch that moves its own bytes: done once its event passed."""

    notifies, moves_itself, num_bytes, descriptors = False, True, 64, 1

    def __init__(self):
        self.event_done = False

    def poll(self) -> bool:
        return self.event_done

    def cancel(self) -> bool:
        return self.event_done


def test_a_launched_read_retried_on_fresh_links_fails_typed_and_ends_with_its_first_kernel(harness):
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    parts, flow, engine = cons._parts, cons._parts.reads, cons._parts.engine
    reqs = engine.reserve_many([(rid, time.monotonic() + 30, np.array([i + 1])) for i, rid in enumerate("ab")],
                               Direction.READ, granted=False)
    old_route = types.SimpleNamespace(mode=TransferPath.IPC, links=[object()], chunked=False)
    reads = [PendingRead(q, ("h", 1), np.array([i + 1]), np.array([i]), q.handle.request_id, None, None,
                         ("e", b""), 0.0, route=old_route) for i, q in enumerate(reqs)]
    kernels = []

    def launch_ipc(links, step):
        kernels.append(Kernel())
        return [[Part("p", None, None, b"", job=kernels[-1])] for _ in step]

    parts.paths.launch_ipc = launch_ipc
    flow._launch_ipc(reads)                   # launched on the caller's thread, before the claim
    for r in reads:                           # the lane's retry routes them on fresh links
        r.route = types.SimpleNamespace(mode=TransferPath.IPC, links=[object()], chunked=False)
    flow._launch_ipc([r for r in reads if r.launched is not r.route])
    assert len(kernels) == 1                  # nothing launched again
    assert all(isinstance(q.error, PeerLostError) for q in reqs)
    engine.progress()
    assert not any(q.handle.done() for q in reqs)  # the first kernel still runs into their blocks
    kernels[0].event_done = True
    engine.progress()
    assert all(q.handle.done() and isinstance(q.handle.exception(), PeerLostError) for q in reqs)
