"""Structural kinds: recognise a module by what it computes, not by what its class is called.

Each recogniser takes a live module (possibly on the meta device) and returns the facts the
ops need (sizes, eps, offset, casting mode, activation, ...) or None if the module does not fit.
Where behaviour cannot be read off attributes (Gemma's ``(1 + w)``, the cast order, which GELU)
the recogniser *probes*: it runs the module's own class ``forward`` on a tiny CPU stand-in with
known weights and compares the output bit for bit with each candidate formula.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from .registry import kind

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


def _torch():
    import torch
    return torch


def linear_like(m: Any) -> Any | None:
    """The nn.Linear holding the weight of ``m`` (``m`` itself, or a PEFT layer's base_layer)."""
    torch = _torch()
    seen = 0
    while m is not None and seen < 4:
        if isinstance(m, torch.nn.Linear):
            return m
        m = getattr(m, "base_layer", None)
        seen += 1
    return None


def unwrap(m: Any) -> Any:
    """Unwrap PEFT's ModulesToSaveWrapper-style wrappers to the module doing the work."""
    for attr in ("original_module",):
        inner = getattr(m, attr, None)
        if inner is not None and hasattr(m, "modules_to_save"):
            active = getattr(m, "active_adapters", None) or getattr(m, "active_adapter", None)
            if isinstance(active, (list, tuple)):
                active = active[0] if active else None
            if active is not None and active in m.modules_to_save:
                return m.modules_to_save[active]
            return inner
    return m


def _eps(m: Any) -> float | None:
    for a in _EPS_ATTRS:
        v = getattr(m, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def stand_in(m: Any, *, modules: Mapping[str, Any] | None = None, training: bool | None = None, **params):
    """A shallow CPU copy of ``m`` for probing its class's forward: its parameters are ``params``,
    its children ``modules``, no buffers, no hooks, no instance-level forward.  ``m`` is untouched."""
    torch = _torch()
    clone = m.__class__.__new__(m.__class__)
    d = dict(m.__dict__)
    d.pop("forward", None)
    for k in _HOOK_DICTS:
        if k in d:
            d[k] = OrderedDict()
    # parameters registered as None (e.g. nn.LayerNorm(bias=False)) stay None on the stand-in
    d["_parameters"] = OrderedDict((k, None) for k, v in m._parameters.items() if v is None)
    d["_parameters"].update((k, torch.nn.Parameter(v, requires_grad=False)) for k, v in params.items())
    d["_buffers"] = OrderedDict()
    d["_modules"] = OrderedDict(modules or {})
    if training is not None:
        d["training"] = training
    clone.__dict__.update(d)
    return clone


def _run_class_forward(m: Any, clone: Any, *args):
    torch = _torch()
    with torch.no_grad():
        return type(m).forward(clone, *args)


@kind("RMSNorm", "y = x / rms(x) * (offset + w); offset and cast order probed")
def rmsnorm(m: Any) -> dict | None:
    torch = _torch()
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return None
    if getattr(m, "bias", None) is not None:
        return None
    if list(m.children()):
        return None
    eps = _eps(m)
    if eps is None:
        return None
    h = w.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, h, generator=g)
    wt = torch.randn(h, generator=g) * 0.5
    try:
        out32 = _run_class_forward(m, stand_in(m, weight=wt.clone()), x.clone())
    except Exception:
        return None
    if not isinstance(out32, torch.Tensor) or out32.shape != x.shape:
        return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    offset = None
    for off in (0.0, 1.0):
        if torch.allclose(out32, normed * (off + wt), rtol=1e-5, atol=1e-5):
            offset = off
            break
    if offset is None:
        return None
    # Cast order, probed in bf16: llama = cast the normalised value, then scale in the input dtype;
    # gemma = scale in fp32, then cast.
    xb, wb = x.bfloat16(), wt.bfloat16()
    outb = _run_class_forward(m, stand_in(m, weight=wb.clone()), xb.clone())
    nb = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + eps)
    llama = (offset + wb) * nb.to(torch.bfloat16) if offset else wb * nb.to(torch.bfloat16)
    gemma = (nb * (offset + wb.float())).to(torch.bfloat16)
    if outb.dtype == torch.bfloat16 and torch.equal(outb, llama):
        casting = "llama"
    elif outb.dtype == torch.bfloat16 and torch.equal(outb, gemma):
        casting = "gemma"
    else:
        casting = "unknown"
    return {"hidden": int(h), "eps": eps, "offset": offset, "casting": casting}


@kind("LayerNorm", "y = (x - mean) / std * (offset + w) + b, with or without bias; offset 1 = LayerNorm1P (probed)")
def layernorm(m: Any) -> dict | None:
    torch = _torch()
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or list(m.children()):
        return None
    eps = _eps(m)
    if eps is None:
        return None
    b = getattr(m, "bias", None)
    has_bias = isinstance(b, torch.Tensor)
    h = w.shape[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, h, generator=g) + 0.7
    wt = torch.randn(h, generator=g)
    params = {"weight": wt}
    bt = None
    if has_bias:
        bt = torch.randn(h, generator=g)
        params["bias"] = bt
    try:
        out = _run_class_forward(m, stand_in(m, **params), x)
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    # offset 1: Nemotron's LayerNorm1P scales by (1 + w)
    for off in (0.0, 1.0):
        ref = torch.nn.functional.layer_norm(x, (h,), wt + off, bt, eps)
        if torch.allclose(out, ref, rtol=1e-5, atol=1e-5):
            f = {"hidden": int(h), "eps": eps, "bias": has_bias}
            if off:
                f["offset"] = off
            return f
    return None


def _activation(act: Any) -> str | None:
    """'silu', 'gelu' (exact erf) or 'gelu_tanh', probed on a ramp; None otherwise."""
    torch = _torch()
    if act is None or not callable(act):
        return None
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x.clone())
    except Exception:
        return None
    F = torch.nn.functional
    for name, ref in (("silu", F.silu(x)), ("gelu", F.gelu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh"))):
        if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-7):
            return name
    return None


def _glu(m: Any) -> dict | None:
    down = linear_like(getattr(m, "down_proj", None))
    act = getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)
    if down is None or act is None:
        return None
    actname = _activation(act)
    if actname is None:
        return None
    gate = linear_like(getattr(m, "gate_proj", None))
    up = linear_like(getattr(m, "up_proj", None))
    gate_up = linear_like(getattr(m, "gate_up_proj", None))
    if gate is not None and up is not None:
        fused = False
        hidden, inter = gate.in_features, gate.out_features
        if up.out_features != inter or down.in_features != inter:
            return None
        bias = gate.bias is not None or up.bias is not None or down.bias is not None
    elif gate_up is not None:
        fused = True
        hidden, inter2 = gate_up.in_features, gate_up.out_features
        if inter2 % 2 or down.in_features != inter2 // 2:
            return None
        inter = inter2 // 2
        bias = gate_up.bias is not None or down.bias is not None
    else:
        return None
    return {"hidden": int(hidden), "intermediate": int(inter), "fused_gate_up": fused,
            "bias": bool(bias), "activation": actname}


@kind("SwiGLU", "down(silu(gate(x)) * up(x)), separate or fused gate_up projection")
def swiglu(m: Any) -> dict | None:
    f = _glu(m)
    return f if f and f["activation"] == "silu" else None


@kind("GeGLU", "down(gelu(gate(x)) * up(x)), exact or tanh GELU")
def geglu(m: Any) -> dict | None:
    f = _glu(m)
    if not f or not f["activation"].startswith("gelu"):
        return None
    f = dict(f)
    f["approximate"] = "tanh" if f["activation"] == "gelu_tanh" else "none"
    return f


@kind("Attention", "q/k/v/o projections (or fused qkv) with rotary embeddings, optional q_norm/k_norm")
def attention(m: Any) -> dict | None:
    cfg = getattr(m, "config", None)
    o = linear_like(getattr(m, "o_proj", None))
    if o is None or cfg is None:
        return None
    q, k, v = (linear_like(getattr(m, n, None)) for n in ("q_proj", "k_proj", "v_proj"))
    qkv = linear_like(getattr(m, "qkv_proj", None))
    if not (q is not None and k is not None and v is not None) and qkv is None:
        return None
    head_dim = getattr(m, "head_dim", None) or getattr(cfg, "head_dim", None)
    n_heads = getattr(cfg, "num_attention_heads", None)
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    if not head_dim or not n_heads:
        return None
    facts: dict[str, Any] = {"head_dim": int(head_dim), "n_heads": int(n_heads), "n_kv_heads": int(n_kv),
                             "fused_qkv": qkv is not None}
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    prf = getattr(cfg, "partial_rotary_factor", None)
    if prf is None and isinstance(rope_params, dict):
        prf = rope_params.get("partial_rotary_factor")
    facts["rotary_dim"] = int(int(head_dim) * float(prf if prf is not None else 1.0))
    qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    if qn is not None and kn is not None:
        fq, fk = rmsnorm(qn), rmsnorm(kn)
        if fq and fk and fq["hidden"] == head_dim and fk["hidden"] == head_dim:
            facts["qk_norm"] = {"eps": fq["eps"], "offset": fq["offset"], "casting": fq["casting"]}
    return facts


@kind("CausalLM", "a causal LM head model: self.model, self.lm_head and a loss_function")
def causal_lm(m: Any) -> dict | None:
    lm = getattr(m, "lm_head", None)
    cfg = getattr(m, "config", None)
    if lm is None or cfg is None or not hasattr(m, "model"):
        return None
    lin = linear_like(unwrap(lm))
    if lin is None:
        return None
    tie = getattr(cfg, "tie_word_embeddings", False)
    # what the forward does to the logits, read from its source (loss_path.head_transform); a forward
    # the loss ops cannot reproduce keeps the config's values (the loss ops' check refuses it)
    from .loss_path import head_transform
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


# ---- what each kind needs, structurally (for errors that say why a module fits no kind) ----------------
# (helper "families"; read by patchdsl.select when a rule's modules fit no kind)
KIND_NEEDS = {
    "RMSNorm": ("a 1-D weight, no bias, an eps attribute, no children, and a forward equal to "
                "x / rms(x) * (offset + w)"),
    "LayerNorm": "a 1-D weight, an eps attribute, no children, and a forward equal to F.layer_norm (offset 0 or 1)",
    "SwiGLU": "children gate_proj + up_proj (or gate_up_proj) and down_proj, and an act_fn computing silu",
    "GeGLU": "children gate_proj + up_proj (or gate_up_proj) and down_proj, and an act_fn computing GELU",
    "Attention": "children q_proj, k_proj, v_proj (or qkv_proj) and o_proj, a config, head_dim and head counts",
    "CausalLM": "attributes model (the base model), lm_head and config",
    "DecoderLayer": "children input_layernorm, self_attn, post_attention_layernorm and mlp",
}


def kind_misses(kind: str, children: tuple) -> str:
    """What of ``KIND_NEEDS[kind]`` a module with these children lacks, read off the names alone ("" if
    its children look right: then its forward or sizes differ)."""
    ch = set(children)
    if kind == "Attention":
        miss = [n for n in ("o_proj",) if n not in ch]
        if "qkv_proj" not in ch:
            miss = [n for n in ("q_proj", "k_proj", "v_proj") if n not in ch] + miss
        return ", ".join(miss)
    if kind in ("SwiGLU", "GeGLU"):
        miss = [] if "gate_up_proj" in ch else [n for n in ("gate_proj", "up_proj") if n not in ch]
        return ", ".join(miss + [n for n in ("down_proj",) if n not in ch])
    if kind in ("RMSNorm", "LayerNorm") and ch:
        return "no children"
    return ""
