"""Tiny hybrid models whose answers depend on the context, for tests and examples (layer: adapter; torch and transformers, imported when called).

Shared by the vLLM and kvxfer-hf hybrid tests and ``examples/hf_hybrid_pd.py``.

Random weights, but wide (``initializer_range=0.3``, untied embeddings), so a model's next token
depends on the whole prompt (tiny random Gemma 2/3 models with the default initialisation answer
the same whatever the context, so they cannot show that a moved cache was used).
"""

from __future__ import annotations

from pathlib import Path

#: the tiny Gemma 3's sliding window, in tokens
GEMMA3_WINDOW = 32


def make_tiny_gemma3(path: Path) -> Path:
    """Gemma 3 text model, 4 layers (sliding, full, sliding, full), window 32, random weights (seed 0)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=1024, initializer_range=0.3,
                           sliding_window=GEMMA3_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                           query_pre_attn_scalar=64, final_logit_softcapping=None, attn_logit_softcapping=None,
                           tie_word_embeddings=False, max_position_embeddings=2048)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def make_tiny_granite_hybrid(path: Path) -> Path:
    """GraniteMoeHybrid (Granite 4.0-H's architecture), 4 layers (Mamba2, attention, Mamba2,
    attention), dense MLP, random weights (seed 0). transformers runs its Mamba2 layers on CPU
    through its reference PyTorch path (no causal_conv1d or mamba_ssm kernels needed)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=16,
                                 mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
                                 mamba_chunk_size=64, num_local_experts=0, num_experts_per_tok=0,
                                 initializer_range=0.3, tie_word_embeddings=False, max_position_embeddings=2048,
                                 position_embedding_type="rope")
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path
