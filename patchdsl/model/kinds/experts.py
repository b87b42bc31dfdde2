"""Mixture of experts (issue 24): the experts module (3-D expert weights), with the PEFT wrapper chain
around it, the top-k its config names and why a module fits no Experts kind."""

from __future__ import annotations

from typing import Any

from ..modules import _torch
from ..reference import experts_reference
from .probe import _activation, stand_in
from .registry import kind


EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_clamp")


def _expert_params(m: Any) -> dict | None:
    torch = _torch()
    gu, dn = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        return None
    if gu.shape[0] != dn.shape[0]:
        return None
    E = int(gu.shape[0])
    orient = []
    declared = m.__dict__.get("is_transposed")
    for tr in ((declared,) if isinstance(declared, bool) else (False, True)):
        if tr:   # gate_up [E, H, 2I], down [E, I, H]
            h, i2, i, h2 = gu.shape[1], gu.shape[2], dn.shape[1], dn.shape[2]
        else:    # gate_up [E, 2I, H], down [E, H, I]
            i2, h, h2, i = gu.shape[1], gu.shape[2], dn.shape[1], dn.shape[2]
        if h == h2 and i2 == 2 * i and i > 0:
            orient.append((tr, int(h), int(i)))
    if not orient:
        return None
    gb, db = m._parameters.get("gate_up_proj_bias"), m._parameters.get("down_proj_bias")
    bias = isinstance(gb, torch.Tensor) and isinstance(db, torch.Tensor)
    if (gb is None) != (db is None):
        return None
    return {"E": E, "orient": orient, "bias": bias}


def peft_param_base(m: Any) -> tuple[Any, int]:
    """(the module under PEFT's ``ParamWrapper`` chain around ``m``, how many wrappers): LoRA on a
    parameter (``target_parameters``) wraps its module once per targeted parameter; the wrapper's
    forward parametrizes the inner module's parameter (W + BA) and calls the inner module."""
    torch = _torch()
    depth = 0
    while depth < 8 and "parameter_name" in m.__dict__ and isinstance(m._modules.get("base_layer"), torch.nn.Module):
        m = m._modules["base_layer"]
        depth += 1
    return m, depth


# where a config keeps the experts per token: num_experts_per_tok (most), moe_topk (Aria, HunYuan),
# moe_top_k / num_experts_per_token / experts_per_token (other checkpoints' spellings)
TOP_K_ATTRS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "num_experts_per_token", "experts_per_token")


def config_top_k(cfg: Any, E: int) -> int | None:
    """The top-k a config names under one of ``TOP_K_ATTRS`` (an int in 1..E; a per-layer list is not one)."""
    if cfg is None:
        return None
    for a in TOP_K_ATTRS:
        v = getattr(cfg, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= E:
            return int(v)
    return None


def _top_k(m: Any, E: int) -> int | None:
    """The experts' top-k: the module's ``top_k``, else its config's (``config_top_k``); None if unknown."""
    v = m.__dict__.get("top_k")
    if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= E:
        return int(v)
    return config_top_k(getattr(m, "config", None), E)


def _clamp_attrs(m: Any) -> tuple[float, float] | None:
    """(alpha, limit) of a gpt-oss-style clamped SwiGLU held on the experts module: ``alpha`` / ``limit``
    (gpt-oss) or ``swiglu_alpha`` / ``swiglu_limit`` (MiniMax-M3)."""
    for a_name, l_name in (("alpha", "limit"), ("swiglu_alpha", "swiglu_limit")):
        alpha, limit = m.__dict__.get(a_name), m.__dict__.get(l_name)
        if (isinstance(alpha, (int, float)) and isinstance(limit, (int, float))
                and not isinstance(alpha, bool) and not isinstance(limit, bool)):
            return float(alpha), float(limit)
    return None


def expert_forward(m: Any):
    fwd = type(m).forward
    return getattr(fwd, "__wrapped__", fwd)    # the eager loop, not the registry's dispatch


@kind("Experts", "3-D expert weights, forward(hidden, top_k_index, top_k_weights): concatenated or "
      "interleaved gate/up, transposed or not, optional biases; activation probed (silu, gelu, gelu_tanh, "
      "gpt-oss's clamped SwiGLU)")
def experts(m: Any) -> dict | None:
    torch = _torch()
    inner, depth = peft_param_base(m)
    if depth:        # PEFT LoRA on the expert parameters (target_parameters): the wrapped module's facts
        f = experts(inner)
        return dict(f, peft_depth=depth) if f else None
    p = _expert_params(m)
    if p is None:
        return None
    acts: list[tuple[str, float | None, float | None]] = []
    act = getattr(m, "act_fn", None)
    name = _activation(act) if act is not None else None
    if name is not None:
        acts.append((name, None, None))
    clamp = _clamp_attrs(m)
    if clamp is not None:
        acts.append(("swiglu_clamp", *clamp))
    if not acts:
        return None
    E = p["E"]
    fwd = expert_forward(m)
    g = torch.Generator().manual_seed(11)
    T, h, i, k = 6, 8, 4, min(2, E)
    x = torch.randn(T, h, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    for tr, H, I in p["orient"]:
        gu = torch.randn((E, h, 2 * i) if tr else (E, 2 * i, h), generator=g, dtype=torch.float64) * 0.7
        dn = torch.randn((E, i, h) if tr else (E, h, i), generator=g, dtype=torch.float64) * 0.5
        params = {"gate_up_proj": gu, "down_proj": dn}
        gb = db = None
        if p["bias"]:
            gb = torch.randn(E, 2 * i, generator=g, dtype=torch.float64) * 0.3
            db = torch.randn(E, h, generator=g, dtype=torch.float64) * 0.3
            params.update(gate_up_proj_bias=gb, down_proj_bias=db)
        clone = stand_in(m, modules=dict(m._modules), **params)     # act_fn etc. are stateless children
        for a in ("hidden_dim", "hidden_size"):
            if isinstance(clone.__dict__.get(a), int):
                clone.__dict__[a] = h
        for a in ("intermediate_dim", "intermediate_size"):
            if isinstance(clone.__dict__.get(a), int):
                clone.__dict__[a] = i
        if isinstance(clone.__dict__.get("num_experts"), int):
            # the stand-in holds E experts (expert parallelism sets the module's count to its rank's share)
            clone.__dict__["num_experts"] = E
        try:
            with torch.no_grad():
                out = fwd(clone, x.clone(), idx.clone(), w.clone())
        except Exception:
            continue
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            continue
        for layout in ("concat", "interleaved"):
            for an, al, li in acts:
                facts = {"transposed": tr, "layout": layout, "activation": an, "alpha": al, "limit": li}
                ref = experts_reference(x, idx, w, gu, dn, gb, db, facts)
                if torch.allclose(out, ref, rtol=1e-9, atol=1e-10):
                    return {"experts": E, "hidden": H, "intermediate": I, "transposed": tr, "layout": layout,
                            "bias": p["bias"], "activation": an, "alpha": al, "limit": li, "top_k": _top_k(m, E)}
    return None


def experts_misfit(m: Any) -> str:
    """Why ``m`` (a MoE block's experts module) fits no ``Experts`` kind, by structure (one phrase);
    "" when it does.  Checked in the order the recogniser needs them: 3-D gate_up_proj / down_proj,
    forward(hidden, top_k_index, top_k_weights), an activation patchdsl probes, then the forward's
    values against the reference."""
    import inspect

    torch = _torch()
    m, _ = peft_param_base(m)
    if experts(m) is not None:
        return ""
    cls = type(m).__name__
    gu, dn = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)):
        own = {n: tuple(p.shape) for n, p in m.named_parameters()}
        if isinstance(m, torch.nn.ModuleList):
            return (f"{cls} is a list of {len(m)} per-expert modules, not 3-D gate_up_proj / down_proj "
                    "parameters")
        held = ", ".join(f"{n} {list(s)}" for n, s in list(own.items())[:4]) or "no parameters"
        return f"{cls} holds {held}, not 3-D gate_up_proj [E, 2I, H] / down_proj [E, H, I] parameters"
    if _expert_params(m) is None:
        return (f"{cls}'s gate_up_proj {list(gu.shape)} / down_proj {list(dn.shape)} are not [E, 2I, H] / "
                "[E, H, I] (nor transposed) with matching biases")
    try:
        params = list(inspect.signature(expert_forward(m)).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        names = ", ".join(p.name for p in params) or "nothing"
        return (f"{cls}.forward({names}) takes no top_k_index / top_k_weights (the block routes "
                "and scales the tokens)")
    act = getattr(m, "act_fn", None)
    if _clamp_attrs(m) is None and (act is None or _activation(act) is None):
        limits = {a: m.__dict__[a] for a in ("swiglu_limit", "limit", "softcap", "swiglu_softcap")
                  if isinstance(m.__dict__.get(a), (int, float))}
        if act is None:
            held = ", ".join(f"{a}={v}" for a, v in limits.items())
            return (f"{cls} has no act_fn or alpha" + (f", only {held}" if held else "")
                    + ": not an activation fused_experts computes")
        return f"{cls}'s act_fn {type(act).__name__} is not silu, gelu, gelu_tanh or gpt-oss's SwiGLU"
    return (f"{cls}.forward does not compute sum_k w * down(act(gate) * up) of its 3-D weights for any layout "
            "(probed in float64: a scale, norm or accumulation of its own)")
