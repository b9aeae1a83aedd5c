"""A consumer's submissions: reads and writes checked, booked and queued on their peer's lane, and
each lane's batch handed to its flow (layer: agent; imports no adapter and no other agent's state).

``Agent.read_many`` and ``Agent.write`` keep the contract (their docstrings); this module does the
work behind them. Nothing here waits on a peer: a submission is checked at once (a bad argument
raises before anything is booked), booked in the engine so its handle exists, counts as in flight
and can be aborted, and put on the lane of its producer (``PeerLanes``: one thread per peer, so a
slow peer delays only its own work). The lane's thread then runs ``run_lane`` with everything
queued for that peer: reads (``ReadFlow``), writes (``run_writes``) and round trips of the push
model and of ``abort(wait=False)`` (``LaneJob``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvxfer.agent.args import MAX_BLOCK_ID, address, deadline_for, request_id, sequence
from kvxfer.agent.heartbeats import tell_abort
from kvxfer.agent.jobs import LaneJob
from kvxfer.agent.reads import PendingRead, ready_links, stranded
from kvxfer.agent.tokens import tag_error
from kvxfer.agent.writes import PendingWrite, run_writes
from kvxfer.engine.handles import TransferHandle
from kvxfer.config import check_flag
from kvxfer.errors import ConfigError, KvxferError, TransferFailedError
from kvxfer.layout.request import check_block_id_lists, check_block_ids, check_token_count
from kvxfer.protocol import encode_notification
from kvxfer.types import Direction, HoldToken, ReadRequest

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["AbortJob", "Submissions"]

log = logging.getLogger("kvxfer.agent")

_UNSET = object()


@dataclass
class AbortJob(LaneJob):
    """An ``abort(wait=False)``: the producer ranks are told on the lane, after the reads queued
    before it. A crashed lane drops it (the local read was cancelled already)."""

    request_id: str
    remote: tuple[str, int] | None
    links: list | None

    def run(self, agent) -> None:
        outcome = tell_abort(agent, self.request_id, self.remote, self.links)
        log.debug("abort of %r: %s", self.request_id, outcome.value)

    def fail(self, error: Exception) -> None:
        log.debug("abort of %r not told: %s", self.request_id, error)


def _good_token(token) -> bool:
    """Whether ``token`` is a ``HoldToken`` whose fields are what ``HoldToken.from_wire`` accepts."""
    if not isinstance(token, HoldToken):
        return False
    fields = (token.slot, token.epoch, token.tag)
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= int(v) < 1 << 64
               for v in fields) and int(token.epoch) > 0


class Submissions:
    """The consumer's reads and writes, from the call to their lane (see the module doc)."""

    def __init__(self, agent: "AgentParts") -> None:
        self._agent = agent

    def reads(self, requests: Sequence[ReadRequest], started: float) -> list[TransferHandle]:
        """``Agent.read_many`` after its open and registration checks: raises at once for a bad
        request (nothing booked), else one handle per request, in order."""
        agent = self._agent
        requests = sequence(requests, "read_many's requests")
        for rr in requests:
            if not isinstance(rr, ReadRequest):
                raise ConfigError(f"read_many takes ReadRequest items; got {type(rr).__name__}")
            request_id(rr.request_id)
            check_flag(rr.same_format, "same_format")
            if rr.token is not None and not _good_token(rr.token):
                raise ConfigError(f"a read's token must be a HoldToken of three integers below 2**64 (epoch >= 1) "
                                  f"or None; got {rr.token!r} for request {rr.request_id!r}")
        # the step's ids checked together (the same checks and errors as one by one)
        locals_ = check_block_id_lists("local", [rr.local_blocks for rr in requests], agent.spec.num_blocks)
        remotes = check_block_id_lists("remote", [rr.remote_blocks for rr in requests], MAX_BLOCK_ID)
        pending = self._pending_reads(requests, started, locals_, remotes)
        reqs = agent.engine.reserve_many([(r.request_id, r.deadline, r.local) for r in pending], Direction.READ,
                                          granted=False, caller_polls=True, on_end=agent.on_reads_done)
        agent.submitting.enter()
        try:
            return self._start_reads(pending, reqs)
        finally:
            agent.submitting.leave()
            agent.engine.submitted(reqs)  # their caller's grace starts now (``CALLER_GRACE``)

    def _start_reads(self, pending: list[PendingRead], reqs: list) -> list[TransferHandle]:
        """``reads`` once booked: start each producer's reads here or hand them to its lane."""
        agent = self._agent
        handles = []
        for read, req in zip(pending, reqs):
            read.req = req
            agent.read_remotes.add(read.request_id, read.remote, req.handle)
            handles.append(req.handle)
            if read.token is not None:  # a token of another request or other ids: fails before anything moves
                wrong = tag_error(read.request_id, read.token, read.remote_ids)
                if wrong is not None:
                    agent.engine.fail(req, wrong)
        by_peer: dict[tuple[str, int], list] = {}
        for read in pending:
            by_peer.setdefault(read.remote, []).append(read)
        flow, laned = agent.reads, False
        for remote, reads in by_peer.items():
            # A known producer's reads are routed, launched and claimed here (no peer I/O on this
            # thread) and then move on whichever thread polls them; the lane takes them where that
            # cannot be done (a new peer's handshake, several ranks, work queued on the lane before).
            ready = ready_links(agent.peers, agent.spec, remote) if agent.lanes.idle(remote) else None
            if not flow.start_here(remote, reads, ready):
                agent.lanes.put_many(remote, reads)
                laned = True
        metrics = agent.metrics
        if metrics is not None:
            for read in pending:  # after the launch: a handle already complete runs it here, at once
                # the path is known once the lane chose it: read it when the handle completes
                read.req.handle._add_callback(lambda h, req=read.req: metrics.observe("read", req.mode, h))
        if laned:
            agent.wake.set()
        # Reads started here wake no thread: their caller polls them (``wait``, ``done``,
        # ``Agent.poll``), and kvxfer's own thread finds any it does not at its next look
        # (``CALLER_GRACE``, ``kvxfer.agent.progress``); a done-callback or ``await`` hands a read
        # to that thread at once.
        return handles

    def _pending_reads(self, requests: Sequence[ReadRequest], started: float, locals_: list,
                       remotes: list) -> list[PendingRead]:
        """Check the requests' other arguments (raises at once) and make their lane items (their
        ids were checked: ``check_block_id_lists``). A step's requests share one clock reading
        and, mostly, one producer address and one timeout: those are worked out once."""
        agent = self._agent
        now = agent.clock.now()
        # The read's window starts now, before any claim is sent: the producer counts the same
        # window from its receipt of the claim, so it frees the blocks no earlier than we stop.
        deadlines: dict = {}
        addresses: dict = {}
        note_key, default = (agent.engine_id, agent.config.auth_key), agent.config.transfer_timeout
        out = []
        for rr, local, remote_ids in zip(requests, locals_, remotes):
            timeout = default if rr.timeout is None else rr.timeout
            plain = timeout is None or type(timeout) in (int, float)
            deadline = deadlines.get(timeout, _UNSET) if plain else _UNSET
            if deadline is _UNSET:
                deadline = deadline_for(timeout, now)
                if plain:
                    deadlines[timeout] = deadline
            try:
                remote = addresses[rr.remote]
            except (KeyError, TypeError):
                remote = address(rr.remote)
                with contextlib.suppress(TypeError):
                    addresses[rr.remote] = remote
            num_tokens = rr.num_tokens
            if num_tokens is not None:  # the local side's share of the rule; the remote's is known once linked
                num_tokens = check_token_count("local", local.size, agent.spec.block_size, num_tokens)
            out.append(PendingRead(None, remote, local, remote_ids, rr.request_id, deadline, timeout, note_key, started,
                                   same_format=bool(rr.same_format), num_tokens=num_tokens, token=rr.token))
        return out

    def write(self, remote, local_blocks, remote_blocks, rid: str, timeout: float | None) -> TransferHandle:
        """``Agent.write`` after its open and registration checks."""
        agent = self._agent
        request_id(rid)
        local = check_block_ids("local", local_blocks, agent.spec.num_blocks)
        remote_ids = check_block_ids("remote", remote_blocks, MAX_BLOCK_ID)
        key = address(remote)
        deadline = deadline_for(agent.config.transfer_timeout if timeout is None else timeout, agent.clock.now())
        req = agent.engine.reserve(rid, Direction.WRITE, deadline=deadline)
        note = encode_notification(rid, agent.engine_id, agent.config.auth_key)
        if agent.metrics is not None:
            req.handle._add_callback(partial(agent.metrics.observe, "write", "direct"))
        agent.lanes.put(key, PendingWrite(req, local, remote_ids, note, deadline))
        agent.wake.set()
        return req.handle

    # ---- on the lane's thread --------------------------------------------------------
    def run_lane(self, remote: tuple[str, int], items: list) -> None:
        """One producer's (or consumer's) batch, in submission order: each run of consecutive
        reads as one step, then writes and jobs as they come (a grant given back before a read
        of the same request is retried reaches the producer first)."""
        agent = self._agent
        run: list = []
        for item in [*items, None]:
            if isinstance(item, PendingRead):
                run.append(item)
                continue
            if run:
                agent.reads.run(remote, run)
                run = []
            if isinstance(item, PendingWrite):
                run_writes(agent, remote, [item])
            elif isinstance(item, LaneJob):
                item.run(agent)

    def lane_crashed(self, items: list, exc: BaseException) -> None:
        """A lane's batch raised something unexpected: fail every item of it that cannot move on
        by itself, typed (a read granted and posted completes as its transfer does)."""
        agent = self._agent
        error = exc if isinstance(exc, KvxferError) else TransferFailedError(f"internal error: {exc!r}")
        for item in items:
            if isinstance(item, LaneJob):
                item.fail(error)
            elif not isinstance(item, PendingRead) or stranded(item):
                agent.engine.fail(item.req, error)
        agent.wake.set()
