"""Greedy generation with a transformers causal LM, locally or across a P/D pair through the KV pool.

Layer: adapter; imports torch, transformers and this package (kvxfer only through ``transfer``).
One lock serialises every forward pass, so concurrent HTTP requests are safe; reads from a
producer run outside it. The three entry points mirror what vLLM does for the same request:

* ``generate``: a plain request, the whole generation here.
* ``prefill``: ``do_remote_decode``: compute the prompt, copy every prompt token's K/V into
  pool blocks, hold them for a decoder, answer vLLM-shaped ``kv_transfer_params``, and (like
  vLLM's prefill instance) still return the requested tokens. A model with state layers holds
  all prompt tokens but the last and answers so (``remote_num_tokens`` ``n - 1``, as vLLM's
  prefill does: a vLLM decode loads a state only when it covers exactly ``n - 1`` tokens).
* ``decode``: ``do_remote_prefill``: read the producer's blocks, rebuild a ``DynamicCache`` of
  all prompt tokens but the last, run the last one here (its logits give the first token, as
  vLLM's decoder recomputes the last prompt token), then decode greedily.

Hybrid models (``kvxfer_transformers.groups``): sliding-window layers move their window only;
a model with SSM / linear-attention layers keeps each request's state in a slot, so its prefill
computes all prompt tokens but the last, stores their K/V and the state after them, then
computes the last one (the state a decoder needs is the one before the token it recomputes).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvxfer_transformers.params import RemotePrefill, producer_answer
from kvxfer_transformers.pool import KVPool, ModelShape
from kvxfer_transformers.caches import (
    check_state_round_trip, layer_states, probe_state, record_sliding, set_layer_states, trim_sliding,
)
from kvxfer_transformers.settings import ServeSettings
from kvxfer_transformers.state import StateSlots
from kvxfer_transformers.transfer import LoadFailed, Transfers

log = logging.getLogger("kvxfer_transformers.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: State slots of a model with SSM / linear-attention layers: requests whose state the instance
#: holds at once (prefilled and not yet read by their decoder, plus loads landing).
STATE_SLOTS = 32


@dataclass(frozen=True)
class Generation:
    """One request's outcome: generated ids, why it stopped, and the params to return (prefill only)."""

    token_ids: list[int]
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None = None
    loaded_tokens: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


def load_model(model_dir: str, dtype: str, device: str) -> Any:
    """The causal LM at ``model_dir`` in ``dtype`` on ``device``, in eval mode (sdpa attention)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    return model.to(device).eval()


class HFEngine:
    """A loaded model, its KV pool and (when transfers are configured) the Agent over it."""

    def __init__(self, model: Any, pool: KVPool, settings: ServeSettings, transfers: Transfers | None = None,
                 max_model_len: int | None = None) -> None:
        self.model = model
        text = model.config.get_text_config(decoder=True)
        self.vocab_size = int(text.vocab_size)
        self.max_model_len = int(max_model_len or getattr(text, "max_position_embeddings", 2048))
        self.pool = pool
        self.settings = settings
        self.transfers = transfers
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self._eos = set([eos] if isinstance(eos, int) else (eos or []))

    @classmethod
    def start(cls, model_dir: str, *, settings: ServeSettings, dtype: str = "float32", device: str = "cpu",
              block_size: int = 16, num_blocks: int = 1024, kv_model: str | None = None,
              max_model_len: int | None = None, kv_layout: str = "nhd") -> "HFEngine":
        """Load the model, build its pool (``kv_layout``: ``nhd`` or ``vllm-cpu``, see ``KVPool``), and
        (when ``settings.enabled``) register it and listen."""
        model = load_model(model_dir, dtype, device)
        shape = ModelShape.from_config(model.config)
        state_layers = [i for g in shape.groups or () if g.kind == "state" for i in g.layers]
        if state_layers:
            check_state_round_trip(model)
        state = StateSlots(len(state_layers), probe_state(model), num_slots=STATE_SLOTS, device=device) \
            if state_layers else None
        pool = KVPool(shape, num_blocks=num_blocks, block_size=block_size,
                      dtype=DTYPES[dtype], device=device, model=kv_model if kv_model is not None else model_dir,
                      fmt=kv_layout, state=state)
        transfers = Transfers(pool, settings) if settings.enabled else None
        return cls(model, pool, settings, transfers, max_model_len)

    # ---- model steps (callers hold the lock) -----------------------------------------
    def _forward(self, ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        with torch.inference_mode():
            x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            return self.model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]

    def _greedy(self, logits: torch.Tensor, cache: DynamicCache, max_tokens: int,
                ignore_eos: bool) -> tuple[list[int], str]:
        out: list[int] = []
        while True:
            token = int(torch.argmax(logits))
            out.append(token)
            if token in self._eos and not ignore_eos:
                return out, "stop"
            if len(out) >= max_tokens:
                return out, "length"
            logits = self._forward([token], cache)

    def _fresh_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    # ---- entry points ----------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool = True) -> Generation:
        """The whole generation here (no KV transfer)."""
        with self._lock:
            cache = self._fresh_cache()
            ids, reason = self._greedy(self._forward(prompt, cache), cache, max_tokens, ignore_eos)
        return Generation(ids, reason)

    def prefill(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool = True) -> Generation:
        """Compute the prompt, hold its KV for a decoder, answer the params it needs.

        Raises:
            PoolExhausted: no room for the prompt's blocks (kvxfer error; nothing held).
        """
        transfers = self._require_transfers()
        request_id = f"cmpl-hf-{uuid.uuid4().hex}"
        blocks = self.pool.allocate(self.pool.blocks_for(len(prompt)), timeout=self._timeout())
        slots: list[int] = []
        held = False
        stored = len(prompt)   # prompt tokens whose K/V (and state) the held blocks keep
        try:
            if self.pool.state is not None:
                slots = self.pool.allocate_slots(1, timeout=self._timeout())
            with self._lock:
                cache = self._fresh_cache()
                sliding = record_sliding(cache)
                if slots and len(prompt) > 1:
                    # a decoder recomputes the last prompt token: it needs the state before it
                    self._forward(prompt[:-1], cache)
                    stored = len(prompt) - 1
                    self._store(cache, blocks, stored, slots)
                    logits = self._forward(prompt[-1:], cache)
                else:
                    logits = self._forward(prompt, cache)
                    self._store(cache, blocks, len(prompt), slots)
                trim_sliding(sliding)
                transfers.hold(request_id, blocks, slots[0] if slots else None)
                held = True  # from here the Agent owns the blocks; the reaper frees them
                ids, reason = self._greedy(logits, cache, max_tokens, ignore_eos)
        except BaseException:
            if not held:
                self.pool.free(blocks, slots)
            raise
        host, port = transfers.address
        params = producer_answer(request_id=request_id, block_ids=transfers.hold_ids(blocks, slots[0] if slots else None),
                                 engine_id=transfers.engine_id,
                                 host=host, port=port, tp_size=1, num_tokens=stored,
                                 block_size=self.pool.spec.block_size,
                                 hold_token=transfers.hold_token(request_id))
        return Generation(ids, reason, params)

    def decode(self, prompt: Sequence[int], max_tokens: int, remote: RemotePrefill,
               ignore_eos: bool = True) -> Generation:
        """Continue from a producer's KV of ``prompt``; a failed load follows the failure policy.

        Raises:
            LoadFailed: the load failed and the policy is ``fail``.
        """
        transfers = self._require_transfers()
        try:
            landed = transfers.load(remote, len(prompt), self._timeout())
        except LoadFailed as exc:
            if self.settings.failure_policy == "fail":
                raise
            log.warning("%s; recomputing the prompt locally (kv_load_failure_policy=recompute)", exc)
            done = self.generate(prompt, max_tokens, ignore_eos)
            return Generation(done.token_ids, done.finish_reason, notes={"recomputed": str(exc)})
        try:
            layers = self.pool.load(landed.blocks, landed.tokens)
            states = self.pool.state.load(landed.slot) if landed.slot is not None else None
        finally:
            self.pool.free(landed.blocks, [landed.slot] if landed.slot is not None else ())
        with self._lock:
            cache = self._loaded_cache(layers, states)
            logits = self._forward(prompt[landed.tokens:], cache)
            ids, reason = self._greedy(logits, cache, max_tokens, ignore_eos)
        return Generation(ids, reason, loaded_tokens=landed.tokens,
                          notes={"transfer_seconds": landed.seconds, "transfer_bytes": landed.num_bytes,
                                 "transfer_mode": landed.mode})

    # ---- helpers ---------------------------------------------------------------------
    def _state_layers(self) -> list[int]:
        return [i for g in self.pool.state_groups for i in g.layers]

    def _store(self, cache: DynamicCache, blocks: list[int], num_tokens: int, slots: list[int]) -> None:
        """Copy the attention layers' first ``num_tokens`` tokens into ``blocks`` and the state
        layers' state into ``slots[0]`` (a pool with state layers)."""
        self.pool.store([(cache.layers[i].keys, cache.layers[i].values) for i in self.pool.attn_layers],
                        blocks, num_tokens)
        if slots:
            self.pool.state.store([layer_states(cache.layers[i]) for i in self._state_layers()], slots[0])

    def _loaded_cache(self, layers: list, states: list | None) -> DynamicCache:
        """A ``DynamicCache`` of the loaded attention layers' K/V (and state layers' state)."""
        if self.pool.groups is None:
            return DynamicCache(ddp_cache_data=layers, config=self.model.config)
        data: list[tuple] = [(None, None)] * len(self.model.config.get_text_config(decoder=True).layer_types)
        for pos, i in enumerate(self.pool.attn_layers):
            data[i] = layers[pos]
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        for tensors, i in zip(states or (), self._state_layers()):
            set_layer_states(cache.layers[i], tensors)
        return cache

    @property
    def num_groups(self) -> int:
        """KV-cache groups a producer's ``remote_block_ids`` must list (1 unless hybrid)."""
        return self.pool.num_groups

    def _require_transfers(self) -> Transfers:
        if self.transfers is None:
            raise LoadFailed("this server has no --kv-transfer-config: it cannot prefill for or decode "
                             "from another instance")
        return self.transfers

    def _timeout(self) -> float:
        return self.settings.transfer_timeout or 60.0

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
