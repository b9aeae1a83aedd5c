"""The consumer half of ``Agent.read``: choose a path, then build the request's parts (layer: engine; never nixl, zmq or the agent).

``plan_read`` runs before the claim (it validates the ids through the layout plan and picks
the path with ``choose_path``); ``ReadRoute.start`` returns the engine ``Part`` of each
producer rank of a direct or staged read, after the producers granted the claim. An ``ipc``
read's kernel is not started here: a step's IPC reads share one launch per producer rank
(``kvxfer.engine.readpaths.ReadPaths.launch_ipc``), made before the claim leaves so its round
trip overlaps the copy (``kvxfer.agent.reads`` explains why that is safe):

* ``direct``: the layout plan's descriptors (the backend notifies the producer on completion);
* ``ipc``: the route only (ids checked; the kernel's tables come from the link's ``DirectTemplate``);
* ``staged``: a ``PackRequest`` per producer rank (it packs into its staging area and
  announces pieces), and a worker running ``fetch_read`` into its own window of our staging
  slots.

For ``ipc`` and ``staged`` no NIXL transfer carries the request-done notification to the
producer, so once the part finished the agent sends it a ``Done`` message on the side channel
(``kvxfer.agent.notices``); the producer's lease ends as it does after a direct read.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
from dataclasses import dataclass, field

import numpy as np

from kvxfer.errors import BlockIdError, KvxferError, LayoutError, ProtocolError, TransferFailedError
from kvxfer.engine.transfers import Part, stop_jobs
from kvxfer.layout.pairs import unpack_pairs
from kvxfer.engine.paths.pipeline import SlotsQuarantined, drain, fetch_read, stop_message
from kvxfer.layout import CacheView
from kvxfer.layout.plan import head_overlap
from kvxfer.layout.request import check_block_ids, check_coverage, id_bounds
from kvxfer.protocol import PackReady, Refuse
from kvxfer.protocol.messages import PackRequest
from kvxfer.types import MemKind, TransferPath

from kvxfer.engine.paths.kit import PathKit
from kvxfer.engine.paths.prepared import prepared_descriptors
from kvxfer.engine.paths.jobs import PipelineJob
from kvxfer.engine.paths.choose import PathFacts, choose_path

log = logging.getLogger("kvxfer.engine")

#: Seconds a failed staged start waits for its started pipelines to end (their worker stops at
#: its next receive; a move in flight ends first).
PIPELINE_STOP_SECONDS = 30.0

__all__ = ["ReadRoute", "plan_read", "shared_heads", "new_tag"]

_tags = itertools.count(secrets.randbits(48))
_tag_lock = threading.Lock()


def new_tag() -> int:
    """A pipeline tag unique in this process (random start: a restarted process does not reuse tags)."""
    with _tag_lock:
        return next(_tags) % (1 << 64)


def shared_heads(producer, consumer) -> tuple[int, int]:
    """Global KV-head range ``[start, stop)`` the consumer rank needs from the producer rank.

    Raises LayoutError when they share none (or are not the same model cache)."""
    heads = head_overlap(producer, consumer)
    if heads is None:
        raise LayoutError(f"producer rank {producer.tp_rank}/{producer.tp_size} holds no head consumer rank "
                          f"{consumer.tp_rank}/{consumer.tp_size} needs")
    return heads


@dataclass
class ReadRoute:
    """A chosen path and what ``start`` needs; ``mode`` is the path (``TransferPath.IPC``,
    ``STAGED`` or ``DIRECT``)."""

    mode: TransferPath
    links: list
    local: np.ndarray
    remote: np.ndarray
    request_id: str
    note: bytes
    requests: list = field(default_factory=list)  # layout RequestPlans: a list of chunks per link
    chunked: bool = False  # some link's request moves in several chunks (host staging smaller than it)

    packs: list = field(default_factory=list)  # staged: the PackRequests sent, awaiting their answers

    def start(self, kit: PathKit, view: CacheView, timeout: float | None, ask_timeout: float) -> list[Part]:
        """Start the transfer; returns one engine Part per producer rank.

        Raises KvxferError when a producer refuses or a launch fails; parts already started
        are cancelled first."""
        if self.mode is TransferPath.DIRECT:
            # A chunked request carries no NIXL notification: the read's Done tells the producer
            # once every chunk landed (one chunk's notification would end the hold too early).
            note = b"" if self.chunked else self.note
            return [Part(link.agent_name, chunk, link.view.geometry.kind, note)
                    for link, chunks in zip(self.links, self.requests) for chunk in chunks]
        if self.mode is TransferPath.IPC:  # a step's kernel reads are launched together
            raise RuntimeError("IPC reads are launched per step (ReadPaths.launch_ipc), not by ReadRoute.start")
        self.send_packs(kit, view, timeout, ask_timeout)  # nothing to send if they went with the claim
        packs, self.packs = self.packs, []
        parts: list[Part] = []
        try:
            for pack in packs:
                parts.append(self._start_staged(kit, pack, timeout))
        except BaseException:
            for pack in packs[len(parts) + 1:]:  # the failing one closed its own pipe
                _drop(kit, pack)
            # no byte may land once this read has failed: its started pipelines end first
            stop_jobs([part.job for part in parts], kit.clock, PIPELINE_STOP_SECONDS)
            raise
        return parts

    def send_packs(self, kit: PathKit, view: CacheView, timeout: float | None, ask_timeout: float) -> None:
        """Staged path: send every producer rank its ``PackRequest`` now, without waiting.

        ``Agent.read`` sends them right behind the claim, on the same session: the producer
        handles a session's requests in order, so it checks the claim first (a pack for a request
        not claimed is refused), and the two round trips overlap. ``start`` collects the answers;
        ``drop_packs`` gives them up."""
        if self.mode is not TransferPath.STAGED or self.packs:
            return
        try:
            for link in self.links:
                self.packs.append(self._send_pack(kit, view, link, timeout, ask_timeout))
        except BaseException:
            self.drop_packs(kit)
            raise

    def drop_packs(self, kit: PathKit) -> None:
        """Give up the packs sent and not started (the claim failed, or the read ends early).
        A producer that accepted one stops serving it when the request's hold ends."""
        packs, self.packs = self.packs, []
        for pack in packs:
            _drop(kit, pack)

    def _send_pack(self, kit: PathKit, view: CacheView, link, timeout: float | None,
                   ask_timeout: float) -> "_SentPack":
        staging = link.info.staging
        unpack = unpack_pairs(link.spec, self.remote, view.spec, view.geometry, self.local, 0)
        piece = min(kit.area.slot_bytes, staging.slot_bytes)
        tag = new_tag()
        pipe = kit.router.open(link.agent_name, tag, 0, staging.slots)
        start, stop = shared_heads(link.spec, view.spec)
        seconds = timeout if timeout is not None else 0.0
        try:
            pending = link.send(PackRequest(self.request_id, self.remote.tolist(), start, stop,
                                            self.local.tolist(), tag, piece, seconds), ask_timeout)
        except BaseException:
            kit.router.close(pipe)
            raise
        return _SentPack(link, pending, pipe, unpack, piece, tag)

    def _start_staged(self, kit: PathKit, pack: "_SentPack", timeout: float | None) -> Part:
        link, pipe, unpack, piece, tag = pack.link, pack.pipe, pack.unpack, pack.piece, pack.tag
        staging = link.info.staging
        try:
            reply = pack.pending.answer()
            if isinstance(reply, Refuse):
                raise TransferFailedError(f"producer {link.engine_id} refused the staged read of "
                                          f"{self.request_id!r}: {reply.reason}")
            if not isinstance(reply, PackReady) or reply.nbytes != unpack.nbytes:
                raise ProtocolError(f"PackReady for {self.request_id!r}: expected {unpack.nbytes} bytes; "
                                    f"got {getattr(reply, 'nbytes', type(reply).__name__)}")
        except BaseException:
            kit.router.close(pipe)
            raise
        deadline = kit.clock.now() + (timeout if timeout is not None else 1e9)
        count = kit.slots_per_transfer(len(self.links))
        held: list = []

        def body() -> None:
            try:
                slots = kit.take_slots(count, deadline, pipe.check)  # raises once cancelled
                held.append(slots)
                fetch_read(tag, unpack, slots, kit.kernel, pipe, kit.backend, link.agent_name,
                           lambda s: staging.addr + s * staging.slot_bytes, staging.device, deadline, piece,
                           remote_kind=MemKind(staging.mem_kind), clock=kit.clock)
            except SlotsQuarantined as exc:  # a READ of the producer's slots may still run: no STOP
                log.warning("staged read of %r: staging slots quarantined until %d move(s) into them end",
                            self.request_id, len(exc.moves))
                # not handed back by cleanup: a late byte there would corrupt another read
                kit.park_slots(held.pop(), _MovesEnded(kit.backend, exc.moves), writes=True)
                raise
            except BaseException:
                _stop_producer(pipe, tag)  # every READ we posted has ended: the producer may reuse its slots
                raise

        def cleanup() -> None:
            kit.router.close(pipe)
            for slots in held:
                kit.give_slots(slots)

        job = PipelineJob(f"kvxfer-fetch-{self.request_id}", body, pipe, cleanup, unpack.nbytes,
                          -(-unpack.nbytes // piece))
        return Part(link.agent_name, None, link.view.geometry.kind, self.note, job=job)


def _stop_producer(pipe, tag: int) -> None:
    """Send the producer STOP for ``tag`` (its serve ends and its slots go back at once); a send
    that fails leaves the producer to its deadline, as before STOP existed."""
    try:
        pipe.send(stop_message(tag))
    except KvxferError as exc:
        log.debug("staged read (tag %d): STOP not sent: %s", tag, exc)


class _MovesEnded:
    """``ready`` of quarantined staging slots (``PathKit.park_slots``): True once the backend
    reports every one of ``moves`` ended (DONE or FAILED; each is released then)."""

    def __init__(self, backend, moves: list[int]) -> None:
        self._backend, self._moves = backend, list(moves)

    def __call__(self) -> bool:
        self._moves = drain(self._backend, self._moves, float("-inf"))  # one look at each
        return not self._moves


@dataclass
class _SentPack:
    """A staged read's ``PackRequest`` to one producer rank, sent and not yet answered."""

    link: object
    pending: object
    pipe: object
    unpack: object
    piece: int
    tag: int


def _drop(kit: PathKit, pack: _SentPack) -> None:
    pack.pending.cancel()
    kit.router.close(pack.pipe)


_PARTIAL_WHY = ("a read whose last blocks are partial (num_tokens) moves by descriptors: this path moves "
                "whole chunks of blocks")


def plan_read(kit: PathKit, configured: str, view: CacheView, links: list, local: np.ndarray,
              remote: np.ndarray, request_id: str, note: bytes, allow_conversion: bool,
              num_tokens: int | None = None) -> ReadRoute:
    """Validate the request against every producer rank and choose its path.

    ``num_tokens``: the tokens the read moves, each list's last block possibly partial (None:
    every token; a count equal to what both lists cover is the same read). A partial read
    takes the descriptor path (direct), where ``_PARTIAL_WHY`` rules out the others.

    Raises: BlockIdError / LayoutError (bad ids or specs, lists that do not fit ``num_tokens``),
    ConfigError (a forced path that cannot serve this request, naming why)."""
    plans = [link.plan(view, allow_conversion=allow_conversion) for link in links]
    if num_tokens is not None:
        for link in links:
            check_coverage(local.size, view.spec.block_size, remote.size, link.spec.block_size, num_tokens)
        if all(num_tokens == local.size * view.spec.block_size == remote.size * link.spec.block_size
               for link in links):
            num_tokens = None  # whole blocks on both sides: today's read
    if num_tokens is not None:
        return _plan_partial(kit, configured, links, plans, local, remote, request_id, note, num_tokens)
    if configured in ("auto", "ipc") and links and all(kit.ipc_why(link) is None for link in links):
        # The kernel reads block ids, not descriptors: check the ids and skip the descriptor tables.
        for link in links:
            _check_ids(view.spec, local, link.spec, remote)
        return ReadRoute(TransferPath.IPC, links, local, remote, request_id, note)
    requests = _prepared_requests(kit, view, links, plans, local, remote)
    if requests is not None and configured == "auto":
        # A prepared read: a host cache, at most PREPARED_DESCRIPTORS whole blocks, nothing staged,
        # some rank not mapped for the kernel. ``choose_path`` can only answer direct for it (staged
        # takes a GPU cache, or HOST_MANY_DESCRIPTORS and more across a network), so the facts
        # it would weigh are not gathered on every read (tests/engine/test_paths.py holds the two to
        # the same answer).
        return ReadRoute(TransferPath.DIRECT, links, local, remote, request_id, note, [[r] for r in requests])
    if requests is None:
        requests = [plan.for_request(local, remote) for plan in plans]
    descriptors = sum(int(r.local.shape[0]) for r in requests)
    num_bytes = sum(int(r.num_bytes) for r in requests)
    chunks = [chunk_request(plan, req, local, remote, kit.config.staging_bytes)
              for plan, req in zip(plans, requests)]
    direct_why = None
    if kit.vram and any(r.staging_bytes for r in requests):
        direct_why = ("the layout plan is not plain byte ranges (head slices or a layout change) and its "
                      "host staging step does not apply to a GPU cache")
    facts = PathFacts(ipc_why=_first(kit.ipc_why(link) for link in links) if links else "no producer rank",
                      staged_why=_first(kit.staged_why(link) for link in links) if links else "no producer rank",
                      direct_why=direct_why, local_vram=kit.vram, descriptors=descriptors, num_bytes=num_bytes,
                      remote=bool(links) and all(kit.remote(link) for link in links),
                      peer_staging_vram=all(_staging_kind(link) == MemKind.VRAM.value for link in links))
    mode = choose_path(configured, facts)
    return ReadRoute(mode, links, local, remote, request_id, note, chunks,
                     chunked=any(len(c) > 1 for c in chunks))


def _prepared_requests(kit: PathKit, view: CacheView, links: list, plans: list, local: np.ndarray,
                       remote: np.ndarray) -> list | None:
    """A small whole-block read as indices into every rank's prepared lists (``PathKit.prepared``),
    or None (the plan's rows then). Its ids get the plan's checks (the remote bound, equal tokens;
    the local ids were checked by the read's caller)."""
    if kit.vram or not links or local.size != remote.size or \
            view.geometry.bases.size * local.size > prepared_descriptors():
        return None  # (lists of other lengths: the plan's checks name the error; a large read: nothing prepared)
    if _adjacent_run(local, remote):
        return None  # a run of adjacent blocks on both sides: the plan's rows join it into one descriptor
    lists = []
    for link, plan in zip(links, plans):
        prepared = kit.prepared(link, view, plan)
        if prepared is None:
            return None
        lists.append(prepared)
    for link in links:
        _check_ids(view.spec, local, link.spec, remote)
    return [p.request(local, remote) for p in lists]


def _adjacent_run(local: np.ndarray, remote: np.ndarray) -> bool:
    """Whether two consecutive blocks are adjacent on both sides (``local[i+1] == local[i] + 1``
    and the same of ``remote``). A short list is looked at as Python ints (numpy's per-call cost
    is most of it there)."""
    if local.size < 2:
        return False
    if local.size <= 64:
        lo, re_ = local.tolist(), remote.tolist()
        return any(b - a == 1 and d - c == 1 for a, b, c, d in zip(lo, lo[1:], re_, re_[1:]))
    return bool(((local[1:] - local[:-1] == 1) & (remote[1:] - remote[:-1] == 1)).any())


def _plan_partial(kit: PathKit, configured: str, links: list, plans: list, local: np.ndarray,
                  remote: np.ndarray, request_id: str, note: bytes, num_tokens: int) -> ReadRoute:
    """``plan_read`` of a read whose last blocks are partial: descriptors only (direct)."""
    requests = [plan.for_request(local, remote, num_tokens=num_tokens) for plan in plans]
    chunks = [chunk_request(plan, req, local, remote, kit.config.staging_bytes, num_tokens)
              for plan, req in zip(plans, requests)]
    direct_why = None
    if kit.vram and any(r.staging_bytes for r in requests):
        direct_why = ("the layout plan is not plain byte ranges (head slices or a layout change) and its "
                      "host staging step does not apply to a GPU cache")
    facts = PathFacts(ipc_why=_PARTIAL_WHY, staged_why=_PARTIAL_WHY, direct_why=direct_why, local_vram=kit.vram,
                      descriptors=sum(int(r.local.shape[0]) for r in requests),
                      num_bytes=sum(int(r.num_bytes) for r in requests),
                      remote=bool(links) and all(kit.remote(link) for link in links),
                      peer_staging_vram=all(_staging_kind(link) == MemKind.VRAM.value for link in links))
    mode = choose_path(configured, facts)
    return ReadRoute(mode, links, local, remote, request_id, note, chunks,
                     chunked=any(len(c) > 1 for c in chunks))


def chunk_request(plan, req, local: np.ndarray, remote: np.ndarray, capacity: int,
                  num_tokens: int | None = None) -> list:
    """``req`` cut into requests whose host staging fits ``capacity`` bytes (``[req]`` when it
    fits, or when it stages nothing). Chunks cut at whole tokens of both block sizes; with
    ``num_tokens`` (a partial read) the last chunk ends at that token.

    Raises:
        LayoutError: not even one chunk's staging fits (names both sizes)."""
    if not req.staging_bytes or req.staging_bytes <= capacity:
        return [req]
    ls, rs = plan.local.spec, plan.remote.spec
    unit_tokens = math.lcm(ls.block_size, rs.block_size)
    lu, ru = unit_tokens // ls.block_size, unit_tokens // rs.block_size
    total = local.size * ls.block_size if num_tokens is None else num_tokens
    units = max(1, -(-total // unit_tokens))
    per_unit = -(-req.staging_bytes // units)
    step = max(1, capacity // per_unit)

    def part(i: int):
        tokens = min(step, units - i) * unit_tokens
        if num_tokens is None or i * unit_tokens + tokens <= num_tokens:
            return plan.for_request(local[i * lu:(i + step) * lu], remote[i * ru:(i + step) * ru])
        return plan.for_request(local[i * lu:(i + step) * lu], remote[i * ru:(i + step) * ru],
                                num_tokens=num_tokens - i * unit_tokens)

    while True:
        out = [part(i) for i in range(0, units, step)]
        if all(c.staging_bytes <= capacity for c in out):
            return out
        if step == 1:
            raise LayoutError(f"one chunk of this request stages {max(c.staging_bytes for c in out)} bytes; "
                              f"the host staging buffer (staging_bytes) holds {capacity}")
        step = max(1, step // 2)


def _check_ids(local_spec, local: np.ndarray, remote_spec, remote: np.ndarray) -> None:
    """The checks the layout plan runs on a request's ids, without building its descriptors.

    ``local`` and ``remote`` come from ``Agent.read``'s ``check_block_ids`` (1-D int64, distinct,
    local ids below ``local_spec.num_blocks``): only the remote ids' bound, which that check could
    not know, is left to test."""
    if remote.size and id_bounds(remote)[1] >= remote_spec.num_blocks:
        check_block_ids("remote", remote, remote_spec.num_blocks)  # raises, naming the id and the bound
    if local.size * local_spec.block_size != remote.size * remote_spec.block_size:
        raise BlockIdError(
            f"local and remote block lists must cover the same tokens; local {local.size} blocks x "
            f"{local_spec.block_size} = {local.size * local_spec.block_size} tokens, remote {remote.size} "
            f"blocks x {remote_spec.block_size} = {remote.size * remote_spec.block_size} tokens")


def _first(reasons) -> str | None:
    for why in reasons:
        if why is not None:
            return why
    return None


def _staging_kind(link) -> str | None:
    """The memory kind of the producer's announced staging area (None: it offers none)."""
    staging = link.info.staging
    return staging.mem_kind if staging is not None else None
