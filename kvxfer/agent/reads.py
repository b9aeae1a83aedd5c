"""The consumer's reads after their checks: routed, claimed, started and settled (layer: agent; the engine launches and posts).

``Agent.read_many`` checks each read (ids, request ids, quarantine), reserves it in the engine
(so its handle exists, counts as in flight and can be aborted) and hands each producer's share
of the step to ``ReadFlow``, on one of two ways:

* **Here, on the caller's thread** (``start_here``), when the producer is known (every link
  handshaken, one rank to claim from) and nothing is queued on its lane: each read is routed
  (``ReadPaths.plan``: its ids checked against the producer's cache; a read refused for its own
  arguments fails now and sends nothing), the IPC reads are launched (one kernel launch per rank),
  and the step's claim goes into the express lane's socket where that cannot wait
  (``Claims.try_send_many``). What is left, the answer, the grant, the post, is done by whichever
  thread polls one of the reads (``ReadStep.advance``: ``wait``, ``done``, ``Agent.poll``, the
  progress thread), never by another hand-over.
* **On the producer's lane** (``run``; ``PeerLanes``, one thread per producer instance) for the
  rest: a new peer's handshake, several ranks, staged reads, a claim the socket had no room for.
  The lane routes, claims (``_claim``), launches, and settles the answers (``_settle``).

Settling (``_settle``, either way): a granted direct read is posted, all of a step's to one rank
in one backend transfer (``ReadPaths.direct_step``); a granted IPC read may complete once its
kernel passed (polling one read of a launch completes all its granted reads,
``TransferEngine._poke``); a staged read starts its pipeline; a refused one fails with
``LeaseExpiredError``, and an IPC read's destination blocks stay in flight until its kernel has
passed. A grant a read no longer wants goes back on the producer's lane (``Claims``).

Why an IPC move may start before its grant, even before its claim leaves: the producer places
its hold before it publishes the ids, and frees a request's blocks only after its hold ended; a
grant says the hold (of exactly these ids) had not ended when the claim arrived, so it covered
the whole time from the ids' publication to the grant, and every byte the kernel moved before
the grant came from held blocks. A request succeeds only once granted and complete within its
window (``TransferEngine``), so a read never reports bytes from blocks the producer freed. A
producer that releases or expires the hold first refuses the claim: that read fails, whatever it
moved. NIXL moves wait for the grant: over TCP they need the producer's own progress, so a
producer frozen at claim time would leave them pending, and the read's blocks quarantined,
where waiting costs one round trip and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.engine.lifecycle import LIVE
from kvxfer.engine.readpaths import StepRead
from kvxfer.errors import (ClosedError, KvxferError, LayoutError, PeerLostError, TransferFailedError,
                           TransferTimeoutError)
from kvxfer.layout import notify_ranks, peer_ranks
from kvxfer.protocol import encode_notification
from kvxfer.types import TransferPath

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts
    from kvxfer.agent.peers import PeerLink

__all__ = ["PendingRead", "ReadFlow", "ReadStep", "links_for", "rank_port", "ready_links", "stranded"]

log = logging.getLogger("kvxfer.agent")


@dataclass(eq=False)  # identity (``r in reads``): never compares the id arrays
class PendingRead:
    """A read reserved in the engine and queued on its producer's lane."""

    req: object               # the engine's request (``TransferEngine.reserve``)
    remote: tuple[str, int]
    local: np.ndarray
    remote_ids: np.ndarray
    request_id: str
    deadline: float | None
    timeout: float | None
    note_key: tuple           # (engine id, auth key): its completion note is made where a path needs one
    started: float            # perf_counter at the call
    same_format: bool = False
    num_tokens: int | None = None         # the tokens it moves, last blocks partial (None: every token)
    route: object = None                   # its ``ReadRoute`` once routed (``ReadPaths.plan``)
    sent: list | None = None              # the claim's pending answers (``Claims.send_many``)
    sent_error: KvxferError | None = None  # why the claim could not be sent
    claim_started: float = 0.0
    claim_clock: float = 0.0               # the agent's clock just before its claim left
    launched: object = None                # the route its IPC kernel was launched for
    token: object = None                   # the producer's ``HoldToken``, or None (issue 35)
    tokened: bool = False                  # moving by its token, with no claim: no lane takes it
    step_route: tuple | None = None        # (route, n): planned with the n reads sharing that route
    _note: bytes | None = None

    @property
    def live(self) -> bool:
        """Neither failed nor ended: it may still succeed."""
        return self.req.phase in LIVE

    @property
    def epoch(self) -> int:
        """The epoch its done notice names: its hold token's when it went by the token, else 0
        (the producer then ends the request's hold, whichever it is)."""
        return self.token.epoch if self.tokened else 0

    @property
    def note(self) -> bytes:
        """The NIXL notification that tells the producer this read is done (made on first use:
        a kernel's or a step's shared post notifies through the done lane and needs none)."""
        if self._note is None:
            self._note = encode_notification(self.request_id, *self.note_key)
        return self._note


def rank_port(head: "PeerLink", rank: int) -> int:
    """Side-channel port of another TP rank of the head's instance (ranks use consecutive ports)."""
    return head.port - head.spec.tp_rank + rank


def links_for(peers, spec, remote: tuple[str, int], timeout: float | None = None):
    """Links to the remote ranks a rank of ``spec`` reads from, and to those it only notifies."""
    host, port = remote
    head = peers.get(host, int(port), timeout=timeout)
    tp = head.spec.tp_size
    read = set(peer_ranks(spec, tp))

    def link(rank: int):
        return head if rank == head.spec.tp_rank else peers.get(host, rank_port(head, rank), timeout=timeout)

    ranks = notify_ranks(spec, tp)
    return [link(r) for r in ranks if r in read], [link(r) for r in ranks if r not in read]


def ready_links(peers, spec, remote: tuple[str, int]):
    """``links_for`` without any I/O: None unless every rank it needs is handshaken and healthy."""
    host, port = remote
    head = peers.cached(host, port)
    if head is None:
        return None
    tp = head.spec.tp_size
    read = set(peer_ranks(spec, tp))
    links: tuple[list, list] = ([], [])
    for rank in notify_ranks(spec, tp):
        link = head if rank == head.spec.tp_rank else peers.cached(host, rank_port(head, rank))
        if link is None:
            return None
        links[0 if rank in read else 1].append(link)
    return links


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class ReadFlow:
    """Runs the reads queued for one producer (see the module doc). Owned by an ``Agent``."""

    def __init__(self, agent: "AgentParts") -> None:
        self._agent = agent

    # ---- on the caller's thread -------------------------------------------------------
    def start_here(self, remote: tuple[str, int], reads: list[PendingRead], ready) -> bool:
        """Route, launch (IPC) and claim a step's reads to one producer on the caller's thread,
        where that cannot wait on the peer: every link is handshaken (``ready``: ``ready_links``),
        the producer has one rank to claim from, and its express lane takes the claim now
        (``Claims.try_send_many``). True when done so: the reads then move on whichever thread
        polls them (``ReadStep.advance``), with no lane. False when the lane must carry them
        (a staged read, several ranks, a socket without room): nothing was sent, their routes
        are kept. A read refused for its own arguments fails here, before any claim."""
        agent = self._agent
        if ready is None or not ready[0] or len(ready[0]) + len(ready[1]) != 1:
            return False
        links = ready[0]
        live = [r for r in reads if r.live and r.route is None]
        try:
            if agent.paths.kernel_serves(links):
                self._route_step(live, links)
            else:
                self._route_direct_step(live, links)
        except Exception as exc:  # noqa: BLE001 - fail what it left; nothing was sent
            log.exception("kvxfer: routing reads to %s:%d", *remote)
            self.crashed(reads, exc)
            return True
        routed = [r for r in reads if r.live and r.route is not None]
        if any(r.route.mode is TransferPath.STAGED for r in routed):
            return False  # staged reads wait their turn on the lane (see ``_wait_turn``)
        if not routed:
            return True
        routed = self._start_tokened(routed, links)  # issue 35: reads by their hold token claim nothing
        if not routed:
            return True
        try:
            wait = self._time_left(routed)
        except TransferTimeoutError as exc:
            self._fail_all(routed, exc)
            return True
        # An IPC kernel starts before its claim leaves: the claim's round trip overlaps it.
        self.launch(routed)
        clock = agent.clock.now()  # before the claim leaves: its window starts later at the producer
        try:
            sent = agent.claims.try_send_many([(r.request_id, r.remote_ids, self._window(r)) for r in routed],
                                               links[0], wait, lane=remote)
        except KvxferError:
            sent = None  # the lane's own send meets it again and reports it
        if sent is None:
            return False
        started = time.perf_counter()
        for r, answer in zip(routed, sent):
            r.claim_started, r.claim_clock, r.sent = started, clock, answer
        step = ReadStep(self._agent.claims, self._settle, self._settle_crashed, routed, links)
        agent.engine.on_advance([r.req for r in routed], step.advance)
        return True

    def _start_tokened(self, routed: list[PendingRead], links: list) -> list[PendingRead]:
        """Start at once, with no claim, the reads of ``routed`` whose hold token proves their hold
        (``TokenReads``; docs/reliability.md, "hold tokens"): granted now, the engine looks at the
        producer's word once their move completed (``_Request.verify``). Returns the others."""
        agent = self._agent
        view = agent.tokens.view(links[0]) if any(r.token is not None for r in routed) else None
        if view is None:
            return routed
        tokened = [r for r in routed if r.token is not None
                   and (r.route.mode is TransferPath.IPC or _one_post(r.route))]
        if not tokened:
            return routed
        for r in tokened:
            r.tokened = True
            r.req.stats.by_token = True  # issue 35 (s2): TransferStats says the read claimed nothing
        # The kernel first (not granted yet: none of its reads can succeed), then the looks, then
        # the grants: a look is in place before its read's grant, so no success can skip it, and
        # setting the looks up overlaps the kernel.
        self.launch(tokened)
        verifier = agent.tokens.verifier
        direct = []
        for r in tokened:
            r.req.verify = verifier(view, r.request_id, r.token)
            if r.route.mode is TransferPath.DIRECT:
                if r.live:
                    direct.append(r)
            elif not r.req.granted:  # the token is the grant
                agent.engine.grant(r.req)
        if direct:
            self._post_direct_many(direct, grant=True)  # granted as they are posted
        polled: set[int] = set()
        for r in tokened:  # its kernel may have passed already: one poll per launch completes its group
            key = id(r.req.group) if r.req.group is not None else id(r)
            if r.route.mode is TransferPath.IPC and r.live and key not in polled:
                polled.add(key)
                r.req.handle.done()
        chosen = {id(r) for r in tokened}
        return [r for r in routed if id(r) not in chosen]

    def _route_step(self, reads: list[PendingRead], links: list) -> None:
        """Route a step's reads to one producer at once: the kernel path's checks (the layout
        plan, the remote ids' bound) run once over all their ids, and every read shares the one
        route (the kernel path keeps nothing per request in it). Where that check fails, each
        read is routed on its own, so each gets its own error."""
        agent = self._agent
        plain = [r for r in reads if not r.same_format and r.num_tokens is None]
        for r in reads:
            if r.same_format or r.num_tokens is not None:  # checked and routed on its own
                self._route(r, links)
        if len(plain) < 2:
            for r in plain:
                self._route(r, links)
            return
        try:
            route = agent.paths.plan(links, np.concatenate([r.local for r in plain]),
                                      np.concatenate([r.remote_ids for r in plain]), plain[0].request_id,
                                      plain[0].note)
        except KvxferError:
            route = None
        local_block = agent.spec.block_size
        remote_blocks = {link.spec.block_size for link in links}
        for r in plain:
            tokens = r.local.size * local_block
            if route is not None and route.mode is TransferPath.IPC \
                    and all(r.remote_ids.size * b == tokens for b in remote_blocks):
                r.route = route
            else:
                self._route(r, links)

    def _route_direct_step(self, reads: list[PendingRead], links: list) -> None:
        """Route a step's reads to one producer rank off the kernel path: the plain token reads
        (whole blocks, any format) are planned together, one plan of all their ids, so that the
        step is checked, planned and posted once (``ReadPaths.direct_shared``); where that plan is
        not one plain direct post (a layout needing the host staging step, chunks, an id error:
        each read then gets its own error), each read is routed on its own, as the others are."""
        plain = [r for r in reads if r.token is not None and not r.same_format and r.num_tokens is None]
        route = None
        if len(plain) >= 2 and len(links) == 1:
            locals_ = np.sort(np.concatenate([r.local for r in plain]))
            if (locals_[1:] == locals_[:-1]).any():  # two reads into one block: each on its own
                plain = []
        if len(plain) >= 2 and len(links) == 1:
            try:
                route = self._agent.paths.plan(links, np.concatenate([r.local for r in plain]),
                                               np.concatenate([r.remote_ids for r in plain]), plain[0].request_id,
                                               plain[0].note)
            except KvxferError:
                route = None
            blocks = self._agent.spec.block_size, links[0].spec.block_size
            if route is not None and (not _one_post(route) or not all(
                    r.local.size * blocks[0] == r.remote_ids.size * blocks[1] for r in plain)):
                route = None
        chosen = {id(r) for r in plain} if route is not None else set()
        for r in reads:
            if id(r) in chosen:
                r.route, r.step_route = route, (route, len(plain))
            else:
                self._route(r, links)

    def launch(self, reads: list[PendingRead]) -> None:
        """Launch the IPC reads of ``reads`` not launched yet (one kernel launch per rank)."""
        try:
            self._launch_ipc([r for r in reads if r.live and r.route is not None
                              and r.route.mode is TransferPath.IPC and not r.launched])
        except Exception as exc:  # noqa: BLE001
            log.exception("kvxfer: launching reads")
            self.crashed(reads, exc)

    # ---- on a lane -------------------------------------------------------------------
    def run(self, remote: tuple[str, int], reads: list[PendingRead]) -> None:
        """Carry out ``reads`` (all to ``remote``); every one ends on its handle, typed."""
        pending = [r for r in reads if r.live and not r.tokened]
        for attempt in (1, 2):  # a peer that restarted since our handshake gets one fresh handshake
            if not pending:
                return
            try:
                links, notify_only = links_for(self._agent.peers, self._agent.spec, remote,
                                               self._time_left(pending))
            except KvxferError as exc:
                self._fail_all(pending, exc)
                for r in pending:  # a claim sent from the caller's thread: its grant goes back
                    if r.sent is not None:
                        self._agent.claims.undo(r.request_id, r.sent)
                        r.sent = None
                return
            stale = [r for r in pending if r.route is not None and not _same(r.route.links, links)]
            for r in stale:  # routed on links replaced since: again (one launched already fails below)
                r.route = None
            routed = [r for r in pending if r.route is not None or self._route(r, links)]
            kept = {id(r) for r in routed}
            for r in pending:  # claimed on the caller's thread, then failed routing: give it back
                if r.sent is not None and id(r) not in kept:
                    self._agent.claims.undo(r.request_id, r.sent)
                    r.sent = None
            if not routed:
                return
            if len(links) == 1 and not notify_only:
                # a read by its hold token claims nothing on the lane either (a new peer's first
                # reads, reads queued behind other lane work); the rest claim below
                routed = self._start_tokened([r for r in routed if r.sent is None], links) + [
                    r for r in routed if r.sent is not None]
                if not routed:
                    return
            lost = self._claim([r for r in routed if r.sent is None], links + notify_only, retry=attempt == 1)
            if lost and attempt == 1:
                for link in links + notify_only:
                    self._agent.peers.drop(link)
            elif lost:
                for r in lost:
                    self._fail(r, r.sent_error)
            sent = [r for r in routed if r not in lost]
            # IPC reads not launched yet (one launched on links since replaced fails typed there)
            self._launch_ipc([r for r in sent if r.route.mode is TransferPath.IPC and r.launched is not r.route])
            self._send_packs(sent)
            self._settle(sent, links)
            pending = [r for r in lost if r.live] if attempt == 1 else []

    def _settle_crashed(self, reads: list[PendingRead], exc: BaseException) -> None:
        """Settling ``reads`` raised something unexpected (a bug), on whichever thread polled:
        logged, and every one of them left stranded (``stranded``) fails typed now rather than
        by its deadline; those granted and posted end with their transfers. Their producer's
        window lapses by itself (the hold stays for a retry)."""
        log.error("kvxfer: settling a step's reads raised; the reads it left stranded fail", exc_info=exc)
        self.crashed(reads, TransferFailedError(f"internal error while its claim's answer was taken: {exc!r}"))

    def crashed(self, reads: list[PendingRead], exc: BaseException) -> None:
        """The lane's batch (or a step's routing or launch) raised something unexpected: fail what
        it left stranded (``stranded``); reads granted and posted go on and end with their transfers."""
        error = exc if isinstance(exc, KvxferError) else ClosedError(f"read failed: {exc!r}")
        self._fail_all([r for r in reads if stranded(r)], error)

    # ---- steps -------------------------------------------------------------------
    def _route(self, r: PendingRead, links: list) -> bool:
        """Choose ``r``'s path; False (``r`` failed) on a layout or id error."""
        agent = self._agent
        try:
            if r.same_format:
                _check_same_format(agent.spec, links)
            r.route = agent.paths.plan(links, r.local, r.remote_ids, r.request_id, r.note,
                                        num_tokens=r.num_tokens)
            return True
        except KvxferError as exc:
            self._fail(r, exc)
            return False

    def _claim(self, reads: list[PendingRead], links: list, retry: bool = False) -> list[PendingRead]:
        """Send every read's claim (one message per rank); returns the reads whose claim could not
        even be sent because the peer was lost (they may retry on fresh links; one whose kernel
        was launched already fails typed instead, ``_launch_ipc``)."""
        claims = self._agent.claims
        try:
            wait = self._time_left(reads)
        except TransferTimeoutError as exc:
            self._fail_all(reads, exc)
            return []
        items = [(r.request_id, r.remote_ids, self._window(r)) for r in reads]
        started, clock = time.perf_counter(), self._agent.clock.now()
        for r in reads:
            r.claim_started, r.claim_clock = started, clock
        lost = []
        lane = reads[0].remote if reads else None  # give-backs run on the lane these reads run on
        for r, sent in zip(reads, claims.send_many(items, links, timeout=wait, lane=lane)):
            r.sent = sent
            errors = [p for _, p in sent if isinstance(p, PeerLostError)]
            if errors:
                survived = [(lk, p) for lk, p in sent if not isinstance(p, KvxferError)]
                if retry:
                    # Its retry claims these ranks again (the same engines, so the same windows):
                    # their answers are taken here and nothing is given back. A give-back queued
                    # now would reach the producer after the retry's grant and close its window
                    # under the retry's read.
                    with contextlib.suppress(KvxferError):
                        claims.answers(r.request_id, survived)
                else:
                    claims.undo(r.request_id, survived)
                r.sent, r.sent_error = None, errors[0]  # claimed again on fresh links, or failed
                lost.append(r)
        return lost

    def _send_packs(self, reads: list[PendingRead]) -> None:
        """Send a lone staged read's pack requests right behind its claim (several staged reads
        of a batch run one after another, see ``_wait_turn``: their packs go then)."""
        agent = self._agent
        staged = [r for r in reads if r.route.mode is TransferPath.STAGED and r.live]
        if len(staged) == 1:
            r = staged[0]
            try:
                agent.paths.send_packs(r.route, r.timeout, self._time_left([r]))
            except KvxferError as exc:
                self._fail(r, exc)

    def _launch_ipc(self, reads: list[PendingRead]) -> None:
        """One pair-copy launch per producer rank for every IPC read of the batch, one event
        (``ReadPaths.launch_ipc``); the step's reads attach their members of it in one pass
        (``TransferEngine.attach_step``), not granted (a claim's answer or a token grants them)."""
        again = [r for r in reads if r.launched is not None]
        for r in again:  # its first kernel is its request's part: a second cannot be attached to it
            self._fail(r, PeerLostError(
                f"request {r.request_id!r}: its producer's links changed after its kernel was launched "
                "(a restart, a lost session): read it again"))
        reads = [r for r in reads if r.launched is None]
        if not reads:
            return
        agent, engine = self._agent, self._agent.engine
        with engine.posting([r.req for r in reads]) as live_reqs:
            live = _still_live(reads, live_reqs)
            if not live:
                return
            links = live[0].route.links
            try:
                parts = agent.paths.launch_ipc(links, [StepRead(r.local, r.remote_ids, b"") for r in live])  # done lane
            except KvxferError as exc:
                for r in live:
                    self._fail(r, exc)
                return
            send = agent.done.send
            now = time.perf_counter()
            for r, read_parts in zip(live, parts):
                for link, part in zip(links, read_parts):
                    part.on_done = partial(send, link, r.request_id, r.epoch)
                r.launched = r.route
                self._on_success(r)
            engine.attach_step([r.req for r in live], parts, mode=TransferPath.IPC,
                               setup_seconds=[now - r.started for r in live])

    def _post_direct_many(self, reads: list[PendingRead], grant: bool = False) -> None:
        """Post granted direct reads: each producer rank's share of all of them in one backend
        transfer (``ReadPaths.direct_step``), each read owning a member of it; a read that goes
        through the host staging buffer (a layout change) or in chunks is posted on its own.
        ``grant``: they are granted here, before their post (reads by their hold token)."""
        agent = self._agent
        reads = self._post_shared(reads, grant)
        if grant:
            for r in reads:
                agent.engine.grant(r.req)
        alone = [r for r in reads if not _one_post(r.route)]
        for r in alone:
            self._post_direct(r)
        reads = [r for r in reads if r not in alone]
        with agent.engine.posting([r.req for r in reads]) as live_reqs:
            live = _still_live(reads, live_reqs)
            parts, failed = agent.paths.direct_step([StepRead(r.local, r.remote_ids, r.note, r.route, r.timeout)
                                                     for r in live])
            for i, (r, read_parts) in enumerate(zip(live, parts)):
                # A read's notice goes once it is known good (a token read's: once its word
                # matched), on the producer rank's done lane (``DoneSender``), never as network
                # I/O on the thread that completes the read. A claimed read's lone post (no job
                # yet) carries its notice in its own transfer instead.
                by_name = None
                for part in read_parts:
                    if part.job is None and not r.tokened:
                        continue
                    if by_name is None:
                        by_name = {link.agent_name: link for link in r.route.links}
                    link = by_name.get(part.peer)
                    if link is not None:
                        part.on_done = partial(agent.done.send, link, r.request_id, r.epoch)
                        part.notification = b""
                    elif part.job is None and part.notification:
                        part.on_done = partial(agent.backend.notify, part.peer, part.notification)
                        part.notification = b""
                if i in failed:
                    self._fail(r, failed[i])
                    agent.claims.give_back(r.request_id)  # on the producer's lane, after the failure
                # a failed read's parts to other ranks, if posted, are attached: it ends only with them;
                # lone parts (no job yet) are posted by the engine here, with their notification
                self._attach(r, read_parts, started=True)

    def _post_shared(self, reads: list[PendingRead], grant: bool = False) -> list[PendingRead]:
        """Post the token reads of ``reads`` planned together (``_route_direct_step``): one post for
        each whole such step still live (``grant``: each granted as it is attached); returns the
        others, not granted here. A step one of whose reads ended
        meanwhile (an abort, a deadline) is routed again read by read: its one post would write
        into the ended read's blocks."""
        agent = self._agent
        steps: dict[int, list[PendingRead]] = {}
        rest = []
        for r in reads:
            if r.step_route is not None and r.step_route[0] is r.route:
                steps.setdefault(id(r.route), []).append(r)
            else:
                rest.append(r)
        for group in steps.values():
            with agent.engine.posting([r.req for r in group]) as live_reqs:
                if len(live_reqs) == len(group) == group[0].step_route[1]:
                    try:
                        parts = agent.paths.direct_shared(group[0].route, [StepRead(r.local, r.remote_ids, b"")
                                                                           for r in group])
                    except KvxferError as exc:
                        self._fail_all(group, exc)
                        continue
                    send, now = agent.done.send, time.perf_counter()
                    for r, read_parts in zip(group, parts):
                        for link, part in zip(r.route.links, read_parts):
                            part.on_done = partial(send, link, r.request_id, r.epoch)  # once known good
                        self._on_success(r)
                    agent.engine.attach_step([r.req for r in group], parts, mode=TransferPath.DIRECT,
                                             setup_seconds=[now - r.started for r in group], grant=grant)
                    continue
            for r in group:  # not whole any more: each on its own route
                r.step_route = None
                if r.live and self._route(r, r.route.links):
                    rest.append(r)
        return rest

    def _post_direct(self, r: PendingRead) -> None:
        """Post a granted direct read (its NIXL transfer carries the completion notification)."""
        agent = self._agent
        parts = agent.paths.start(r.route, r.timeout, 0.0)
        with agent.engine.posting([r.req]):
            if not self._attach(r, parts, started=False):
                agent.claims.give_back(r.request_id)  # not posted (failed meanwhile): no read comes

    def _attach(self, r: PendingRead, parts: list, started: bool, group: list | None = None) -> bool:
        self._on_success(r)
        mode = None if r.route.mode is TransferPath.DIRECT else r.route.mode
        return self._agent.engine.attach(r.req, parts, mode=mode, setup_seconds=time.perf_counter() - r.started,
                                          started=started, group=group)

    def _on_success(self, r: PendingRead) -> None:
        """The done notices ``r`` sends on success beside its parts' own: to every rank of a
        chunked read, and to the ranks it claimed from without reading from them."""
        if not r.route.chunked and not r.sent:
            return  # (most reads: a read by its token claimed nothing)
        agent = self._agent
        done_links = list(r.route.links) if r.route.chunked else []
        done_links += self._notify_only(r)
        if done_links:
            r.req.on_success = lambda: [agent.done.send(link, r.request_id, r.epoch) for link in done_links]

    def _notify_only(self, r: PendingRead) -> list:
        if not r.sent:  # a read by its token claimed nothing
            return []
        return [link for link, _ in r.sent if link not in r.route.links]

    def _settle(self, reads: list[PendingRead], links: list) -> None:
        """Take each read's claim answers: grant it (staged reads start now) or fail it."""
        agent = self._agent
        claims = agent.claims
        previous = None  # the batch's last staged read started
        direct: list[PendingRead] = []  # granted direct reads: posted together after the answers
        kernels: dict[int, PendingRead] = {}  # a granted IPC read per launch: polled once, below
        for r in reads:
            if r.sent is None:  # failed before its claim went out
                continue
            staged = r.route is not None and r.route.mode is TransferPath.STAGED
            try:
                window = claims.answers(r.request_id, r.sent)
            except KvxferError as exc:
                if staged:
                    agent.paths.drop_packs(r.route)
                self._fail(r, exc)
                continue
            if window is not None:  # the producers hold the blocks no longer than they granted
                agent.engine.bound_deadline(r.req, r.claim_clock + window)
            claimed = time.perf_counter() - r.claim_started
            if not r.live:  # failed (routing, abort, deadline) meanwhile: the grant is not wanted
                if staged:
                    agent.paths.drop_packs(r.route)
                claims.give_back(r.request_id)
                continue
            if r.route.mode is TransferPath.DIRECT:
                direct.append(r)
            elif r.route.mode is TransferPath.STAGED:
                self._wait_turn(r, previous)
                # Marked as being posted from before its pipeline starts until it is attached: it
                # cannot end meanwhile (an abort or its deadline only fails it), so no pipeline
                # writes into blocks whose read has ended.
                with agent.engine.posting([r.req]) as live:
                    if not live:  # ended while it waited its turn: nothing starts
                        agent.paths.drop_packs(r.route)
                        claims.give_back(r.request_id)
                        continue
                    try:
                        parts = agent.paths.start(r.route, r.timeout, self._time_left([r]))
                    except KvxferError as exc:
                        claims.give_back(r.request_id)
                        self._fail(r, exc)
                        continue
                    previous = r
                    for link, part in zip(r.route.links, parts):
                        part.on_done = partial(agent.done.send, link, r.request_id, r.epoch)
                    self._attach(r, parts, started=True)
            agent.engine.grant(r.req, claim_seconds=claimed)
            if r.route.mode is TransferPath.STAGED:
                r.req.handle.done()
            elif r.route.mode is TransferPath.IPC:
                kernels[id(r.req.group) if r.req.group is not None else id(r)] = r
        # An IPC read's bytes may be in already: poll one read per launch, which completes every
        # granted read of that launch whose kernel passed (``TransferEngine._poke``).
        for r in kernels.values():
            r.req.handle.done()
        if direct:
            self._post_direct_many(direct)
        if kernels or previous is not None or direct:
            agent.wake.set()

    def _wait_turn(self, r: PendingRead, previous: PendingRead | None) -> None:
        """Before a granted staged read starts, the batch's previous one ends (at most until
        ``r``'s deadline). Staged reads of one batch run one after another: each pipeline holds
        staging slots on both sides while it waits for the other side's, so two started at once
        could each hold what the other needs until their deadlines."""
        if previous is None:
            return
        left = None if r.deadline is None else max(0.0, r.deadline - self._agent.clock.now())
        try:
            previous.req.handle.wait(left)
        except KvxferError:
            pass  # it failed or is still running: either way this one waited its turn

    # ---- helpers -----------------------------------------------------------------
    def _fail(self, r: PendingRead, exc: KvxferError) -> None:
        self._agent.engine.fail(r.req, exc)
        self._agent.wake.set()

    def _fail_all(self, reads: list[PendingRead], exc: KvxferError) -> None:
        for r in reads:
            self._fail(r, exc)

    def _window(self, r: PendingRead) -> float:
        """The transfer window the claim asks for: what is left of the read's timeout (0: none)."""
        if r.deadline is None:
            return 0.0
        return max(1e-3, r.deadline - self._agent.clock.now())

    def _time_left(self, reads: list[PendingRead]) -> float:
        """Seconds the batch's next round trip may take: the least left of its reads' windows,
        capped by the handshake timeout. Raises TransferTimeoutError when none is left."""
        limit = self._agent.config.handshake_timeout
        deadlines = [r.deadline for r in reads if r.deadline is not None]
        if not deadlines:
            return limit
        left = min(deadlines) - self._agent.clock.now()
        if left <= 0:
            raise TransferTimeoutError("a read's timeout passed before its transfer started")
        return min(left, limit)


class ReadStep:
    """A step's reads to one producer whose claim left from the caller's thread (``start_here``):
    what is left of them moves on (their grant, post or failure) on whichever thread polls one
    of them, through ``advance``, never on a lane.

    ``advance(block)`` takes the claim's answers that are in (waiting at most ``block`` seconds
    for the first one still out: the socket's poll, not the interpreter) and settles those reads
    as the lane would (``ReadFlow._settle``): a granted direct read is posted on this thread, a
    granted IPC read may complete at once, a refused one fails typed. A read that ended meanwhile
    (its deadline, an abort) has its claim given back on the producer's lane. One thread settles
    a step at a time; another thread's call returns at once (or after ``block``)."""

    def __init__(self, claims, settle, crashed, reads: list[PendingRead], links: list) -> None:
        self._claims, self._settle, self._crashed, self._links = claims, settle, crashed, links
        self._open = list(reads)
        self._lock = threading.Lock()

    def advance(self, block: float = 0.0) -> bool:
        """Settle what can be; True once nothing of the step is left to settle."""
        if not self._lock.acquire(timeout=block) if block > 0 else not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._open:
                return True
            claims = self._claims
            ready, waiting = [], []
            for r in self._open:
                wait = block if not ready and not waiting else 0.0  # a step's claims share one answer
                (ready if r.sent is None or claims.ready(r.sent, wait) else waiting).append(r)
            self._open = []
            for r in waiting:
                if r.live:
                    self._open.append(r)
                else:  # ended before its answer came: the grant, if any, goes back on the lane
                    claims.undo(r.request_id, r.sent)
                    r.sent = None
            if ready:
                try:
                    self._settle(ready, self._links)
                except Exception as exc:  # noqa: BLE001 - a bug: no read of the step is left unsettled
                    self._crashed(ready, exc)
            return not self._open
        finally:
            self._lock.release()


def stranded(r: PendingRead) -> bool:
    """Whether ``r`` can no longer move on by itself after the code driving it raised: live and
    not both granted and posted (a granted, posted read completes as its transfer does; any
    other waits for a step that will not come, so it fails typed at once, and one already
    launched ends with its kernel)."""
    return r.live and not (r.req.posted and r.req.granted)


def _one_post(route) -> bool:
    """Whether ``route`` is one plain direct post: not chunked, nothing through the host staging
    buffer (what a read by its hold token or a step's shared post needs)."""
    return route.mode is TransferPath.DIRECT and not route.chunked and not any(
        c.staging_bytes for chunks in route.requests for c in chunks)


def _still_live(reads: list[PendingRead], live_reqs: list) -> list[PendingRead]:
    """The reads of ``reads`` whose request ``TransferEngine.posting`` found live (by identity)."""
    if len(live_reqs) == len(reads):
        return list(reads)  # posting keeps the order and drops only ended ones
    kept = {id(req) for req in live_reqs}
    return [r for r in reads if id(r.req) in kept]


def _check_same_format(spec, links: list) -> None:
    for link in links:
        peer = link.spec
        if (peer.layout, peer.storage, peer.block_size) != (spec.layout, spec.storage, spec.block_size):
            raise LayoutError(
                f"the read asks for the same format: producer {link.engine_id} has layout {peer.layout.value}, "
                f"storage {peer.storage.value}, block size {peer.block_size}; this cache has "
                f"{spec.layout.value}, {spec.storage.value}, block size {spec.block_size}")
