"""What each kind needs, structurally: for errors that say why a module fits no kind (read by
patchdsl.plan's selection when a rule's modules fit no kind)."""

from __future__ import annotations

from .mlp import MLP_PAIRS


KIND_NEEDS = {
    "RMSNorm": ("a 1-D weight, no bias, an eps attribute, no children, and a forward equal to "
                "x / rms(x) * (offset + w)"),
    "LayerNorm": "a 1-D weight, an eps attribute, no children, and a forward equal to F.layer_norm (offset 0 or 1)",
    "SwiGLU": "children gate_proj + up_proj (or gate_up_proj) and down_proj, and an act_fn computing silu",
    "GeGLU": "children gate_proj + up_proj (or gate_up_proj) and down_proj, and an act_fn computing GELU",
    "MLP": ("an up/down projection pair (up_proj/down_proj, fc1/fc2, c_fc/c_proj, dense_h_to_4h/dense_4h_to_h, "
            "linear_fc1/linear_fc2, lin1/lin2, ..., or nn.Sequential(Linear, act, Linear)), no gate_proj, and a "
            "forward equal to down(act(up(x)))"),
    "Attention": ("children q_proj, k_proj, v_proj (or qkv_proj / query_key_value) and o_proj (or dense / out_proj "
                  "with a rotary embedding), a config, head_dim and head counts"),
    "CausalLM": "attributes model (or the base model under its base_model_prefix: transformer, gpt_neox ...), lm_head and config",
    "DecoderLayer": "children input_layernorm, self_attn, post_attention_layernorm and mlp",
    "Router": ("a 2-D [experts, hidden] weight (optional bias), an int top_k, no children, and a "
               "forward(hidden_states) of the hidden states alone returning router logits, top-k weights and "
               "top-k indices"),
}


MLA_CHILDREN = ("kv_a_proj_with_mqa", "kv_b_proj")


def mla_misfit(children: Any) -> str:
    """Why a multi-head latent attention module (DeepSeek-V2/V3, Kimi-K2: ``kv_a_proj_with_mqa`` /
    ``kv_b_proj``, optional ``q_a_proj`` / ``q_b_proj``) fits no Attention op ("" when it is not one)."""
    ch = set(children)
    if not all(c in ch for c in MLA_CHILDREN):
        return ""
    q = "q_a_proj/q_b_proj" if "q_a_proj" in ch else "q_proj"
    return (f"multi-head latent attention: RoPE on a decoupled qk_rope_head_dim slice of each q head and of one k "
            f"slice shared by the heads (kv_a_proj_with_mqa), after low-rank projections ({q}, kv_b_proj); no "
            "Attention op computes it (fused_rope and fused_qk_norm_rope rotate whole q/k heads of q/k/v_proj)")


def kind_misses(kind: str, children: tuple) -> str:
    """What of ``KIND_NEEDS[kind]`` a module with these children lacks, read off the names alone ("" if
    its children look right: then its forward or sizes differ)."""
    ch = set(children)
    if kind == "Attention" and mla_misfit(ch):
        return ", ".join(n for n in ("q_proj", "k_proj", "v_proj") if n not in ch) + ": it is " + mla_misfit(ch)
    if kind == "Attention":
        other = sorted(ch & {"dense", "out_proj"})
        miss = ([] if "o_proj" in ch else
                [f"o_proj, nor a rotary embedding to go with its {other[0]}"] if other else ["o_proj"])
        if not ch & {"qkv_proj", "query_key_value"}:
            miss = [n for n in ("q_proj", "k_proj", "v_proj") if n not in ch] + miss
        return ", ".join(miss)
    if kind in ("SwiGLU", "GeGLU"):
        miss = [] if "gate_up_proj" in ch else [n for n in ("gate_proj", "up_proj") if n not in ch]
        return ", ".join(miss + [n for n in ("down_proj",) if n not in ch])
    if kind == "MLP":
        if any(u in ch and d in ch for u, d in MLP_PAIRS):
            return ""
        return "an up/down projection pair (" + ", ".join("/".join(p) for p in MLP_PAIRS[:4]) + ", ...)"
    if kind in ("RMSNorm", "LayerNorm") and ch:
        return "no children"
    return ""
