"""Structural kinds: recognise a module by what it computes, not by what its class is called.

Each recogniser takes a live module (possibly on the meta device) and returns the facts the
ops need (sizes, eps, offset, casting mode, activation, ...) or None if the module does not fit.
Where behaviour cannot be read off attributes (Gemma's ``(1 + w)``, the cast order, which GELU)
the recogniser *probes*: it runs the module's own class ``forward`` on a tiny CPU stand-in with
known weights and compares the output bit for bit with each candidate formula.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Mapping

from .common import _torch, linear_like, unwrap  # noqa: F401  (linear_like, unwrap: where the op modules look for them)

# The kind registry: recognisers by kind name, filled by @kind below (ops.registry reads it; this module
# imports nothing from the registry, so the two do not import each other).
KINDS: dict[str, Any] = {}
KIND_DOCS: dict[str, str] = {}


def kind(name: str, doc: str = ""):
    """Register a structural-kind recogniser: ``fn(module) -> facts dict | None``."""

    def deco(fn):
        KINDS[name] = fn
        KIND_DOCS[name] = doc or (fn.__doc__ or "").strip().splitlines()[0]
        return fn

    return deco


_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


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


# ---- gated RMSNorm (issue 25, helper norms2): the output norm of linear-attention layers ------------
GATED_ACTIVATIONS = ("silu", "sigmoid")


@kind("GatedRMSNorm", "y = x / rms(x) * w * act(gate), act silu or sigmoid; cast order probed (linear-attention norms)")
def gated_rmsnorm(m: Any) -> dict | None:
    """forward(hidden_states, gate): Qwen3-Next's / Qwen3.5's / OLMo-hybrid's ``RMSNormGated`` (normalise,
    cast, scale in the input dtype, gate in fp32: casting llama) and Kimi Linear's / Lara's (all in fp32,
    one cast: casting gemma).  Probed by running the class's forward on a stand-in."""
    torch = _torch()
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return None
    if getattr(m, "bias", None) is not None or list(m.children()):
        return None
    eps = _eps(m)
    if eps is None:
        return None
    h = w.shape[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, h, generator=gen)
    gt = torch.randn(3, h, generator=gen) * 2
    wt = torch.randn(h, generator=gen) * 0.5
    try:
        out32 = _run_class_forward(m, stand_in(m, weight=wt.clone()), x.clone(), gt.clone())
    except Exception:
        return None
    if not isinstance(out32, torch.Tensor) or out32.shape != x.shape:
        return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    acts = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}
    activation = next((a for a in GATED_ACTIVATIONS
                       if torch.allclose(out32, normed * wt * acts[a](gt), rtol=1e-5, atol=1e-5)), None)
    if activation is None:
        return None
    xb, gb, wb = x.bfloat16(), gt.bfloat16(), wt.bfloat16()
    try:
        outb = _run_class_forward(m, stand_in(m, weight=wb.clone()), xb.clone(), gb.clone())
    except Exception:
        outb = None
    nb = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + eps)
    ab = acts[activation](gb.float())
    llama = ((wb * nb.to(torch.bfloat16)) * ab).to(torch.bfloat16)
    gemma = (wb.float() * nb * ab).to(torch.bfloat16)
    if isinstance(outb, torch.Tensor) and outb.dtype == torch.bfloat16 and torch.equal(outb, llama):
        casting = "llama"
    elif isinstance(outb, torch.Tensor) and outb.dtype == torch.bfloat16 and torch.equal(outb, gemma):
        casting = "gemma"
    else:
        casting = "unknown"
    return {"hidden": int(h), "eps": eps, "activation": activation, "casting": casting}


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


# ---- gated MLPs under other child names (issue 25, helper norms2) ----------------------------------
# (gate, up, down) child names other than gate_proj / up_proj / down_proj: Mixtral's old and LFM2's w1 / w3 / w2
GLU_NAME_SETS = (("w1", "w3", "w2"),)


def _glu_other_names(m: Any) -> dict | None:
    """Facts of a gated MLP whose children are one of :data:`GLU_NAME_SETS` (``names``: gate, up, down):
    the activation is probed by running the class's forward on a float64 stand-in (LFM2 calls F.silu
    inline; there is no activation child to probe)."""
    torch = _torch()
    for gn, un, dn in GLU_NAME_SETS:
        gate, up, down = (linear_like(m._modules.get(n)) for n in (gn, un, dn))
        if gate is None or up is None or down is None:
            continue
        hidden, inter = gate.in_features, gate.out_features
        if up.in_features != hidden or up.out_features != inter or down.in_features != inter \
                or down.out_features != hidden:
            return None
        g = torch.Generator().manual_seed(4)
        h, i = 6, 10
        lins = {}
        for n, (a, b, src) in ((gn, (h, i, gate)), (un, (h, i, up)), (dn, (i, h, down))):
            lin_ = torch.nn.Linear(a, b, bias=src.bias is not None, dtype=torch.float64)
            with torch.no_grad():
                lin_.weight.copy_(torch.randn(b, a, generator=g, dtype=torch.float64))
                if lin_.bias is not None:
                    lin_.bias.copy_(torch.randn(b, generator=g, dtype=torch.float64) * 0.5)
            lins[n] = lin_
        kids = {k: (lins[k] if k in lins else v) for k, v in m._modules.items()}
        x = torch.randn(4, h, generator=g, dtype=torch.float64)
        try:
            out = _run_class_forward(m, stand_in(m, modules=kids, training=False), x)
        except Exception:
            return None
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None
        F = torch.nn.functional
        with torch.no_grad():
            gx, ux = lins[gn](x), lins[un](x)
            for name, fn in (("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))):
                if torch.allclose(out, lins[dn](fn(gx) * ux), rtol=1e-9, atol=1e-12):
                    bias = any(x_.bias is not None for x_ in (gate, up, down))
                    return {"hidden": int(hidden), "intermediate": int(inter), "fused_gate_up": False,
                            "bias": bool(bias), "activation": name, "names": [gn, un, dn]}
        return None
    return None


def _glu(m: Any) -> dict | None:
    down = linear_like(getattr(m, "down_proj", None))
    act = getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)
    if down is None and any(m._modules.get(n[0]) is not None for n in GLU_NAME_SETS):
        return _glu_other_names(m)
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


# ---- plain (non-gated) MLP: down(act(up(x))) ---------------------------------------------------
# (up, down) child names of the non-gated MLPs transformers ships
MLP_PAIRS = (("up_proj", "down_proj"), ("fc1", "fc2"), ("dense_h_to_4h", "dense_4h_to_h"), ("c_fc", "c_proj"),
             ("linear_fc1", "linear_fc2"), ("lin1", "lin2"), ("w1", "w2"), ("fc_in", "fc_out"), ("Wi", "Wo"),
             ("0", "2"))     # ("0", "2"): nn.Sequential(Linear, activation, Linear) (CTRL's ffn)
# activations fused_mlp computes (ordered: the first that matches the probe names it)
MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "silu", "quick_gelu")
# where an MLP keeps its activation (the probe names the class of an activation it does not know)
MLP_ACT_ATTRS = ("act", "act_fn", "activation_fn", "activation", "gelu_impl", "act_func", "activation_function",
                 "1")        # nn.Sequential(Linear, activation, Linear)


def mlp_activation_reference(name: str):
    """The activation ``name`` of :data:`MLP_ACTIVATIONS` in plain torch (any dtype, differentiable)."""
    torch = _torch()
    F = torch.nn.functional
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu,
            "relu2": lambda t: F.relu(t).square(), "silu": F.silu,
            "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}[name]


def projection(m: Any) -> tuple[int, int, bool, bool] | None:
    """(in_features, out_features, bias, transposed) of a projection child: an nn.Linear (or a PEFT layer
    around one), or GPT-2's ``Conv1D`` (weight [in, out], y = x @ W + b: ``transposed``)."""
    torch = _torch()
    lin = linear_like(m)
    if lin is not None:
        return int(lin.in_features), int(lin.out_features), lin.bias is not None, False
    w = getattr(m, "weight", None)
    if type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2 \
            and getattr(m, "nf", None) == w.shape[1]:
        return int(w.shape[0]), int(w.shape[1]), getattr(m, "bias", None) is not None, True
    return None


def _mlp_act_child(m: Any) -> tuple[str, Any] | None:
    for a in MLP_ACT_ATTRS:
        v = m._modules.get(a) if a in m._modules else m.__dict__.get(a)
        if v is not None and callable(v):
            return a, v
    return None


def mlp_stand_in(m: Any, facts: Mapping[str, Any], *, training: bool):
    """(clone, up, down, x): a float64 stand-in of the MLP ``m`` for probing its class's forward (random
    Linear projections with the module's bias layout, its other children shallow-copied in ``training``
    mode, size attributes shrunk to the stand-in's), the two projections, and an input."""
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    h, i = 6, 10
    up, down = facts["up"], facts["down"]
    lu, ld = (torch.nn.Linear(a, b, bias=bi, dtype=torch.float64)
              for a, b, bi in ((h, i, facts["up_bias"]), (i, h, facts["down_bias"])))
    with torch.no_grad():
        for lin_ in (lu, ld):
            lin_.weight.copy_(torch.randn(lin_.weight.shape, generator=g, dtype=torch.float64) * 1.5)
            if lin_.bias is not None:
                lin_.bias.copy_(torch.randn(lin_.bias.shape, generator=g, dtype=torch.float64) * 0.5)
    kids = {}
    for k, v in m._modules.items():        # in the module's order (nn.Sequential runs its children in it)
        if k in (up, down):
            kids[k] = lu if k == up else ld
        elif v is not None:
            c = copy.copy(v)
            c.__dict__["training"] = training
            kids[k] = c
    clone = stand_in(m, modules=kids, training=training)
    for a in ("hidden_size", "hidden_dim", "embed_dim"):
        if isinstance(clone.__dict__.get(a), int) and not isinstance(clone.__dict__.get(a), bool):
            clone.__dict__[a] = h
    for a in ("intermediate_size", "ffn_hidden_size", "intermediate_dim"):
        if isinstance(clone.__dict__.get(a), int) and not isinstance(clone.__dict__.get(a), bool):
            clone.__dict__[a] = i
    x = torch.randn(4, h, generator=g, dtype=torch.float64)
    return clone, lu, ld, x


def mlp_probe(m: Any) -> tuple[dict | None, str]:
    """(facts, "") if ``m`` computes ``down(act(up(x)))`` (eval mode) with up/down a pair of
    :data:`MLP_PAIRS`, else (None, why not).  The activation is probed by running the class's own
    forward on a float64 stand-in (random projections, the module's other children kept) against each of
    :data:`MLP_ACTIVATIONS`; an activation it does not know gives facts with ``activation: None`` and
    ``act_class`` naming it (fused_mlp refuses those, naming it).  Never touches ``m``'s tensors."""
    torch = _torch()
    ch = m._modules
    pair = next(((u, d) for u, d in MLP_PAIRS if ch.get(u) is not None and ch.get(d) is not None), None)
    if pair is None:
        return None, "no up/down projection pair (" + ", ".join("/".join(p) for p in MLP_PAIRS) + ")"
    if any(ch.get(n) is not None for n in ("gate_proj", "gate_up_proj", "experts")) \
            or any(all(ch.get(n) is not None for n in names) for names in GLU_NAME_SETS):
        return None, "a gated or mixture-of-experts MLP"
    up, down = pair
    pu, pd = projection(ch[up]), projection(ch[down])
    if pu is None or pd is None:
        bad = up if pu is None else down
        return None, f"its {bad} is not an nn.Linear (or Conv1D) but {type(ch[bad]).__name__}"
    hidden, inter = pu[0], pu[1]
    if pd[1] == hidden and inter == 2 * pd[0]:
        return None, (f"{up} ({pu[0]} -> {pu[1]}) gives twice {down}'s input ({pd[0]}): a gated MLP whose gate and "
                      f"up are one projection, split in its forward")
    if pd[0] != inter or pd[1] != hidden:
        return None, f"{up} ({pu[0]} -> {pu[1]}) and {down} ({pd[0]} -> {pd[1]}) are not hidden -> I -> hidden"
    facts = {"up": up, "down": down, "hidden": hidden, "intermediate": inter, "up_bias": pu[2],
             "down_bias": pd[2], "conv1d": pu[3] or pd[3], "activation": None, "act_class": None}
    found = _mlp_act_child(m)
    if found is not None:
        facts["act_class"] = type(found[1]).__name__ if isinstance(found[1], torch.nn.Module) \
            else getattr(found[1], "__name__", type(found[1]).__name__)
    with torch.random.fork_rng(devices=[]):
        clone, lu, ld, x = mlp_stand_in(m, facts, training=False)
        try:
            with torch.no_grad():
                out = type(m).forward(clone, x)
        except Exception as e:  # noqa: BLE001  a forward that needs more than (x)
            if found is not None and isinstance(found[1], torch.nn.Module) and \
                    any(t.is_meta for t in list(found[1].parameters()) + list(found[1].buffers())):
                return facts, ""     # an activation with its own (meta) tensors: not one fused_mlp computes
            return None, f"its forward could not be probed with one argument ({type(e).__name__}: {str(e)[:80]})"
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None, f"its forward does not return one tensor of the input's shape"
        with torch.no_grad():
            hu = lu(x)
            for name in MLP_ACTIVATIONS:
                if torch.allclose(out, ld(mlp_activation_reference(name)(hu)), rtol=1e-9, atol=1e-10):
                    return dict(facts, activation=name), ""
            if found is not None:
                try:
                    own = ld(found[1](hu.clone()))
                except Exception:  # noqa: BLE001  e.g. an activation with parameters on the meta device
                    own = None
                if own is None or isinstance(own, torch.Tensor) and torch.allclose(out.double(), own.double(),
                                                                                   rtol=1e-6, atol=1e-8):
                    return facts, ""       # down(act(up(x))) with an activation fused_mlp does not compute
    return None, (f"its forward is not {down}(act({up}(x))) with any of {', '.join(MLP_ACTIVATIONS)}"
                  + (f" or its {found[0]}" if found else ""))


@kind("MLP", "a plain (non-gated) MLP down(act(up(x))): up_proj/down_proj, fc1/fc2, c_fc/c_proj, "
      "dense_h_to_4h/dense_4h_to_h ...; activation probed (gelu, gelu_tanh, relu, relu2, silu, quick_gelu)")
def plain_mlp(m: Any) -> dict | None:
    return mlp_probe(m)[0]


@kind("Attention", "q/k/v projections (or fused qkv_proj / query_key_value) and an output projection "
      "(o_proj, dense or out_proj) with rotary embeddings (layout probed), optional q_norm/k_norm")
def attention(m: Any) -> dict | None:
    from .rotary import attention_facts      # projection names, rotary layout and input (issue 25)

    return attention_facts(m, rmsnorm, linear_like)


@kind("CausalLM", "a causal LM head model: self.model (or its base_model_prefix), self.lm_head and a loss_function")
def causal_lm(m: Any) -> dict | None:
    from .loss_path import looks_causal_lm     # the body under `model` or the base_model_prefix (GPT-2: transformer)

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


# ===========================================================================================


# Mixture of experts (issue 24): the experts module and the sparse MoE block.
# ==================================================================================================
EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_clamp")


def expert_gate_reference(gate: Any, up: Any, activation: str, alpha: float | None = None,
                          limit: float | None = None) -> Any:
    """act(gate) * up of one expert's projections in plain torch (any dtype); ``swiglu_clamp`` is
    gpt-oss's ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``."""
    torch = _torch()
    F = torch.nn.functional
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_clamp":
        g = gate.clamp(max=limit)
        u = up.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    raise ValueError(f"unknown expert activation {activation!r}")


def experts_reference(hidden: Any, top_k_index: Any, top_k_weights: Any, gate_up: Any, down: Any,
                      gate_up_bias: Any, down_bias: Any, facts: Mapping[str, Any]) -> Any:
    """What an ``Experts`` module with ``facts`` computes, written densely (every expert on every
    token, masked by the routing): ``sum_k w[t,k] * (act(x W_gu[e] + b) W_d[e] + b_d)`` with
    ``e = top_k_index[t,k]``.  Plain torch, differentiable, any dtype; the test reference and the
    probe's candidate."""
    torch = _torch()
    E = gate_up.shape[0]
    gu_w = gate_up if facts["transposed"] else gate_up.transpose(1, 2)        # [E, H, 2I]
    d_w = down if facts["transposed"] else down.transpose(1, 2)                # [E, I, H]
    gu = torch.einsum("th,ehn->ten", hidden, gu_w)                             # [T, E, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias
    if facts["layout"] == "interleaved":
        gate, up = gu[..., ::2], gu[..., 1::2]
    else:
        gate, up = gu.chunk(2, dim=-1)
    h = expert_gate_reference(gate, up, facts["activation"], facts.get("alpha"), facts.get("limit"))
    y = torch.einsum("tei,eih->teh", h, d_w)                                   # [T, E, H]
    if down_bias is not None:
        y = y + down_bias
    dense_w = torch.zeros(hidden.shape[0], E, dtype=top_k_weights.dtype, device=hidden.device)
    dense_w = dense_w.scatter_add(1, top_k_index.long(), top_k_weights)
    return torch.einsum("te,teh->th", dense_w.to(y.dtype), y)


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


def _expert_forward(m: Any):
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
    fwd = _expert_forward(m)
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
        params = list(inspect.signature(_expert_forward(m)).parameters.values())[1:]
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


MOE_ROUTER_NAMES = ("gate", "router")
MOE_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")


def router_scaling(r: Any) -> float:
    """A router's ``routed_scaling_factor`` (1.0 when it has none)."""
    sf = r.__dict__.get("routed_scaling_factor", 1.0)
    return float(sf) if isinstance(sf, (int, float)) and not isinstance(sf, bool) and sf else 1.0


def router_groups(r: Any) -> tuple[int | None, int | None]:
    """(n_group, topk_group) a router holds (``num_group`` or ``n_group``; None when absent)."""
    ng = r.__dict__.get("num_group")
    ng = ng if ng is not None else r.__dict__.get("n_group")
    tg = r.__dict__.get("topk_group")
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0      # noqa: E731
    return (ng if ok(ng) else None), (tg if ok(tg) else None)


def grouped_route(scores: Any, choice: Any, top_k: int, n_group: int, topk_group: int, group_score: str) -> Any:
    """Top-k indices of a grouped router (DeepSeek-V2 group_limited_greedy, DeepSeek-V3 / GLM-4.5 /
    dots1 noaux_tc), written as transformers writes it: group score = the top-2 sum (``"top2"``) or the
    max (``"max"``) of ``choice`` within each of ``n_group`` equal groups; the ``topk_group`` best groups
    kept (the other experts masked); ``torch.topk(sorted=False)`` of the masked choice."""
    torch = _torch()
    E = choice.shape[-1]
    grouped = choice.view(-1, n_group, E // n_group)
    gs = grouped.topk(2, dim=-1)[0].sum(-1) if group_score == "top2" else grouped.max(dim=-1).values
    gidx = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    fill = float("-inf") if group_score == "top2" else 0.0
    return torch.topk(choice.masked_fill(~smask.bool(), fill), k=top_k, dim=-1, sorted=False)[1]


def _router_candidates(r: Any, x: Any, wt: Any, bias: Any, facts: Mapping[str, Any]):
    """(name, extra facts, weights, indices) of each routing formula for ``r``'s attributes."""
    torch = _torch()
    logits = torch.nn.functional.linear(x, wt, bias)
    k = facts["top_k"]
    E = logits.shape[-1]
    sf = router_scaling(r)
    scaled = {"scaling": sf} if sf != 1.0 else {}
    out = []
    probs = torch.softmax(logits, dim=-1)
    v, ix = torch.topk(probs, k, dim=-1)
    out.append(("softmax_topk", {"norm_topk": False, **scaled}, v * sf, ix))
    out.append(("softmax_topk", {"norm_topk": True, **scaled}, v / v.sum(-1, keepdim=True) * sf, ix))
    v2, ix2 = torch.topk(logits, k, dim=-1)
    out.append(("topk_softmax", {"norm_topk": True}, torch.softmax(v2, dim=-1), ix2))
    ng, tg = router_groups(r)
    corr = getattr(r, "e_score_correction_bias", None)
    if isinstance(corr, torch.Tensor):
        # DeepSeek-V3 / GLM-4.5 / dots1 (noaux_tc): sigmoid scores, the correction bias for the choice only,
        # groups by their top-2 sum (one group when the router names none)
        ng, tg = ng or 1, tg or ng or 1
        if E % ng == 0 and E // ng >= 2 and tg <= ng:
            scores = logits.sigmoid()
            ix3 = grouped_route(scores, scores + facts["_corr"], k, ng, tg, "top2")
            w3 = scores.gather(1, ix3)
            for norm in (True, False):
                ww = w3 / (w3.sum(-1, keepdim=True) + 1e-20) if norm else w3
                out.append(("sigmoid_grouped", {"norm_topk": norm, "n_group": ng, "topk_group": tg,
                                                "scaling": sf}, ww * sf, ix3))
            # Kolibri1: the bias added to the logits for the choice (sigmoid is monotone, but the bias is not
            # added after it), the weights the sigmoid of the chosen logits, renormalised without an epsilon
            ix5 = grouped_route(logits, logits + facts["_corr"], k, ng, tg, "top2")
            w5 = logits.gather(1, ix5).sigmoid()
            for norm in (True, False):
                ww = w5 / w5.sum(-1, keepdim=True) if norm else w5
                out.append(("sigmoid_grouped", {"norm_topk": norm, "n_group": ng, "topk_group": tg, "scaling": sf,
                                                "bias_on": "logits", "norm_eps": 0.0}, ww * sf, ix5))
    elif (ng is not None and tg is not None and E % ng == 0 and tg < ng
          and r.__dict__.get("topk_method") != "greedy"):
        # DeepSeek-V2 group_limited_greedy: softmax scores, groups by their max, no renormalisation; tried
        # first (an ungrouped softmax top-k can match a grouped router on the probe's tokens by chance)
        ix4 = grouped_route(probs, probs, k, ng, tg, "max")
        w4 = probs.gather(1, ix4)
        out.insert(0, ("softmax_grouped", {"norm_topk": False, "n_group": ng, "topk_group": tg, "scaling": sf},
                       w4 * sf, ix4))
    return out


def _router_roles(out: Any, k: int) -> tuple[Any, Any] | None:
    """(top-k weights, top-k indices) among a router's three outputs: the indices are the one integer
    tensor, wherever it stands (transformers 5.17's GraniteMoe router returns (index, weights, logits),
    5.24's (logits, weights, index)); the weights stand in the middle in both."""
    torch = _torch()
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    ints = [t for t in out if not t.is_floating_point()]
    w = out[1]
    if len(ints) != 1 or not w.is_floating_point() or w.dim() != 2 or w.shape[-1] != k:
        return None
    return w, ints[0]


def _int_top_k(v: Any, E: int) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= E else None


def _router_width(r: Any, E: int) -> int | None:
    """How many classes a router without an own [experts, hidden] weight scores: the narrowest output
    of its 2-D weights (own or of Linear children) that is ``E`` or more (a skip expert, shared experts
    scored alongside); None when no weight of the router covers the experts."""
    torch = _torch()
    widths = [int(p.shape[0]) for _, p in r.named_parameters() if isinstance(p, torch.Tensor) and p.dim() == 2]
    return min((w for w in widths if w >= E), default=None)


@kind("MoEBlock", "a sparse MoE block: a router (softmax or sigmoid, top-k, DeepSeek-V3 grouped top-k with "
      "score-correction bias; probed), an Experts module and optional shared experts")
def moe_block(m: Any) -> dict | None:
    torch = _torch()
    ex = m._modules.get("experts")
    if ex is None or _expert_params(ex) is None:
        return None
    fe = experts(ex)
    if not fe:
        return None
    rname = next((n for n in MOE_ROUTER_NAMES if isinstance(m._modules.get(n), torch.nn.Module)), None)
    if rname is None:
        return None
    r = m._modules[rname]
    w = r._parameters.get("weight")
    if w is None:
        lin = linear_like(r)
        w = lin.weight if lin is not None else None
    probe = isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == fe["experts"]
    if not probe:
        # a router whose scores come from elsewhere than its own [experts, hidden] weight: a Linear
        # child (AFMoE's gate, HunYuan's wg), a router MLP (ZAYA: experts + 1 classes, the last a skip
        # expert), shared experts scored with the routed ones (Inkling: [experts + shared, hidden]).
        # Its formula is not probed (scoring "unknown"); the block is still a MoE block.
        width = _router_width(r, fe["experts"])
        if width is None:
            return None
    k = _int_top_k(r.__dict__.get("top_k"), fe["experts"]) or _int_top_k(m.__dict__.get("top_k"), fe["experts"])
    cfg = getattr(m, "config", None) or getattr(r, "config", None)
    if k is None:
        k = config_top_k(cfg, fe["experts"]) or fe.get("top_k")
    if k is None:
        return None
    facts: dict[str, Any] = {"experts": fe["experts"], "top_k": int(k), "hidden": fe["hidden"], "router": rname,
                             "scoring": "unknown", "norm_topk": None}
    if not probe:
        facts["router_width"] = width
        return _moe_block_rest(m, fe, facts)
    E, h = fe["experts"], int(w.shape[1])
    rf = router(r) if not isinstance(r, torch.nn.Linear) else None
    if rf and rf["scoring"] != "unknown" and rf["experts"] == E and rf["top_k"] == int(k):
        # the router is a Router: its probed routing is the block's (one probe, so inspect's two rows agree)
        facts.update({a: rf[a] for a in ROUTER_ROUTING_FACTS if a in rf})
        return _moe_block_rest(m, fe, facts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, h, generator=g, dtype=torch.float64)
    # logits of unit scale: an unscaled [E, h] weight at h = 2048 gives logits ~45 whose softmax underflows
    # to exact 0/1 ties (Qwen3-30B-A3B's block read "scoring=unknown")
    wt = torch.randn(E, h, generator=g, dtype=torch.float64) / h ** 0.5
    params = {"weight": wt}
    b = r._parameters.get("bias")
    bt = None
    if isinstance(b, torch.Tensor):
        bt = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
        params["bias"] = bt
    corr = torch.randn(E, generator=g, dtype=torch.float64) * 0.05
    facts["_corr"] = corr
    if isinstance(r, torch.nn.Linear):
        facts["scoring"] = "linear"     # the block's own forward does the routing (not probed)
    else:
        clone = stand_in(r, **params)
        if isinstance(getattr(r, "e_score_correction_bias", None), torch.Tensor):
            clone._buffers["e_score_correction_bias"] = corr
        try:
            with torch.no_grad():
                out = type(r).forward(clone, x.clone())
        except Exception:
            out = None
        roles = _router_roles(out, int(k))
        if roles is not None:
            ow, oi = roles
            for name, extra, cw, ci in _router_candidates(r, x, wt, bt, facts):
                if ci.shape == oi.shape and torch.equal(torch.sort(ci, -1)[0], torch.sort(oi, -1)[0]):
                    order_o, order_c = torch.argsort(oi, -1), torch.argsort(ci, -1)
                    if torch.allclose(ow.double().gather(1, order_o), cw.gather(1, order_c), rtol=1e-6, atol=1e-9):
                        facts["scoring"] = name
                        facts.update(extra)
                        break
    facts.pop("_corr")
    return _moe_block_rest(m, fe, facts)


def _moe_block_rest(m: Any, fe: Mapping[str, Any], facts: dict) -> dict:
    torch = _torch()
    shared = next((n for n in MOE_SHARED_NAMES if isinstance(m._modules.get(n), torch.nn.Module)), None)
    facts["shared"] = shared
    facts["shared_gate"] = isinstance(m._modules.get("shared_expert_gate"), torch.nn.Module)
    facts["activation"] = fe["activation"]
    return facts


# ---- the router module (issue 24: fused_router) ---------------------------------------------------
ROUTER_SCORINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "softmax_grouped", "unknown")
# the facts that say how a router routes (shared by the Router and MoEBlock kinds)
ROUTER_ROUTING_FACTS = ("scoring", "norm_topk", "n_group", "topk_group", "scaling", "bias_on", "norm_eps")
ROUTER_ROLES = ("logits", "weights", "index")


def router_reference(logits: Any, top_k: int, scoring: str, norm_topk: bool, *, bias: Any = None,
                     n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                     norm_eps: float = 1e-20, bias_on: str = "scores") -> tuple[Any, Any]:
    """(top-k weights, top-k indices) of a router from its logits, in plain torch at the logits' precision
    (float64 in the tests): ``softmax_topk`` = softmax over all experts, the top-k of it, renormalised
    over the k when ``norm_topk``; ``topk_softmax`` = the top-k logits, softmax over those k;
    ``sigmoid_grouped`` (DeepSeek-V3 / GLM-4.5 / dots1) = sigmoid scores s, the choice c = s + ``bias``,
    groups ranked by the sum of their top-2 c, the best ``topk_group`` of ``n_group`` kept, the top-k of c
    among them, weights s (renormalised with ``+ norm_eps`` when ``norm_topk``; ``bias_on="logits"``: the
    bias added to the logits instead, Kolibri1's, with ``norm_eps`` 0); ``softmax_grouped``
    (DeepSeek-V2 group_limited_greedy) = the same with softmax scores, groups ranked by their max, no
    bias; every scoring times ``scaling``.  Indices by descending value (logit, or c), ties to the lower
    index (a stable sort: fused_router's rule; ``torch.topk`` breaks ties its own way, which differs
    between its CPU and GPU kernels -- tied experts have equal weights, so only which of them is chosen
    can differ)."""
    torch = _torch()
    if scoring in ("sigmoid_grouped", "softmax_grouped"):
        s = logits.sigmoid() if scoring == "sigmoid_grouped" else torch.softmax(logits, dim=-1)
        base = logits if bias_on == "logits" else s
        c = base + bias.to(s.dtype) if bias is not None else base
        E = logits.shape[-1]
        if topk_group < n_group:
            grouped = c.reshape(*c.shape[:-1], n_group, E // n_group)
            gv = torch.sort(grouped, dim=-1, descending=True)[0]
            gs = gv[..., :2].sum(-1) if scoring == "sigmoid_grouped" else gv[..., 0]
            gix = torch.sort(gs, dim=-1, descending=True, stable=True)[1][..., :topk_group]
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter(-1, gix, True)
            keep = keep.unsqueeze(-1).expand(*gs.shape, E // n_group).reshape(c.shape)
            c = c.masked_fill(~keep, float("-inf"))
        ix = torch.sort(c, dim=-1, descending=True, stable=True)[1][..., :top_k]
        w = s.gather(-1, ix)
        if norm_topk:
            w = w / (w.sum(-1, keepdim=True) + norm_eps)
        return w * scaling, ix
    v, ix = torch.sort(logits, dim=-1, descending=True, stable=True)
    v, ix = v[..., :top_k], ix[..., :top_k]
    if scoring == "softmax_topk":
        w = torch.softmax(logits, dim=-1).gather(-1, ix)
        if norm_topk:
            w = w / w.sum(-1, keepdim=True)
    elif scoring == "topk_softmax":
        w = torch.softmax(v, dim=-1)
    else:
        raise ValueError(f"router_reference: no reference for scoring {scoring!r}")
    return w * scaling, ix


def router_holds(m: Any) -> str:
    """What a router holds that bears on its routing, for a refusal: its routing attributes (top_k,
    norm_topk_prob, routed_scaling_factor, n_group / topk_group, topk_method, a score-correction bias,
    ...) as ``name=value``."""
    torch = _torch()
    held = []
    for a in ("top_k", "norm_topk_prob", "routed_scaling_factor", "num_group", "n_group", "topk_group",
              "topk_method", "scoring_func", "score_func", "router_jitter_noise", "jitter_noise"):
        v = m.__dict__.get(a)
        if isinstance(v, (bool, int, float, str)):
            held.append(f"{a}={v}")
    for a in ("e_score_correction_bias", "expert_bias"):
        t = getattr(m, a, None)
        if isinstance(t, torch.Tensor):
            held.append(f"{a} {list(t.shape)}")
    return ", ".join(held) or "no routing attributes"


def _router_flattens(m: Any, wt: Any, bt: Any, corr: Any, x: Any, r32: Any) -> bool:
    """Whether ``m``'s forward takes a [batch, seq, hidden] input as its [batch * seq, hidden] rows
    (``hidden_states.view(-1, hidden_dim)``: DeepSeek-V3's block hands the router the 3-D states)."""
    torch = _torch()
    params = {"weight": wt}
    if bt is not None:
        params["bias"] = bt
    clone = stand_in(m, **params)
    if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
        clone._buffers["e_score_correction_bias"] = corr.clone()
    try:
        with torch.no_grad():
            out = type(m).forward(clone, x.view(3, 3, -1))
    except Exception:
        return False
    return _same_outputs(out, r32)


def _same_outputs(out: Any, r32: Any) -> bool:
    torch = _torch()
    order = r32[3].split("_")
    ref = {"logits": r32[0], "weights": r32[1], "index": r32[2]}
    return (isinstance(out, tuple) and len(out) == 3
            and all(isinstance(t, torch.Tensor) and t.shape == ref[n].shape and torch.equal(t, ref[n])
                    for t, n in zip(out, order)))


@kind("Router", "a mixture-of-experts router: a [experts, hidden] weight (optional bias) and a top_k, "
      "forward(hidden) -> router logits, top-k weights, top-k indices (in any order); scoring (softmax then "
      "top-k with or without renormalising, top-k then softmax, DeepSeek-V2's group-limited softmax, DeepSeek-V3 "
      "/ GLM-4.5's sigmoid grouped top-k with score-correction bias; unknown otherwise), groups, routed "
      "scaling and output dtypes probed")
def router(m: Any) -> dict | None:
    torch = _torch()
    k = m.__dict__.get("top_k")
    w = m._parameters.get("weight")
    if (not isinstance(k, int) or isinstance(k, bool) or not isinstance(w, torch.Tensor) or w.dim() != 2
            or m._modules or isinstance(m, (torch.nn.Linear, torch.nn.Embedding))):
        return None
    E, H = int(w.shape[0]), int(w.shape[1])
    if not 0 < k < E or H < 1:
        return None
    b = m._parameters.get("bias")
    if b is not None and (b.dim() != 1 or b.shape[0] != E):
        return None
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, H, generator=g)
    wt = torch.randn(E, H, generator=g) / H ** 0.5
    bt = torch.randn(E, generator=g) * 0.1 if b is not None else None
    corr = torch.randn(E, generator=g) * 0.05

    def run(dt):
        params = {"weight": wt.to(dt)}
        if bt is not None:
            params["bias"] = bt.to(dt)
        clone = stand_in(m, **params)
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
            clone._buffers["e_score_correction_bias"] = corr.clone()
        try:
            with torch.no_grad():
                out = type(m).forward(clone, x.to(dt))
        except Exception:
            return None
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
            return None
        ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
        lin = torch.nn.functional.linear
        ref = lin(x.to(dt), wt.to(dt), bt.to(dt) if bt is not None else None)      # in the input dtype
        ref32 = lin(x.to(dt).float(), wt.to(dt).float(), bt.to(dt).float() if bt is not None else None)
        lg = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape == (9, E)
              and (torch.equal(t, ref.to(t.dtype)) or torch.equal(t, ref32.to(t.dtype)))]
        if len(ints) != 1 or len(lg) != 1 or out[ints[0]].shape != (9, k):
            return None
        wi = 3 - ints[0] - lg[0]
        if wi == ints[0] or wi == lg[0] or out[wi].shape != (9, k) or not out[wi].is_floating_point():
            return None
        order = [""] * 3
        order[lg[0]], order[wi], order[ints[0]] = "logits", "weights", "index"
        linear = "input" if torch.equal(out[lg[0]], ref.to(out[lg[0]].dtype)) else "float32"
        return out[lg[0]], out[wi], out[ints[0]], "_".join(order), linear      # e.g. "logits_weights_index"

    r32, rb = run(torch.float32), run(torch.bfloat16)
    if r32 is None or rb is None or r32[3] != rb[3]:
        return None
    facts: dict[str, Any] = {"experts": E, "hidden": H, "top_k": int(k), "bias": b is not None, "order": r32[3],
                             "scoring": None, "norm_topk": None, "_corr": corr.double(),
                             "flattens": _router_flattens(m, wt, bt, corr, x, r32)}
    ow, oi = r32[1], r32[2]
    for name, extra, cw, ci in _router_candidates(m, x.double(), wt.double(), bt.double() if bt is not None else None,
                                                  facts):
        if ci.shape == oi.shape and torch.equal(torch.sort(ci, -1)[0], torch.sort(oi, -1)[0]):
            order_o, order_c = torch.argsort(oi, -1), torch.argsort(ci, -1)
            if torch.allclose(ow.double().gather(1, order_o), cw.gather(1, order_c), rtol=1e-5, atol=1e-7):
                facts["scoring"] = name
                facts.update(extra)
                break
    facts.pop("_corr")
    if facts["scoring"] is None:
        # a router by structure whose weights no formula above gives: a Router of scoring "unknown", so a
        # rule naming it is refused with what it holds (fused_router's misfit) rather than fitting no kind
        facts.update(scoring="unknown", routing=router_holds(m))
    lb, wb = rb[0], rb[1]
    # dtypes (bf16 probe): the logits in the input dtype or float32 (and computed in which), the weights
    # in the logits' dtype (Qwen3-MoE: .to(router_logits.dtype)), float32 (Mixtral) or the input's (GraniteMoe)
    facts["linear"] = rb[4]
    facts["logits_dtype"] = "float32" if lb.dtype == torch.float32 else "input"
    facts["weights_dtype"] = ("logits" if wb.dtype == lb.dtype else "float32" if wb.dtype == torch.float32
                              else "input")
    return facts


# ---- what each kind needs, structurally (for errors that say why a module fits no kind) ----------------
# (helper "families"; read by patchdsl.select when a rule's modules fit no kind)
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
