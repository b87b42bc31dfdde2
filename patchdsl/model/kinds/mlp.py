"""MLP kinds: the gated SwiGLU / GeGLU (separate, fused or other-named gate/up projections) and the
plain MLP down(act(up(x))), activation probed on a float64 stand-in."""

from __future__ import annotations

import copy
from typing import Any, Mapping

from ..modules import _torch, linear_like
from ..reference import mlp_activation_reference
from .probe import _activation, _run_class_forward, stand_in
from .registry import kind


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


