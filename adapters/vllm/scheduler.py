"""Scheduler side of KvxferConnector: decides what to hold, load and release, and answers the proxy.

Runs in vLLM's engine-core process, without an Agent: it turns request events into
``StepOrders`` for the workers and writes the kv_transfer_params the prefill instance returns.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvxfer import TokenBook

from kvxfer_vllm.extent import load_blocks, tokens_to_load
from kvxfer_vllm.groups import GroupInfo, full_index, has_state, hybrid_load, kept
from kvxfer_vllm.metadata import HeartbeatOrder, LoadOrder, ReleaseOrder, StepOrders, WorkerAddress
from kvxfer_vllm.params import (
    BadParams, RemotePrefill, producer_answer, wants_remote_decode, wants_remote_prefill,
)
from kvxfer_vllm.settings import Settings

log = logging.getLogger("vllm.kvxfer_vllm.scheduler")


class KvxferScheduler:
    """Per-engine bookkeeping of P/D requests.

    Producer (``do_remote_decode``): the step that completes a prompt orders the workers to
    hold its blocks; ``request_finished`` keeps the blocks (returns True) and answers with
    the params a decoder needs, or drops the hold when the request did not end normally.
    Consumer (``do_remote_prefill``): the whole prompt is loaded asynchronously into the
    blocks the local prefix cache does not already cover; an abort cancels the load.
    Next turn (``bidirectional_kv_xfer``): a decode instance keeps the blocks of each request it
    decoded for a producer (a hold whose lease is ``decoder_kv_blocks_ttl``) and answers params
    naming them (``do_remote_decode``); a prefill instance handed such params with a request
    loads the tokens they cover (``remote_num_tokens``), computes the rest and holds its blocks
    for the next decoder as usual.

    ``groups``: a hybrid cache's transferred KV-cache groups (``kvxfer_vllm.groups``); block ids
    are then one tuple per group everywhere (holds, answers, loads), each sliding group's cut to
    the blocks it keeps, each state group's to its running state's block. None: one group, flat tuples.

    State (SSM) groups, as vLLM's NixlConnector: a prefill request stops one token short
    (``on_new_request`` drops its prompt's last token, so the state it keeps is the state before
    that token) and a decode loads ``n - 1`` prompt tokens, then computes the last one from the
    moved state. A prompt of one token is computed by the decode (nothing to back off from).
    """

    def __init__(self, settings: Settings, *, engine_id: str, tp_size: int, block_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 groups: tuple[GroupInfo, ...] | None = None) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._tp_size = tp_size
        self._block_size = block_size
        self._address: WorkerAddress | None = None
        self._kv_cache_manager: Any = None
        self._producing: dict[str, Any] = {}          # request id -> Request, prompt not yet held
        self._held: dict[str, tuple[int, ...]] = {}   # request id -> blocks the workers hold
        self._loading: set[str] = set()               # consumer requests with a load in flight
        self._orders = StepOrders()
        self._clock = clock
        self._queued: dict[str, RemotePrefill] = {}   # consumer requests waiting here, not loading yet
        self._decoded: set[str] = set()               # requests decoded here for a producer (next-turn holds)
        self._last_beat = clock()
        # issue 35: the workers' hold words mirrored here, so the answer can carry each hold's token
        # (the answer leaves from this process before a worker could tell its own)
        slots = settings.hold_words if settings.produces else 0
        self._book: TokenBook | None = TokenBook(slots) if slots else None
        self._tokens: dict[str, tuple[int, int, int]] = {}  # request id -> the token its workers hold under
        self._groups = groups
        self._state = has_state(groups)   # a state group: the one-token back-off

    # ---- wiring ----------------------------------------------------------------------
    def bind(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def set_addresses(self, addresses: dict[int, Any]) -> None:
        """The workers' side-channel addresses (vLLM collects them after KV-cache registration)."""
        head = addresses.get(0)
        if isinstance(head, WorkerAddress):
            self._address = head

    # ---- consumer --------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """A request entered the queue: one that decodes a remote prefill is heartbeated until its load
        starts; with a state group, a prefill for a remote decode drops its prompt's last token."""
        params = request.kv_transfer_params
        if self._state and self._settings.produces and wants_remote_decode(params) and not self._next_turn(params):
            _back_off(request)
        if not self._settings.consumes or not wants_remote_prefill(params):
            return
        try:
            self._queued[request.request_id] = RemotePrefill.parse(params)
        except BadParams:
            return  # reported once in after_alloc

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens to load from the producer beyond those computed locally (no side effects)."""
        params = request.kv_transfer_params
        turn = self._next_turn(params)
        if not turn and (not self._settings.consumes or not wants_remote_prefill(params)):
            return 0, False
        try:
            remote = self._parse(params)
        except BadParams:
            return 0, False  # reported once in after_alloc
        if self._groups is not None and remote.block_size not in (None, self._block_size):
            return 0, False  # a sliding group's window moves between equal blocks only: compute here
        full = remote.block_ids if self._groups is None else remote.groups[full_index(self._groups)]
        available = remote.tokens_available(request.num_prompt_tokens)
        if self._state:
            # the state is the one after the producer's tokens: a load must end exactly there, one
            # token short of the prompt (the decode computes the last one from it); else compute here
            if remote.num_tokens != request.num_prompt_tokens - 1 or num_computed_tokens >= remote.num_tokens:
                log.info("kvxfer: %s computed here: the producer's state covers %s of its %d prompt tokens (a "
                         "state load needs exactly %d)", request.request_id, remote.num_tokens,
                         request.num_prompt_tokens, request.num_prompt_tokens - 1)
                return 0, False
        count = tokens_to_load(computed=num_computed_tokens, available=available,
                               local_block=self._block_size, remote_block=remote.block_size,
                               remote_blocks=len(full),
                               partial=self._settings.buffer_device == "cpu" and self._groups is None)
        if turn and count < max(1, self._settings.recompute_threshold):
            return 0, False   # vLLM's kv_recompute_threshold: so few tokens are cheaper to compute
        return (count, True) if count > 0 else (0, False)

    def _next_turn(self, params: Any) -> bool:
        """A prefill request whose params name a decode instance's blocks of the previous turn (never
        with a state group: a decode's state after decoding is not the state before a prompt's last token)."""
        return bool(not self._state and self._settings.bidirectional and wants_remote_decode(params)
                    and params.get("remote_block_ids") and params.get("remote_request_id")
                    and not params.get("_remote_blocks_processed"))

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        turn = self._next_turn(params)
        if wants_remote_decode(params) and self._settings.produces:
            self._producing[request.request_id] = request
        if turn:
            params["_remote_blocks_processed"] = True  # one load per request, even if called again
        elif (wants_remote_decode(params) and self._settings.produces) or not wants_remote_prefill(params):
            return
        else:
            params["do_remote_prefill"] = False  # one load per request, even if called again
            if self._settings.bidirectional:
                self._decoded.add(request.request_id)
        self._queued.pop(request.request_id, None)  # the load's claim keeps the hold from here
        try:
            remote = self._parse(params)
        except BadParams as exc:
            log.warning("kvxfer: ignoring kv_transfer_params of %s: %s", request.request_id, exc)
            return
        consumes = self._settings.consumes or turn
        if not consumes:
            log.info("kvxfer: %s asks for a remote prefill but kv_role=%s; computing locally",
                     request.request_id, self._settings.role)
        if num_external_tokens <= 0 or not consumes:
            # nothing to pull (the local prefix cache had it all, or we do not consume): free the producer
            self._orders.releases.append(ReleaseOrder(remote.request_id, remote.host, remote.port))
            return
        if self._groups is not None:
            self._hybrid_load(request, blocks, num_external_tokens, remote)
            return
        every = _first_group(blocks.get_block_ids())
        fresh = _first_group(blocks.get_unhashed_block_ids_all_groups())
        computed = (len(every) - len(fresh)) * self._block_size  # tokens the local prefix cache served
        blocks = load_blocks(computed=computed, count=num_external_tokens, fresh=fresh,
                             remote_ids=remote.block_ids, local_block=self._block_size,
                             remote_block=remote.block_size)
        # a token proves a hold of exactly the ids it was given for: a load of fewer claims
        token = remote.hold_token if self._settings.use_hold_tokens \
            and tuple(blocks.remote) == tuple(remote.block_ids) else None
        self._orders.loads.append(LoadOrder(
            request.request_id, remote.request_id, remote.host, remote.port,
            blocks.local, blocks.remote, remote.tp_size, blocks.num_tokens, token))
        self._loading.add(request.request_id)

    def _parse(self, params: Any) -> RemotePrefill:
        return RemotePrefill.parse(params, 1 if self._groups is None else len(self._groups))

    def _hybrid_load(self, request: Any, blocks: Any, count: int, remote: RemotePrefill) -> None:
        """A hybrid cache's load: one list per group on both sides (``kvxfer_vllm.groups``)."""
        full = full_index(self._groups)
        every = blocks.get_block_ids()
        fresh = blocks.get_unhashed_block_ids_all_groups()
        computed = (len(every[self._groups[full].index]) - len(fresh[self._groups[full].index])) * self._block_size
        load = hybrid_load(self._groups, computed=computed, count=count, fresh=fresh, remote=remote.groups,
                           remote_tokens=request.num_prompt_tokens if remote.num_tokens is None else remote.num_tokens,
                           block_size=self._block_size)
        self._orders.loads.append(LoadOrder(
            request.request_id, remote.request_id, remote.host, remote.port,
            load.local, load.remote, remote.tp_size, load.num_tokens))
        self._loading.add(request.request_id)

    def _blocks(self, block_ids: Any) -> Any:
        """A request's blocks as held and answered: the one group's ids, or one tuple per group."""
        return _first_group(block_ids) if self._groups is None else kept(self._groups, block_ids)

    # ---- every step ------------------------------------------------------------------
    def build_orders(self, scheduler_output: Any) -> StepOrders:
        """This step's orders; holds for every producer request whose prompt completes in it."""
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._producing.items()):
            n = scheduled.get(request_id, 0)
            if n and request.num_computed_tokens + n >= request.num_prompt_tokens:
                blocks = self._blocks(self._kv_cache_manager.get_block_ids(request_id))
                self._orders.holds[request_id] = blocks
                self._held[request_id] = blocks
                self._issue_token(request_id, blocks)
                del self._producing[request_id]
        self._heartbeat()
        orders, self._orders = self._orders, StepOrders()
        return orders

    def _heartbeat(self) -> None:
        """Every ``heartbeat_interval`` (vLLM: kv_lease_duration / 6), one heartbeat per producer
        for the requests still queued here."""
        interval = self._settings.heartbeat_interval
        now = self._clock()
        if not self._queued or interval is None or now - self._last_beat < interval:
            return
        self._last_beat = now
        by_producer: dict[tuple[str, int], list[str]] = {}
        for remote in self._queued.values():
            by_producer.setdefault((remote.host, remote.port), []).append(remote.request_id)
        self._orders.heartbeats.extend(HeartbeatOrder(host, port, tuple(ids))
                                       for (host, port), ids in by_producer.items())

    def update(self, connector_output: Any) -> None:
        for request_id in connector_output.finished_recving or ():
            self._loading.discard(request_id)
        for request_id in connector_output.finished_sending or ():  # the workers' holds ended
            self._retire_token(request_id)

    def _issue_token(self, request_id: str, blocks: tuple[int, ...]) -> tuple[int, int, int] | None:
        """A token for the hold ordered this step (None: no table, every slot taken, or a hybrid
        cache's per-group lists: those reads claim)."""
        token = self._book.issue(request_id, blocks) \
            if self._book is not None and blocks and self._groups is None else None
        if token is None:
            self._tokens.pop(request_id, None)
            return None
        self._orders.tokens[request_id] = self._tokens[request_id] = token.wire()
        return token.wire()

    def _retire_token(self, request_id: str) -> None:
        if self._book is not None:
            self._book.retire(request_id)
        self._tokens.pop(request_id, None)

    # ---- end of a request ------------------------------------------------------------
    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) and answer with kv_transfer_params, or let vLLM free them."""
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        params = request.kv_transfer_params
        self._producing.pop(request_id, None)
        self._queued.pop(request_id, None)
        if wants_remote_prefill(params):
            # aborted before it was ever scheduled: the producer still holds the blocks
            params["do_remote_prefill"] = False
            try:
                remote = RemotePrefill.parse(params)
                self._orders.releases.append(ReleaseOrder(remote.request_id, remote.host, remote.port))
            except BadParams:
                pass
            return False, None
        if request_id in self._loading:
            self._orders.cancels.add(request_id)  # vLLM keeps its blocks until we report the load
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if request_id in self._decoded:
            self._decoded.discard(request_id)
            return self._keep_for_next_turn(request, block_ids) if normal else (False, None)
        held = self._held.pop(request_id, None)
        if held is None:
            return False, None
        final = self._blocks(block_ids)
        if not normal or not final or (self._groups is not None and not any(final)):
            self._orders.dropped.add(request_id)
            self._retire_token(request_id)
            return False, None
        token = self._tokens.get(request_id)
        if final != held:
            self._orders.holds[request_id] = final   # decoded past the prompt: hold every block
            # the new hold gets a new token, but it is made in the next step, after this answer
            # left: a read by it could come first and fail, so the answer carries none (it claims)
            self._issue_token(request_id, final)
            token = None
        if self._address is None:  # vLLM did not hand us the workers' address: nobody can pull
            log.error("kvxfer: no side-channel address from the workers; %s is not kept for a decoder",
                      request_id)
            self._orders.dropped.add(request_id)
            self._retire_token(request_id)
            return False, None
        self._orders.kept.add(request_id)
        return True, producer_answer(
            request_id=request_id, block_ids=final, engine_id=self._address.engine_id,
            host=self._address.host, port=self._address.port, tp_size=self._tp_size,
            num_tokens=request.num_computed_tokens, block_size=self._block_size, hold_token=token)


    def _keep_for_next_turn(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """bidirectional_kv_xfer, decode side: hold a decoded request's blocks for
        ``decoder_kv_blocks_ttl`` seconds and answer params a prefill instance reads them with."""
        final = self._blocks(block_ids)
        if not final or self._address is None:
            return False, None
        request_id = request.request_id
        self._orders.holds[request_id] = final
        self._orders.hold_leases[request_id] = self._settings.decoder_ttl
        self._orders.kept.add(request_id)
        answer = producer_answer(
            request_id=request_id, block_ids=final, engine_id=self._address.engine_id,
            host=self._address.host, port=self._address.port, tp_size=self._tp_size,
            num_tokens=request.num_computed_tokens, block_size=self._block_size)
        # vLLM's form of a decode instance's answer; its expiry is the hold's lease here
        answer.update(do_remote_prefill=False, do_remote_decode=True, remote_blocks_expiry_time=None)
        return True, answer


def _back_off(request: Any) -> None:
    """Drop a prefill request's last prompt token, once, so it computes ``n - 1`` tokens and keeps
    the state before the last one; the decode recomputes that token (vLLM 0.32's NixlConnector
    does the same for Mamba groups). Left alone: a prompt of one token, a request that does not
    read the prefix cache (the decode computes its whole prompt), and a request already cut
    (a preempted one seen again)."""
    params = request.kv_transfer_params
    if params.get("_p_side_truncated") or request.num_prompt_tokens <= 1:
        return
    skip = getattr(request, "get_skip_reading_prefix_cache", None)
    if skip is not None and skip():
        return
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-1:]
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:
        return
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params["_p_side_truncated"] = True   # vLLM's own mark (the same key): never cut twice


def _first_group(block_ids: Any) -> tuple[int, ...]:
    """Block ids of the (only) KV-cache group: vLLM passes a flat list to connectors without
    hybrid-allocator support and one list per group elsewhere."""
    if not block_ids:
        return ()
    if isinstance(block_ids[0], (list, tuple)):
        return tuple(block_ids[0])
    return tuple(block_ids)
