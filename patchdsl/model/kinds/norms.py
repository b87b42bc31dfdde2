"""Norm kinds: RMSNorm, GatedRMSNorm (linear-attention output norms) and LayerNorm, probed for their
offset, cast order and activation."""

from __future__ import annotations

from typing import Any

from ..modules import _torch
from .probe import _eps, _run_class_forward, stand_in
from .registry import kind


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


