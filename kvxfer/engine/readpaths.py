"""What an agent's reads take of the transfer paths, built and started here (layer: engine; never nixl, zmq or the agent).

Only the engine launches a kernel or posts to the backend. ``ReadPaths`` is the agent's one
handle on the paths: it chooses a read's route (``plan``), starts a step's moves (one kernel
launch per producer rank for its IPC reads: ``launch_ipc``; one backend post per producer rank
for its granted direct reads: ``direct_step``; a read's own parts: ``start``), and serves staged
reads as a producer (``packer``). The agent checks arguments, claims, and attaches the parts
returned here to its requests (``TransferEngine.attach``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.engine.paths.jobs import IpcJob
from kvxfer.engine.paths.kit import PathKit
from kvxfer.engine.paths.packing import PackServer
from kvxfer.engine.paths.reading import ReadRoute, plan_read
from kvxfer.engine.posted import DirectJob
from kvxfer.engine.shared import SharedJob
from kvxfer.engine.transfers import Part
from kvxfer.errors import KvxferError
from kvxfer.types import Direction

__all__ = ["ReadPaths", "StepRead"]


@dataclass
class StepRead:
    """One read of a step as the paths need it: its ids, its completion note, its route."""

    local: np.ndarray
    remote: np.ndarray
    note: bytes
    route: ReadRoute | None = None
    timeout: float | None = None


class _Joined:
    """Several requests' descriptor rows (or indices into the same prepared lists) to one producer
    rank, as one plan (``DirectJob`` posts it)."""

    staging_bytes = 0

    def __init__(self, plans: list) -> None:
        self.local = np.concatenate([p.local for p in plans])
        self.remote = np.concatenate([p.remote for p in plans])
        self.num_bytes = sum(int(p.num_bytes) for p in plans)
        self.lists = getattr(plans[0], "lists", None)


class ReadPaths:
    """The paths of one agent's cache (see the module doc). ``close`` frees their resources.

    Args:
        backend: the agent's backend (posts and notifications).
        config: the agent's ``AgentConfig`` (``transfer_path``, ``allow_conversion``, staging).
        view: the registered cache.
        leases: the producer's ``LeaseTable`` (staged reads are served only for held requests).
        clock: the agent's clock.
    """

    def __init__(self, backend, config, view, leases, clock) -> None:
        self._backend, self._config, self._view = backend, config, view
        self.kit = PathKit(backend, config, view, clock=clock)
        self.packer = PackServer(self.kit, view, leases)

    # ---- routes ----------------------------------------------------------------------
    @property
    def vram(self) -> bool:
        return self.kit.vram

    def kernel_serves(self, links: list) -> bool:
        """Whether the same-host kernel may serve reads from every one of ``links``."""
        return (self.kit.vram and self._config.transfer_path in ("auto", "ipc") and bool(links)
                and all(self.kit.ipc_why(link) is None for link in links))

    def plan(self, links: list, local: np.ndarray, remote: np.ndarray, request_id: str, note: bytes,
             num_tokens: int | None = None) -> ReadRoute:
        """A read's route (``plan_read``: its ids checked against every producer rank, its path
        chosen); ``num_tokens``: the tokens it moves when its last blocks are partial.

        Raises: BlockIdError / LayoutError (ids or specs), ConfigError (a forced path that cannot serve it)."""
        return plan_read(self.kit, self._config.transfer_path, self._view, links, local, remote, request_id, note,
                         self._config.allow_conversion, num_tokens=num_tokens)

    # ---- starting moves ----------------------------------------------------------------
    def launch_ipc(self, links: list, reads: list[StepRead]) -> list[list[Part]]:
        """One pair-copy launch per producer rank for all of ``reads`` (one event for the step);
        returns each read's parts (one per rank), each a member of the shared launch, its bytes
        in proportion to the read's tokens.

        Raises: KvxferError when the launch fails (nothing was launched)."""
        local = np.concatenate([r.local for r in reads])
        remote = np.concatenate([r.remote for r in reads])
        copies = [self.kit.direct_template(link, self._view).copy(remote, local) for link in links]
        launches, event = self.kit.launch_and_record(copies)
        total = sum(c.nbytes for c in copies)
        shared = SharedJob(IpcJob(launches, event, total, len(copies)), members=len(reads) * len(links))
        shares = _shares(reads)
        per_link = [(link.agent_name, link.view.geometry.kind, np.rint(c.nbytes * shares).astype(np.int64).tolist())
                    for link, c in zip(links, copies)]
        return [[Part(name, None, kind, r.note, job=shared.member(nbytes[i], 1)) for name, kind, nbytes in per_link]
                for i, r in enumerate(reads)]

    def direct_step(self, reads: list[StepRead]) -> tuple[list[list[Part]], dict[int, KvxferError]]:
        """Start granted direct reads: each producer rank's share of all of them in one backend
        transfer (one post for the step), each read owning a member of it. A rank that serves
        one read only gets no job here: the engine posts that read's part itself, with its
        notification inside the transfer.

        Returns each read's parts, and, by index, the error of a read whose joined post failed
        (its parts to other ranks, if posted, are still returned: it ends only with them)."""
        parts = [r.route.start(self.kit, self._view, r.timeout, 0.0) for r in reads]
        by_peer: dict[tuple, list] = {}
        for i, read_parts in enumerate(parts):
            for part in read_parts:  # rows and prepared indices are posted apart
                by_peer.setdefault((part.peer, id(getattr(part.plan, "lists", None))), []).append((i, part))
        failed: dict[int, KvxferError] = {}
        for (peer, _), members in by_peer.items():
            if len(members) == 1:
                continue
            try:
                job = DirectJob(self._backend, Direction.READ, _Joined([p.plan for _, p in members]),
                                self._view.geometry.kind, peer, members[0][1].remote_kind, b"",
                                f"a batch of {len(members)} reads")
            except KvxferError as exc:
                for i, _ in members:
                    failed[i] = exc
                continue
            shared = SharedJob(job, members=len(members))
            for _, part in members:  # its notice (``notification``) goes per read, once it is known good
                part.job = shared.member(int(part.plan.num_bytes), int(part.plan.local.shape[0]))
        return [[p for p in read_parts if p.job is not None or i not in failed]
                for i, read_parts in enumerate(parts)], failed

    def direct_shared(self, route: ReadRoute, reads: list[StepRead]) -> list[list[Part]]:
        """Start a step's direct reads to one producer rank planned together (``route``: one plan
        of all their ids, one rank, not chunked, nothing staged): one backend post for the whole
        step, each read owning a member of it in proportion to its blocks. The members carry no
        notification: each read's notice goes once it is known good (the agent sets ``on_done``).

        Raises: KvxferError when the post fails (nothing was posted)."""
        (part,) = route.start(self.kit, self._view, None, 0.0)  # one rank, one chunk: one part
        job = DirectJob(self._backend, Direction.READ, part.plan, self._view.geometry.kind, part.peer,
                        part.remote_kind, b"", f"a step of {len(reads)} reads")
        shared = SharedJob(job, members=len(reads))
        shares = _shares(reads)
        nbytes = np.rint(int(part.plan.num_bytes) * shares).astype(np.int64).tolist()
        rows = np.rint(int(part.plan.local.shape[0]) * shares).astype(np.int64).tolist()
        return [[Part(part.peer, None, part.remote_kind, b"", job=shared.member(b, n))] for b, n in zip(nbytes, rows)]

    def start(self, route: ReadRoute, timeout: float | None, ask_timeout: float) -> list[Part]:
        """A read's own parts (a lone direct read, chunked or through the host staging buffer; a
        staged read's pipelines). Raises KvxferError (parts already started are stopped first)."""
        return route.start(self.kit, self._view, timeout, ask_timeout)

    def send_packs(self, route: ReadRoute, timeout: float | None, ask_timeout: float) -> None:
        """A staged read's pack requests, sent right behind its claim (``ReadRoute.send_packs``)."""
        route.send_packs(self.kit, self._view, timeout, ask_timeout)

    def drop_packs(self, route: ReadRoute) -> None:
        route.drop_packs(self.kit)

    # ---- the rest of the agent's needs -----------------------------------------------
    def peer_fields(self) -> dict:
        return self.kit.peer_fields()

    def deliver(self, peer: str, data: bytes) -> bool:
        """A backend notification for a staged pipeline (True when it was one)."""
        return self.kit.router.deliver(peer, data)

    def pipelines_active(self) -> bool:
        return self.kit.router.active()

    def close(self) -> None:
        """Cancel the staged reads served here, then close the kit: it waits (up to
        ``kit.CLOSE_WAIT`` seconds) for every pipeline writing into the staging area to end
        before it frees the area, and keeps the area if one has not."""
        self.packer.close()
        self.kit.close()


def _shares(reads: list[StepRead]) -> np.ndarray:
    """Each read's share of a step's one job, by its blocks (for its stats' bytes and rows)."""
    blocks = np.array([r.local.size for r in reads], dtype=np.float64)
    return blocks / blocks.sum()

