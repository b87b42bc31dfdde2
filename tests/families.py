"""Tiny random models of each shipped family, built from configs (CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)

FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "llama": ("llama", dict(head_dim=16)),
    "mistral": ("mistral", dict(head_dim=16, sliding_window=None)),
    "qwen2": ("qwen2", dict()),
    "gemma3": ("gemma3_text", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                                    query_pre_attn_scalar=16, final_logit_softcapping=30.0)),
    "phi3": ("phi3", dict(num_key_value_heads=4, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}

SPEC_OF = {f: f for f in FAMILIES}


def config_for(model_type: str, common: dict, extra: dict, **over):
    """A config of ``model_type`` from ``common`` sizes, a family's ``extra`` and ``over`` (eager attention)."""
    cfg = AutoConfig.for_model(model_type, **{**common, **extra, **over})
    cfg._attn_implementation = "eager"
    return cfg


def tiny_config(family: str, **over):
    model_type, extra = FAMILIES[family]
    return config_for(model_type, COMMON, extra, **over)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, **over):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config(family, **over), attn_implementation="eager")
    return m.to(dtype)
