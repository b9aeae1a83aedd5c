"""The pool's kvxfer side: hold prefilled blocks for decoders, read a producer's blocks, free what the agent lets go.

Layer: adapter; kvxfer's public API only (``Agent``, errors). No model code here: the engine
passes block ids and token counts; this module owns the Agent and who owns which block.

Block ownership: a block is free (in the pool's list), *held* (prefilled, the Agent keeps it
for a decoder until ``finished()`` lists the request in ``freed``), *landing* (a read's
destination until the read ends), or *quarantined* (a read failed and kvxfer could not confirm
that its transfer ended, ``error.quarantined_blocks``: bytes may still land there). A
quarantined block returns to the pool only once ``finished().reclaimed`` lists its request;
the landing blocks of a read that failed and did end return at once.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from kvxfer import Agent, HoldToken, KvxferError, ReadRequest, RequestState, WaitTimeout

from kvxfer_transformers.groups import answer_ids, read_ids
from kvxfer_transformers.params import RemotePrefill
from kvxfer_transformers.pool import KVPool
from kvxfer_transformers.settings import ServeSettings

log = logging.getLogger("kvxfer_transformers.transfer")

#: Seconds between drains of ``Agent.finished()`` (frees held blocks a decoder is done with, and
#: quarantined blocks kvxfer reclaimed).
REAP_INTERVAL = 0.2

#: Seconds a load whose wait ran out gives its aborted read to end (kvxfer fails it within its
#: drain grace, 0.25 s, past its deadline) before its landing blocks count as quarantined.
ABORT_SETTLE = 2.0


class IncompatibleKOrder(KvxferError):
    """The peer keeps K in an order kvxfer's translator cannot convert to this pool's (nothing was read)."""


class LoadFailed(KvxferError):
    """A decode could not get the producer's KV (the cause is chained); the failure policy decides."""


@dataclass(frozen=True)
class Landed:
    """A read's result: local blocks holding the first ``tokens`` prompt tokens' KV (caller frees them)."""

    blocks: list[int]
    tokens: int
    seconds: float = 0.0
    num_bytes: int = 0
    mode: str = ""
    slot: int | None = None   # a state pool's slot holding the state after ``tokens`` tokens (caller frees it)


def read_extent(remote: RemotePrefill, prompt_len: int, peer_block: int,
                local_block: int, partial: bool = True) -> tuple[int, list[int], int]:
    """What a decode reads: (prompt tokens whose KV it uses, remote block ids, local blocks to land them in).

    At least the last prompt token is left to compute here (its logits give the first token, as
    vLLM's decoder recomputes it). Every other token the producer holds is read, each side's
    last block possibly partial: ``ceil(tokens / block size)`` blocks a side (``Transfers.load``
    names the token count to kvxfer where the two lists cover different tokens).

    ``partial=False`` (a pool on a GPU, where such partial reads need plain byte ranges): whole
    units of ``lcm`` of the two block sizes only, the used tokens rounded up to a unit, or down
    where the producer's blocks end first (the tokens past it are computed here).
    """
    held = min(remote.tokens_available(prompt_len), len(remote.block_ids) * peer_block)
    tokens = max(0, min(held, prompt_len - 1))
    if partial:
        return tokens, list(remote.block_ids[:-(-tokens // peer_block)]), -(-tokens // local_block)
    unit = math.lcm(local_block, peer_block)
    covered = -(-tokens // unit) * unit
    if covered > len(remote.block_ids) * peer_block:
        covered = tokens // unit * unit
        tokens = covered
    return tokens, list(remote.block_ids[:covered // peer_block]), covered // local_block


class Transfers:
    """Owns the Agent over ``pool``: ``hold`` (prefill side), ``load`` (decode side), and a reaper
    thread that returns held blocks once their decoder is done or their lease ran out, and
    quarantined blocks once kvxfer reclaimed them.

    ``agent``: the Agent to use, not yet registered (default: one built from ``settings``; tests
    pass one over ``kvxfer.testing.FakeBackend``). Transfers registers the pool on it, listens,
    and closes it.
    """

    def __init__(self, pool: KVPool, settings: ServeSettings, name: str = "hf", *,
                 agent: Agent | None = None) -> None:
        self._pool = pool
        self._settings = settings
        self._agent = agent if agent is not None else Agent(name, pool.cache_spec, settings.agent_config())
        self._held: dict[str, list[int]] = {}
        self._slots: dict[str, list[int]] = {}        # request id -> its state slots (held, a hybrid pool with state)
        self._quarantined: dict[str, list[int]] = {}  # request id -> its landing blocks kvxfer quarantined
        self._quarantined_slots: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        try:
            self._agent.register(pool.agent_tensors())
            self.address = self._agent.listen()
        except BaseException:
            self._agent.close()
            raise
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvxfer-hf-reaper", daemon=True)
        self._reaper.start()

    @property
    def engine_id(self) -> str:
        return self._agent.engine_id

    @property
    def held_requests(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def quarantined(self) -> list[int]:
        """Landing blocks out of the pool until kvxfer reclaims them (``finished().reclaimed``)."""
        with self._lock:
            return [b for blocks in self._quarantined.values() for b in blocks]

    # ---- producer --------------------------------------------------------------------
    def hold_token(self, request_id: str) -> list[int] | None:
        """The held request's token as it travels (``remote_hold_token``), or None (issue 35)."""
        token = self._agent.hold_token(request_id)
        return token.wire() if token is not None else None

    def hold_ids(self, blocks: list[int], slot: int | None = None) -> list[int] | list[list[int]]:
        """What a prefilled request holds and answers: ``blocks``, or for a hybrid pool one list
        per group (a sliding group's cut to its window's blocks plus one, a state group's ``[slot]``)."""
        if self._pool.groups is None:
            return blocks
        return answer_ids(self._pool.groups, blocks, self._pool.block_size, slot)

    def hold(self, request_id: str, blocks: list[int], slot: int | None = None) -> None:
        """Keep ``blocks`` (and a state pool's ``slot``, already filled) for a decoder; they return
        to the pool when it is done or the lease expires. On error the caller still owns them. A
        hybrid pool holds ``hold_ids(blocks, slot)`` and frees all of ``blocks`` when the hold ends."""
        with self._lock:
            self._agent.hold(request_id, self.hold_ids(blocks, slot))
            self._held[request_id] = blocks
            if slot is not None:
                self._slots[request_id] = [slot]

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL):
            self.reap()

    def reap(self) -> None:
        """Free the blocks of every held request the Agent let go (sent, aborted or expired) and
        the quarantined landing blocks of every failed read it reclaimed."""
        try:
            fin = self._agent.finished()
        except KvxferError:
            return  # closed
        with self._lock:
            for request_id in fin.freed:
                blocks = self._held.pop(request_id, None)
                if blocks is not None:
                    self._pool.free(blocks, self._slots.pop(request_id, ()))
            for request_id in fin.reclaimed:
                blocks = self._quarantined.pop(request_id, None)
                if blocks is not None:
                    log.info("read of %s: %d quarantined landing blocks reclaimed", request_id, len(blocks))
                    self._pool.free(blocks, self._quarantined_slots.pop(request_id, ()))

    # ---- consumer --------------------------------------------------------------------
    def load(self, remote: RemotePrefill, prompt_len: int, timeout: float) -> Landed:
        """Read the producer's KV for every prompt token it holds (partial last blocks included),
        leaving at least the last prompt token to be computed here (its logits start decoding,
        as vLLM's decoder does).

        Raises:
            LoadFailed: the peer is gone or incompatible, the blocks are no longer held, the
                pool is full, or the transfer failed or timed out (the kvxfer error is chained).
        """
        if self._pool.groups is not None:
            return self._load_groups(remote, prompt_len, timeout)
        landing: list[int] = []
        try:
            peer = self._agent.connect(remote.host, remote.port).spec
            if not self._pool.exchangeable_with(peer):
                raise IncompatibleKOrder(
                    f"the producer's cache is {peer.layout.value}/{peer.storage.value}, block {peer.block_size}; "
                    f"this pool is {self._pool.spec.layout.value}/{self._pool.spec.storage.value}, block "
                    f"{self._pool.block_size}: the producer does not say how it orders K inside a block (vLLM's "
                    f"AMX CPU kernel tiles it), so only a pool in the same format can read it (run kvxfer-hf with "
                    f"--kv-layout vllm-cpu --block-size {peer.block_size}, and the same kernel on both sides)")
            on_cpu = self._pool.tensors[0].device.type == "cpu"
            tokens, remote_ids, local_count = read_extent(remote, prompt_len, peer.block_size, self._pool.block_size,
                                                          partial=on_cpu)
            if tokens == 0:
                self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
                return Landed([], 0)
            landing = self._pool.allocate(local_count, timeout=timeout)
            partial = local_count * self._pool.block_size != len(remote_ids) * peer.block_size
            # The token proves a hold of exactly the ids it was given for: a shorter read claims.
            token = HoldToken(*remote.hold_token) if remote.hold_token is not None \
                and list(remote_ids) == list(remote.block_ids) else None
            handle = self._agent.read_many([ReadRequest((remote.host, remote.port), landing, remote_ids,
                                                        remote.request_id, timeout,
                                                        num_tokens=tokens if partial else None, token=token)])[0]
        except KvxferError as exc:  # raised before anything was posted: the landing blocks are clean
            self._pool.free(landing)
            raise LoadFailed(f"load of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        try:
            stats = handle.wait(timeout)
        except KvxferError as exc:
            self._give_up(remote, landing, handle)
            raise LoadFailed(f"read of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        mode = getattr(stats.mode, "value", stats.mode) or "direct"
        return Landed(landing, tokens, stats.seconds, stats.num_bytes, str(mode))

    def _load_groups(self, remote: RemotePrefill, prompt_len: int, timeout: float) -> Landed:
        """``load`` for a hybrid pool: one read of every group (one list each), blocks of this
        pool's size on both sides; a sliding group moves only the window of the loaded tokens."""
        bs = self._pool.block_size
        landing: list[int] = []
        slots: list[int] = []
        try:
            if remote.block_size not in (None, bs):
                raise LoadFailed(f"the producer's blocks hold {remote.block_size} tokens; a hybrid cache moves "
                                 f"between blocks of one size and this pool's hold {bs} (--block-size "
                                 f"{remote.block_size})")
            full = next(i for i, g in enumerate(self._pool.groups) if g.kind == "full")
            held = min(remote.tokens_available(prompt_len), len(remote.groups[full]) * bs)
            tokens = max(0, min(held, prompt_len - 1))
            if tokens == 0:
                self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
                return Landed([], 0)
            if self._pool.state_groups and tokens != prompt_len - 1:
                raise LoadFailed(f"the producer's state covers {remote.tokens_available(prompt_len) - 1} tokens; "
                                 f"a decode of this {prompt_len}-token prompt needs the state after {prompt_len - 1}")
            landing = self._pool.allocate(-(-tokens // bs), timeout=timeout)
            if self._pool.state_groups:
                slots = self._pool.allocate_slots(1, timeout=timeout)
            local_ids, remote_ids = read_ids(self._pool.groups, remote.groups, remote.tokens_available(prompt_len),
                                             landing, tokens, bs, slots[0] if slots else None)
            # no hold token: it proves a hold of the ids as held, and the window cut reads fewer (claims)
            handle = self._agent.read_many([ReadRequest((remote.host, remote.port), local_ids, remote_ids,
                                                        remote.request_id, timeout, num_tokens=tokens)])[0]
        except KvxferError as exc:
            self._pool.free(landing, slots)
            raise LoadFailed(f"load of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        try:
            stats = handle.wait(timeout)
        except KvxferError as exc:
            self._give_up(remote, landing, handle, slots)
            raise LoadFailed(f"read of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        mode = getattr(stats.mode, "value", stats.mode) or "direct"
        return Landed(landing, tokens, stats.seconds, stats.num_bytes, str(mode), slots[0] if slots else None)

    def release_remote(self, remote: RemotePrefill) -> None:
        """Tell a producer its blocks are not wanted (this side computes the prompt itself); best effort."""
        try:
            self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
        except KvxferError as exc:
            log.warning("release of %s at %s:%d: %s", remote.request_id, remote.host, remote.port, exc)

    def _give_up(self, remote: RemotePrefill, landing: list[int], handle, slots: list[int] | None = None) -> None:
        """A posted read failed, or its wait ran out: tell the producer, then return the landing
        blocks (and state ``slots``) to the pool, except those kvxfer quarantined (kept out until
        reclaimed; a hybrid pool keeps all of them out, as its quarantine names the carrier's ids)."""
        slots = list(slots or ())
        try:
            self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
        except KvxferError as abort_exc:
            log.warning("abort of %s after a failed read: %s", remote.request_id, abort_exc)
        try:
            handle.wait(ABORT_SETTLE)  # the abort cancelled the read: it ends within its drain grace
        except WaitTimeout:
            log.warning("read of %s: not ended %.1f s after its abort; its %d landing blocks stay out",
                        remote.request_id, ABORT_SETTLE, len(landing))
            self._keep_out(remote.request_id, landing, slots)
            return
        except KvxferError:
            pass  # the read's own failure: what its error says about the blocks decides below
        error = handle.exception()
        quarantined = set(getattr(error, "quarantined_blocks", None) or ())
        if quarantined and self._pool.groups is not None:
            quarantined = set(landing)
        self._pool.free([b for b in landing if b not in quarantined], () if quarantined else slots)
        if quarantined:
            log.warning("read of %s failed (%s); %d landing blocks quarantined until kvxfer reclaims them",
                        remote.request_id, error, len(quarantined))
            self._keep_out(remote.request_id, [b for b in landing if b in quarantined], slots)

    def _keep_out(self, request_id: str, blocks: list[int], slots: list[int] | None = None) -> None:
        """Keep quarantined ``blocks`` (and ``slots``) out of the pool until ``reap`` sees
        ``request_id`` reclaimed. The reaper may have drained that report already: ``status`` still says so."""
        with self._lock:
            if self._agent.status(request_id) is RequestState.RECLAIMED:
                self._pool.free(blocks, slots or ())
                return
            self._quarantined[request_id] = list(blocks)
            if slots:
                self._quarantined_slots[request_id] = list(slots)

    def close(self) -> None:
        """Stop the reaper and close the Agent (held requests end with it); harmless twice."""
        self._stop.set()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=2)
        self._agent.close()
