"""Tiny random mixture-of-experts models of each MoE family (issue 24), built from configs (CPU, seconds).

Kept apart from tests/families.py (the dense families): ``MOE_FAMILIES[name] = (model_type, config
overrides, shipped spec)``.  One decoder layer by default: the experts, the router and the loss are
what these models add, and one layer of each is what the CPU tests can afford.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from .families import config_for

COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)

MOE_FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                    decoder_sparse_step=1, mlp_only_layers=[]), "qwen3_moe"),
    "mixtral": ("mixtral", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2), "mixtral"),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None), "olmoe"),
    "gpt_oss": ("gpt_oss", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                layer_types=["full_attention"], sliding_window=8), "gpt_oss"),
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=24, n_group=2, topk_group=1, first_k_dense_replace=0,
                                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8, n_shared_experts=1), "deepseek_v3"),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                             num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
                    "qwen3_5_moe"),
    # recognised by structure too (no shipped spec)
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=40), None),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2), None),
}


def tiny_moe_config(family: str, **over):
    model_type, extra, _ = MOE_FAMILIES[family]
    return config_for(model_type, COMMON, extra, **over)


def tiny_moe_model(family: str, seed: int = 0, dtype=torch.float32, **over):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_moe_config(family, **over), attn_implementation="eager")
    with torch.no_grad():      # norm weights initialise to 1 (or 0 with a 1 + w scale): make them matter
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)
