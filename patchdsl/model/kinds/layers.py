"""The transformer's structure: Attention, CausalLM, Linear and DecoderLayer."""

from __future__ import annotations

from typing import Any

from ..modules import linear_like, unwrap
from .norms import rmsnorm
from .registry import kind


@kind("Attention", "q/k/v projections (or fused qkv_proj / query_key_value) and an output projection "
      "(o_proj, dense or out_proj) with rotary embeddings (layout probed), optional q_norm/k_norm")
def attention(m: Any) -> dict | None:
    from ..forward.rotary import attention_facts      # projection names, rotary layout and input (issue 25)

    return attention_facts(m, rmsnorm, linear_like)


@kind("CausalLM", "a causal LM head model: self.model (or its base_model_prefix), self.lm_head and a loss_function")
def causal_lm(m: Any) -> dict | None:
    from ..forward.causal_lm import looks_causal_lm     # the body under `model` or the base_model_prefix (GPT-2: transformer)

    lm = getattr(m, "lm_head", None)
    cfg = getattr(m, "config", None)
    if lm is None or cfg is None or not looks_causal_lm(m):
        return None
    lin = linear_like(unwrap(lm))
    if lin is None:
        return None
    tie = getattr(cfg, "tie_word_embeddings", False)
    # what the forward does to the logits, read from its source (loss_path.head_transform); a forward
    # the loss ops cannot reproduce keeps the config's values (the loss ops' check refuses it)
    from ..forward.causal_lm import head_transform
    try:
        t, _ = head_transform(m)
    except Exception:          # pragma: no cover - a forward whose source cannot be read or parsed
        t = None
    if t is None:
        t = {"softcap": getattr(cfg, "final_logit_softcapping", None),
             "logits_scaling": getattr(cfg, "logits_scaling", None), "logit_multiplier": None}
    return {"vocab": int(lin.out_features), "hidden": int(lin.in_features), "bias": lin.bias is not None,
            "softcap": t["softcap"], "logits_scaling": t["logits_scaling"],
            "logit_multiplier": t["logit_multiplier"], "tied": bool(tie)}


@kind("Linear", "an nn.Linear (or a PEFT layer wrapping one)")
def linear(m: Any) -> dict | None:
    lin = linear_like(unwrap(m))
    if lin is None:
        return None
    return {"in_features": int(lin.in_features), "out_features": int(lin.out_features), "bias": lin.bias is not None}


@kind("DecoderLayer", "a pre-norm transformer block: input_layernorm, self_attn, post_attention_layernorm, mlp")
def decoder_layer(m: Any) -> dict | None:
    need = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    if not all(hasattr(m, n) for n in need):
        return None
    f = rmsnorm(m.post_attention_layernorm)
    if not f:
        return None
    layout = "sandwich" if hasattr(m, "pre_feedforward_layernorm") else "prenorm"
    return {"hidden": f["hidden"], "eps": f["eps"], "offset": f["offset"], "casting": f["casting"], "layout": layout}


# ===========================================================================================


# Mixture of experts (issue 24): the experts module and the sparse MoE block.
