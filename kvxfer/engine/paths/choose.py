"""Which way one read moves: CUDA IPC, staged pipeline or direct descriptors (layer: engine; pure).

``choose_path`` is the whole policy, a pure function of the configured ``transfer_path`` and
a few facts about the request, so it is tested on its own (tests/engine/test_paths.py).

``auto``: ``ipc`` when every producer rank's cache is mapped here (same host, VRAM on both
sides); else ``staged`` when the local cache is VRAM, the producers serve staged reads from GPU
staging areas and the direct plan would be many short descriptors (more than ``MANY_DESCRIPTORS``, or a mean under
``SHORT_DESCRIPTOR`` bytes); else, for a host-memory cache, ``staged`` when the producers serve
staged reads, sit on another network stack (another machine or container: the bytes cross a
network, not shared memory) and the direct plan is at least ``HOST_MANY_DESCRIPTORS``
descriptors averaging at most ``HOST_SHORT_DESCRIPTOR`` bytes (measured over UCX's TCP between
two network namespaces, docs/benchmarks.md "Two hosts": staged won at 8,192 x 4 KiB, lost at
2,048 x 4 KiB and at 32 KiB pieces); else ``direct``; else ``staged`` when direct descriptors
cannot express the move (a VRAM cache with a layout conversion) and staging is available.
A forced path that is not available raises ``ConfigError`` naming why.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import ConfigError
from kvxfer.types import TransferPath

__all__ = ["HOST_MANY_DESCRIPTORS", "HOST_SHORT_DESCRIPTOR", "MANY_DESCRIPTORS", "SHORT_DESCRIPTOR",
           "PathFacts", "choose_path"]

MANY_DESCRIPTORS = 1024
SHORT_DESCRIPTOR = 1 << 20
HOST_MANY_DESCRIPTORS = 4096
HOST_SHORT_DESCRIPTOR = 8 << 10


@dataclass(frozen=True)
class PathFacts:
    """What the choice depends on. A ``*_why`` is None when that path can serve the request,
    else the reason it cannot (used in the error of a forced path)."""

    ipc_why: str | None
    staged_why: str | None
    direct_why: str | None
    local_vram: bool
    descriptors: int
    num_bytes: int
    remote: bool = False    # every producer rank is on another network stack than this agent
    peer_staging_vram: bool = True  # every producer rank's staging area is GPU memory


def _many_short(facts: PathFacts) -> bool:
    if facts.descriptors > MANY_DESCRIPTORS:
        return True
    return facts.descriptors > 0 and facts.num_bytes / facts.descriptors < SHORT_DESCRIPTOR


def _many_tiny_across_a_network(facts: PathFacts) -> bool:
    return (facts.remote and facts.descriptors >= HOST_MANY_DESCRIPTORS
            and facts.num_bytes <= facts.descriptors * HOST_SHORT_DESCRIPTOR)


def choose_path(configured: str, facts: PathFacts) -> TransferPath:
    """``TransferPath.IPC``, ``STAGED`` or ``DIRECT`` for one request.

    Raises:
        ConfigError: ``configured`` names a path this request cannot take (the message says
            why), or no path can take it.
    """
    forced = {"ipc": (TransferPath.IPC, facts.ipc_why), "staged": (TransferPath.STAGED, facts.staged_why),
              "direct": (TransferPath.DIRECT, facts.direct_why)}
    if configured in forced:
        path, why = forced[configured]
        if why is not None:
            raise ConfigError(f"transfer_path={str(configured)!r} cannot move this request: {why}")
        return path
    if configured != "auto":
        raise ConfigError(f"transfer_path must be one of auto, ipc, staged, direct; got {configured!r}")
    if facts.ipc_why is None:
        return TransferPath.IPC
    if facts.staged_why is None and facts.local_vram and facts.peer_staging_vram and _many_short(facts):
        return TransferPath.STAGED
    if facts.staged_why is None and not facts.local_vram and _many_tiny_across_a_network(facts):
        return TransferPath.STAGED
    if facts.direct_why is None:
        return TransferPath.DIRECT
    if facts.staged_why is None:
        return TransferPath.STAGED
    raise ConfigError(f"no transfer path can move this request: ipc: {facts.ipc_why}; "
                      f"staged: {facts.staged_why}; direct: {facts.direct_why}")
