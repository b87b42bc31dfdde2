"""Float64 reference formulas of what the recognised modules compute, in plain torch (any dtype,
differentiable): the recognisers' candidates when they probe, and the references of the tests and benches."""

from __future__ import annotations

from typing import Any, Mapping

from .modules import _torch


def mlp_activation_reference(name: str):
    """The activation ``name`` of :data:`MLP_ACTIVATIONS` in plain torch (any dtype, differentiable)."""
    torch = _torch()
    F = torch.nn.functional
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu,
            "relu2": lambda t: F.relu(t).square(), "silu": F.silu,
            "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}[name]



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


# ---- attention: HF's arithmetic, in the (batch, seq, heads, head_dim) layout -------------------------

def reference_rope(q, k, cos, sin):
    """HF's apply_rotary_pos_emb (rotate_half, partial rotary = cos's last dim) on (b, s, h, d)."""
    import torch

    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    r = cos.shape[-1]

    def rot(x):
        xr, xp = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        y = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat([y, xp], dim=-1) if xp.shape[-1] else y

    return rot(q), rot(k)


def reference_rmsnorm(x, w, eps: float, offset: float, casting: str):
    """RMSNorm over the last dim with HF's Llama or Gemma cast order."""
    import torch

    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (xn * (offset + w.float())).to(x.dtype)
    return ((offset + w) if offset else w) * xn.to(x.dtype)
