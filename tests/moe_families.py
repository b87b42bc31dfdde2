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
    # the sigmoid grouped top-k router with a score-correction bias (issue 37): GLM-4.5, dots1; DeepSeek-V2's
    # softmax routers (greedy with a routed scaling factor; group-limited greedy)
    "glm4_moe": ("glm4_moe", dict(head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                  n_group=4, topk_group=2, first_k_dense_replace=0, n_shared_experts=1,
                                  routed_scaling_factor=1.5, partial_rotary_factor=0.5), None),
    "dots1": ("dots1", dict(head_dim=8, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                            n_group=4, topk_group=2, first_k_dense_replace=0, n_shared_experts=1,
                            routed_scaling_factor=2.0, norm_topk_prob=False), None),
    "deepseek_v2": ("deepseek_v2", dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=24, first_k_dense_replace=0, kv_lora_rank=16,
                                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        n_shared_experts=1, topk_method="greedy", routed_scaling_factor=1.25), None),
    "deepseek_v2_grouped": ("deepseek_v2", dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=24, first_k_dense_replace=0, kv_lora_rank=16,
                                                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                v_head_dim=8, n_shared_experts=1, n_group=4, topk_group=2,
                                                topk_method="group_limited_greedy", routed_scaling_factor=1.25),
                            None),
    # the correction bias added to the logits for the choice, sigmoid weights renormalised (Kolibri1)
    "kolibri1": ("kolibri1", dict(head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                  shared_expert_intermediate_size=24, norm_topk_prob=True), None),
    # recognised by structure too (no shipped spec)
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=40), None),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2), None),
    # top-k under moe_topk, transposed experts (Aria); a router through a Linear child (HunYuan's wg,
    # AFMoE's gate with an expert bias); gpt-oss's clamped SwiGLU, concatenated, as swiglu_alpha/limit (MiniMax-M3)
    "aria_text": ("aria_text", dict(moe_num_experts=4, moe_topk=2, moe_intermediate_size=24,
                                    moe_num_shared_experts=1), None),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(head_dim=8, num_experts=4, moe_topk=2), None),
    "afmoe": ("afmoe", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                            num_dense_layers=0, num_shared_experts=1), None),
    "minimax_m3_vl_text": ("minimax_m3_vl_text", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                      shared_intermediate_size=40, bos_token_id=None,
                                                      eos_token_id=None), None),
}

# MoE families whose experts fit no Experts kind: (model_type, overrides, what the refusal must name)
MOE_REFUSED = {
    "llama4_text": ("llama4_text", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                                        intermediate_size_mlp=48, pad_token_id=None, bos_token_id=None,
                                        eos_token_id=None), "takes no top_k_index / top_k_weights"),
    "hy_v4": ("hy_v4", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                            mlp_layer_types=["sparse"],
                            pad_token_id=None, bos_token_id=None, eos_token_id=None),
              "has no act_fn or alpha, only swiglu_limit="),
    "jetmoe": ("jetmoe", dict(num_local_experts=4, num_experts_per_tok=2),
               "MoE experts as input_linear / output_linear (JetMoeParallelExperts, 3-D weight)"),
}


def tiny_moe_config(family: str, **over):
    model_type, extra = MOE_FAMILIES[family][:2] if family in MOE_FAMILIES else MOE_REFUSED[family][:2]
    return config_for(model_type, COMMON, extra, **over)


def tiny_moe_model(family: str, seed: int = 0, dtype=torch.float32, **over):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_moe_config(family, **over), attn_implementation="eager")
    with torch.no_grad():      # norm weights initialise to 1 (or 0 with a 1 + w scale): make them matter
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)
