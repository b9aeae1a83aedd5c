"""kvxfer as SGLang's disaggregation transfer backend: manager, sender, receiver, bootstrap server
(layer: adapter; SGLang and kvxfer's public API only).

SGLang's model, mapped onto kvxfer's consumer-first push:

- The bootstrap server and rank discovery are SGLang's own (``CommonKVBootstrapServer``): each
  prefill rank registers its kvxfer side-channel address there as its ``rank_port``.
- Decode reserves pages, then ``send_metadata`` is ``Agent.announce`` to each prefill rank it
  depends on (its pages; the payload says how many decode ranks the prefill rank waits for).
- Prefill polls its sender: once every expected decode rank announced, the request is
  ``WaitingForInput``; each ``send`` (one per prefill chunk) is one ``WriteStream.write``; the last
  chunk finishes the stream with the request's metadata row as the aux payload.
- Both sides map kvxfer's per-request state (``Agent.status``, non-draining) onto ``KVPoll`` at
  every poll; decode copies the aux row into its metadata buffers before it reports Success.
- Failures are typed kvxfer errors, recorded as the room's failure reason; aborts travel as
  kvxfer ``Abort`` (decode -> prefill) or a ``WritesDone`` naming the reason (prefill -> decode);
  a dead prefill is caught by SGLang's heartbeat to its bootstrap server.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer, CommonKVManager, CommonKVReceiver, CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvxfer import Agent, AgentConfig, KvxferError, LayoutError, RequestState, TransferFailedError
from kvxfer_sglang.layout import (
    AnnouncePayload, AuxRows, DeviceBuffer, HostBuffer, decode_payload, describe_cache, encode_payload,
)
from kvxfer_sglang.settings import Settings

log = logging.getLogger("kvxfer.sglang")

__all__ = ["KvxferKVBootstrapServer", "KvxferKVManager", "KvxferKVReceiver", "KvxferKVSender"]


def _rid(room: int) -> str:
    return f"sglang-room-{int(room)}"


class KvxferKVManager(CommonKVManager):
    """One SGLang rank's kvxfer agent, and the room bookkeeping both roles need."""

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args,
                 is_mla_backend: Optional[bool] = False):
        self._agent: Agent | None = None
        self._agent_lock = threading.Lock()
        self._settings = Settings.from_env(server_args)
        self._pushes: dict[int, list] = {}        # prefill: room -> [(announcement, payload, stream)]
        self._aux_index: dict[int, int] = {}      # decode: room -> its metadata row
        self._errors: dict[str, KvxferError] = {}  # decode: failed requests drained from finished()
        self._aux = AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._ensure_agent()
        if disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()

    # ---- the agent ------------------------------------------------------------------
    def _ensure_agent(self) -> Agent:
        with self._agent_lock:
            if self._agent is None:
                self._agent = self._make_agent()
            return self._agent

    def _make_agent(self) -> Agent:
        args, s = self.kv_args, self._settings
        cache = describe_cache(
            kv_data_ptrs=args.kv_data_ptrs, kv_data_lens=args.kv_data_lens, kv_item_lens=args.kv_item_lens,
            page_size=args.page_size, kv_head_num=getattr(args, "kv_head_num", None),
            total_kv_head_num=getattr(args, "total_kv_head_num", None),
            is_mla=bool(self.is_mla_backend), tp_rank=self.attn_tp_rank, tp_size=self.attn_tp_size,
            kv_dtype=str(self.kv_cache_dtype_str), model=s.model,
            num_draft_entries=getattr(args, "num_draft_entries", 0))
        if s.pp_size > 1:
            raise LayoutError(f"pipeline parallelism (pp_size {s.pp_size}) is not supported by the kvxfer backend")
        dp_index = self.system_dp_rank * self.attn_dp_size + self.attn_dp_rank
        config = AgentConfig.from_env(side_channel_host=self.local_ip,
                                      side_channel_port=s.base_port + dp_index * cache.spec.tp_size,
                                      transfer_timeout=s.transfer_timeout)
        mode = "prefill" if self.disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        agent = Agent(f"sglang-{mode}-dp{dp_index}-tp{self.attn_tp_rank}", cache.spec, config)
        try:
            wrap = DeviceBuffer if s.device_memory else HostBuffer
            tensors = [tuple(wrap(p, cache.layer_bytes) for p in layer) for layer in cache.layers]
            agent.register(tensors if not self.is_mla_backend else [t[0] for t in tensors])
            agent.listen()
        except BaseException:
            agent.close()
            raise
        log.info("kvxfer %s rank: %s listening on %s:%d (%s)", mode, agent.engine_id, *agent.address, cache.spec)
        return agent

    @property
    def agent(self) -> Agent:
        return self._ensure_agent()

    def register_to_bootstrap(self):
        """Publish this prefill rank's kvxfer side channel as its ``rank_port`` (the decode's
        receiver reaches it from the bootstrap server's route table)."""
        _, self.rank_port = self._ensure_agent().address  # rank_ip is local_ip, where the agent listens
        super().register_to_bootstrap()

    def register_buffer_to_engine(self):  # SGLang calls these around role switches and pool resizes
        pass

    def deregister_buffer_to_engine(self):
        pass

    def teardown(self) -> None:
        if self._agent is not None:
            self._agent.close()

    # ---- prefill ----------------------------------------------------------------------
    def advance_sender(self, room: int) -> None:
        """Move a prefill room on from kvxfer's state: announcements in, streams done."""
        status = self.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            return
        agent, rid = self.agent, _rid(room)
        if agent.status(rid) is RequestState.ABORTED:
            self._fail(room, "kvxfer: the decode aborted the request")
            return
        if status == KVPoll.Bootstrapping and room not in self._pushes:
            announced = agent.announced(rid)
            if not announced:
                return
            try:
                payloads = [decode_payload(a.payload) for a in announced]
            except LayoutError as exc:
                self._fail(room, f"kvxfer: {exc}")
                return
            if len(announced) < payloads[0].required_dst_info_num:
                return
            self._check_aux(room, payloads[0])
            self._pushes[room] = [(a, p, agent.open_writes(a.remote, rid)) for a, p in zip(announced, payloads)]
            self.update_status(room, KVPoll.WaitingForInput)
            return
        pushes = self._pushes.get(room)
        if status == KVPoll.Transferring and pushes and all(stream.done() for _, _, stream in pushes):
            errors = [stream.exception() for _, _, stream in pushes if stream.exception() is not None]
            if errors:
                self._fail(room, f"kvxfer: {type(errors[0]).__name__}: {errors[0]}")
            else:
                self.update_status(room, KVPoll.Success)

    def _check_aux(self, room: int, payload: AnnouncePayload) -> None:
        if payload.aux_lens and payload.aux_lens != self._aux.item_lens:
            self._fail(room, f"kvxfer: metadata buffers differ: prefill rows of {self._aux.item_lens} bytes, "
                             f"decode rows of {payload.aux_lens} bytes (enable the same optional metadata on both)")

    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice: slice, is_last: bool,
                             aux_index: Optional[int] = None, state_indices=None, **_ignored):
        """One prefill chunk (``CommonKVSender.send``): write it to every announced decode rank."""
        room = bootstrap_room
        if self.request_status.get(room) == KVPoll.Failed:
            return
        pushes = self._pushes.get(room)
        if pushes is None:
            self._fail(room, "kvxfer: a KV chunk came before the decode announced its pages")
            return
        if state_indices is not None and any(x is not None and len(x) for x in state_indices):
            self._fail(room, "kvxfer: hybrid model state (mamba, SWA, DSA) is not supported by the kvxfer backend")
            return
        drop = self._settings.drop_kv
        try:
            for ann, payload, stream in pushes:
                if len(kv_indices) and not payload.is_dummy and not drop:
                    dst = ann.block_ids[index_slice]
                    if len(dst) != len(kv_indices):
                        raise LayoutError(f"room {room}: prefill chunk of {len(kv_indices)} pages "
                                          f"(pages {index_slice.start}..{index_slice.stop}) but the decode "
                                          f"announced {len(ann.block_ids)} pages")
                    stream.write(kv_indices, dst)
                if is_last:
                    stream.finish(self._aux.read(aux_index) if aux_index is not None else b"")
        except KvxferError as exc:
            self._fail(room, f"kvxfer: {type(exc).__name__}: {exc}")
            return
        self.update_status(room, KVPoll.Transferring)

    def _fail(self, room: int, reason: str) -> None:
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        for _, _, stream in self._pushes.get(room, ()):
            stream.abort(TransferFailedError(reason))

    def forget_sender(self, room: int) -> None:
        pushes = self._pushes.pop(room, None)
        if pushes and self._agent is not None:
            self._agent.forget_announced(_rid(room))

    # ---- decode -----------------------------------------------------------------------
    def announce(self, room: int, bootstrap_infos: list, kv_indices, aux_index: Optional[int],
                 required_dst_info_num: int) -> None:
        agent, rid = self.agent, _rid(room)
        if aux_index is not None:
            self._aux_index[room] = int(aux_index)
        for info in bootstrap_infos:
            payload = AnnouncePayload(int(required_dst_info_num), bool(info.get("is_dummy", False)),
                                      list(self._aux.item_lens))
            agent.announce((info["rank_ip"], int(info["rank_port"])), rid, kv_indices,
                           payload=encode_payload(payload), producers=len(bootstrap_infos),
                           timeout=self._settings.transfer_timeout)

    def advance_receiver(self, room: int) -> None:
        """Move a decode room on from kvxfer's state: received (aux row copied) or failed."""
        if self.request_status.get(room) in (None, KVPoll.Success, KVPoll.Failed):
            return
        agent, rid = self.agent, _rid(room)
        state = agent.status(rid)
        if state is RequestState.RECEIVED:
            aux = agent.take_aux(rid)
            index = self._aux_index.get(room)
            try:
                if index is not None:
                    if not aux:
                        raise LayoutError(f"room {room}: the prefill sent no metadata row")
                    self._aux.write(index, next(iter(aux.values())))
            except LayoutError as exc:
                self.record_failure(room, f"kvxfer: {exc}")
                self.update_status(room, KVPoll.Failed)
                return
            self.update_status(room, KVPoll.Success)
        elif state in (RequestState.FAILED, RequestState.QUARANTINED):
            error = self._take_error(rid)
            self.record_failure(room, f"kvxfer: {type(error).__name__}: {error}" if error else "kvxfer: failed")
            self.update_status(room, KVPoll.Failed)

    def _take_error(self, rid: str) -> KvxferError | None:
        self._errors.update(self.agent.finished().failed)  # this manager is the agent's one reader
        return self._errors.pop(rid, None)

    def abort_announce(self, room: int, bootstrap_infos: list) -> None:
        for info in bootstrap_infos or ():
            self.agent.abort(_rid(room), remote=(info["rank_ip"], int(info["rank_port"])), wait=False)

    def forget_receiver(self, room: int) -> None:
        self._aux_index.pop(room, None)
        self._errors.pop(_rid(room), None)


class KvxferKVSender(CommonKVSender):
    """Prefill side of one request: SGLang's bookkeeping, kvxfer's state."""

    def poll(self) -> KVPoll:
        if self.conclude_state is None:
            self.kv_mgr.advance_sender(self.bootstrap_room)
        return super().poll()

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_sender(self.bootstrap_room)

    def abort(self):
        super().abort()
        self.kv_mgr._fail(self.bootstrap_room, "Aborted by AbortReq (prefill)")


class KvxferKVReceiver(CommonKVReceiver):
    """Decode side of one request: ``send_metadata`` announces, ``poll`` reads kvxfer's state."""

    def _register_kv_args(self) -> bool:
        # The kvxfer handshake carries each rank's cache layout; nothing to register beforehand.
        return self.bootstrap_infos is not None

    def init(self, prefill_dp_rank: int):
        super().init(prefill_dp_rank)
        info = getattr(self, "prefill_info", None)
        if self.conclude_state is None and info is not None and info.attn_tp_size != self.kv_mgr.attn_tp_size \
                and not self.kv_mgr.is_mla_backend:
            self.kv_mgr.record_failure(
                self.bootstrap_room, f"kvxfer backend: prefill attention TP {info.attn_tp_size} and decode attention "
                f"TP {self.kv_mgr.attn_tp_size} differ; this backend needs them equal (MHA)")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices=None,
                      decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices=None):
        room = self.bootstrap_room
        reason = None
        if self.bootstrap_infos is None:
            reason = f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}"
        elif destination != KVTransferDestination.DEVICE:
            reason = "kvxfer backend: host KV destinations are not supported"
        elif state_indices is not None and any(x is not None and len(x) for x in state_indices):
            reason = "kvxfer backend: hybrid model state (mamba, SWA, DSA) is not supported"
        elif decode_prefix_len:
            reason = f"kvxfer backend: a decode-side prefix ({decode_prefix_len} tokens) is not supported"
        if reason is not None:
            self.kv_mgr.record_failure(room, reason)
            self.kv_mgr.update_status(room, KVPoll.Failed)
            return
        try:
            self.kv_mgr.announce(room, self.bootstrap_infos, kv_indices, aux_index, self.required_dst_info_num)
        except KvxferError as exc:
            self.kv_mgr.record_failure(room, f"kvxfer: {type(exc).__name__}: {exc}")
            self.kv_mgr.update_status(room, KVPoll.Failed)
            return
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.conclude_state is None:
            self.kv_mgr.advance_receiver(self.bootstrap_room)
        return super().poll()

    def _send_abort_notification(self, *, force_arm: bool = False):
        self.kv_mgr.abort_announce(self.bootstrap_room, self.bootstrap_infos)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_receiver(self.bootstrap_room)


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap registry: prefill ranks register their kvxfer addresses there."""

