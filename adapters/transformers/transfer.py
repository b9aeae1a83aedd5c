"""The pool's kvxfer side: hold prefilled blocks for decoders, read a producer's blocks, free what the agent lets go.

Layer: adapter; kvxfer's public API only (``Agent``, errors). No model code here: the engine
passes block ids and token counts; this module owns the Agent and who owns which block.

Block ownership: a block is free (in the pool's list), *held* (prefilled, the Agent keeps it
for a decoder until ``finished()`` reports the request sent or expired), *landing* (a read's
destination until the read ends), or *quarantined* (a read failed after it was posted: kvxfer
may not be able to confirm that no byte still lands there, so the block is never reused).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from kvxfer import Agent, KvxferError, TransferError

from kvxfer_transformers.params import RemotePrefill
from kvxfer_transformers.pool import KVPool
from kvxfer_transformers.settings import ServeSettings

log = logging.getLogger("kvxfer_transformers.transfer")

#: Seconds between drains of ``Agent.finished()`` (frees held blocks a decoder is done with).
REAP_INTERVAL = 0.2


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


def read_extent(remote: RemotePrefill, prompt_len: int, peer_block: int,
                local_block: int) -> tuple[int, list[int], int]:
    """What a decode reads: (prompt tokens whose KV it uses, remote block ids, local blocks to land them in).

    At least the last prompt token is left to compute here (its logits give the first token, as
    vLLM's decoder recomputes it). kvxfer moves whole units of ``lcm`` of the two block sizes,
    so the read covers the used tokens rounded up to a unit, or down where the producer's
    blocks end first (the tokens past it are computed here).
    """
    unit = math.lcm(local_block, peer_block)
    held = min(remote.tokens_available(prompt_len), len(remote.block_ids) * peer_block)
    tokens = max(0, min(held, prompt_len - 1))
    covered = -(-tokens // unit) * unit
    if covered > len(remote.block_ids) * peer_block:
        covered = tokens // unit * unit
        tokens = covered
    return tokens, list(remote.block_ids[:covered // peer_block]), covered // local_block


class Transfers:
    """Owns the Agent over ``pool``: ``hold`` (prefill side), ``load`` (decode side), and a reaper
    thread that returns held blocks once their decoder is done or their lease ran out."""

    def __init__(self, pool: KVPool, settings: ServeSettings, name: str = "hf") -> None:
        self._pool = pool
        self._settings = settings
        self._agent = Agent(name, pool.spec, settings.agent_config())
        self._held: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.quarantined: list[int] = []
        try:
            self._agent.register(pool.tensors)
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

    # ---- producer --------------------------------------------------------------------
    def hold(self, request_id: str, blocks: list[int]) -> None:
        """Keep ``blocks`` (already filled) for a decoder; they return to the pool when it is done
        or the lease expires. On error the caller still owns the blocks."""
        with self._lock:
            self._agent.hold(request_id, blocks)
            self._held[request_id] = blocks

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL):
            self.reap()

    def reap(self) -> None:
        """Free the blocks of every held request the Agent let go (sent or expired)."""
        try:
            fin = self._agent.finished()
        except KvxferError:
            return  # closed
        with self._lock:
            for request_id in fin.freed:
                blocks = self._held.pop(request_id, None)
                if blocks is not None:
                    self._pool.free(blocks)

    # ---- consumer --------------------------------------------------------------------
    def load(self, remote: RemotePrefill, prompt_len: int, timeout: float) -> Landed:
        """Read the producer's KV for as much of the prompt as whole blocks on both sides allow,
        leaving at least the last prompt token to be computed here (its logits start decoding,
        as vLLM's decoder does).

        Raises:
            LoadFailed: the peer is gone or incompatible, the blocks are no longer held, the
                pool is full, or the transfer failed or timed out (the kvxfer error is chained).
        """
        landing: list[int] = []
        try:
            peer = self._agent.connect(remote.host, remote.port).spec
            if not self._pool.exchangeable_with(peer):
                raise IncompatibleKOrder(
                    f"the producer's cache is {peer.layout.value}/{peer.storage.value}, block {peer.block_size}; "
                    f"this pool is {self._pool.spec.layout.value}/{self._pool.spec.storage.value}, block "
                    f"{self._pool.block_size}: vLLM's CPU cache keeps K dim-major, which kvxfer cannot convert "
                    f"(run kvxfer-hf with --kv-layout vllm-cpu --block-size {peer.block_size})")
            tokens, remote_ids, local_count = read_extent(remote, prompt_len, peer.block_size, self._pool.block_size)
            if tokens == 0:
                self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
                return Landed([], 0)
            landing = self._pool.allocate(local_count, timeout=timeout)
            handle = self._agent.read((remote.host, remote.port), landing, remote_ids,
                                      remote.request_id, timeout=timeout)
        except KvxferError as exc:  # raised before anything was posted: the landing blocks are clean
            self._pool.free(landing)
            raise LoadFailed(f"load of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        try:
            stats = handle.wait(timeout)
        except KvxferError as exc:
            self._give_up(remote, landing, exc)
            raise LoadFailed(f"read of {remote.request_id} from {remote.host}:{remote.port}: {exc}") from exc
        mode = getattr(stats.mode, "value", stats.mode) or "direct"
        return Landed(landing, tokens, stats.seconds, stats.num_bytes, str(mode))

    def release_remote(self, remote: RemotePrefill) -> None:
        """Tell a producer its blocks are not wanted (this side computes the prompt itself); best effort."""
        try:
            self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
        except KvxferError as exc:
            log.warning("release of %s at %s:%d: %s", remote.request_id, remote.host, remote.port, exc)

    def _give_up(self, remote: RemotePrefill, landing: list[int], exc: KvxferError) -> None:
        """A posted read failed: tell the producer, and keep its landing blocks out of use."""
        try:
            self._agent.abort(remote.request_id, remote=(remote.host, remote.port))
        except KvxferError as abort_exc:
            log.warning("abort of %s after a failed read: %s", remote.request_id, abort_exc)
        if isinstance(exc, TransferError):
            with self._lock:
                self.quarantined.extend(landing)
            log.warning("read of %s failed (%s); %d landing blocks quarantined", remote.request_id, exc,
                        len(landing))
        else:
            self._pool.free(landing)

    def close(self) -> None:
        """Stop the reaper and close the Agent (held requests end with it); harmless twice."""
        self._stop.set()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=2)
        self._agent.close()
