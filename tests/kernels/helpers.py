"""Shared helpers for kernel tests: build a kernel for given facts, compare with float64.

Tolerances are on the relative Frobenius error ||out - ref|| / ||ref|| against a float64
reference computed from the same (already rounded) inputs.  Rounding one value to the dtype
costs at most u = 2^-24 (fp32), 2^-11 (fp16), 2^-8 (bf16) relative; the RMS of that error over
many values is about u/sqrt(3).  A fused kernel rounds its output once, and sometimes an
intermediate once more (HF's Llama RMSNorm casts x*rstd before scaling), so the bars are a
small multiple of u:

    fp32: 1e-5   (~170 u: fp32 accumulation order over rows up to ~10^5 elements)
    fp16: 2e-3   (4 u)
    bf16: 1.6e-2 (4 u)

fp16 has a 5-bit exponent: a mean-reduced cross-entropy gradient (softmax / N, about 1 / (V N))
falls below fp16's smallest normal (6.1e-5) at real sizes and underflows, in any fp16
implementation.  Where that happens the bar is also allowed to be twice the error of PyTorch's own
fp16 path on the same inputs (``peer``), the way ``patchdsl verify`` judges a patched model by the
unpatched one's error.
"""

from __future__ import annotations

import os

import torch

from patchdsl.codegen import KernelKey, load_kernel
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
TARGET = "cuda" if ON_GPU else "interpreter"


def kernel_for(op_name: str, kind: str, facts: dict, dtype: str, flags: dict | None = None,
               w_dtype: str | None = None):
    """Render, cache and import the kernel module ``op_name`` generates for these facts."""
    op = get_op(op_name)
    assert op is not None, op_name
    f = op.default_flags()
    f.update(flags or {})
    info = ModuleInfo("test", "Test", (), {kind: facts}, dtype=w_dtype or dtype)
    params = op.key_params(info, f, dtype, TARGET)
    key = KernelKey.for_op(op, params)
    return load_kernel(key)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in output"
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


PEER_FACTOR = 2.0


def assert_close(out, ref, dtype: str, what: str = "", factor: float = 1.0, peer=None):
    """``peer``: PyTorch's own result in ``dtype`` (fp16 underflow cases, see above)."""
    e = rel_err(out, ref)
    tol = TOL[dtype] * factor
    note = ""
    if peer is not None:
        pe = rel_err(peer, ref)
        if PEER_FACTOR * pe > tol:
            tol, note = PEER_FACTOR * pe, f", {PEER_FACTOR:g} x PyTorch's own {dtype} error {pe:.3g}"
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol:.3g} ({dtype}{note})"


def sizes(cpu: list, gpu: list) -> list:
    """Small shapes on the interpreter, real ones on the GPU."""
    return gpu if ON_GPU else cpu


def assert_kernel_globals_constexpr(mod, min_kernels: int = 1) -> None:
    """Compiled Triton reads module globals inside a @triton.jit function only as tl.constexpr
    (the interpreter does not care), so check every global each jitted function uses."""
    import types

    import triton.language as tl

    kinds = ("JITFunction", "InterpretedFunction")
    jitted = {n: v for n, v in vars(mod).items() if type(v).__name__ in kinds and hasattr(v, "fn")}
    assert len(jitted) >= min_kernels
    for name, fn in jitted.items():
        for g in fn.fn.__code__.co_names:
            if g not in vars(mod):
                continue
            v = vars(mod)[g]
            assert isinstance(v, (tl.constexpr, types.ModuleType)) or type(v).__name__ in kinds, \
                f"{name} reads global {g} = {v!r}, which is not a tl.constexpr"


def gjsd_per_token(s, t, beta: float):
    """TRL's generalised JSD per token from student / teacher log-probabilities ``s``, ``t`` (last
    dimension the vocab): beta 0 = KL(teacher || student), 1 = KL(student || teacher), else
    beta KL(t || m) + (1 - beta) KL(s || m) with m = beta t + (1 - beta) s."""
    import math

    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def ce_reference(x, y, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0, reduction="mean",
               num_items=None):
    """Float64 loss with HF's reduction rules (sum / num_items when given), torch's smoothing."""
    x = x.double()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, -1)
    valid = y != ignore_index
    tgt = x.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    per = (1 - label_smoothing) * (lse - tgt) + label_smoothing * (lse - x.mean(-1)) + z_loss * lse * lse
    per = torch.where(valid, per, torch.zeros_like(per))
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    if num_items is not None:
        return per.sum() / (num_items.double() if torch.is_tensor(num_items) else num_items)
    return per.sum() / valid.sum().clamp_min(1)


def rope_fwd_bwd(kern, q, k, cos, sin, dq, dk):
    """(q out, k out, dq, dk) of a generated rope module's ``rope`` on copies of q and k."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = kern.rope(q, k, cos, sin)
    torch.autograd.backward((qo, ko), (dq, dk))
    return qo, ko, q.grad, k.grad


def assert_no_worse_than_module(names, ref, hf, got, dtype) -> None:
    """Each of the patched module's results (``got``) is within max(4 x the unpatched module's own
    error, TOL) of the float64 reference ``ref``; ``hf``: the unpatched module's results in ``dtype``."""
    tol = TOL["fp32" if dtype == torch.float32 else "bf16"]
    for name, r, a, b in zip(names, ref, hf, got):
        e_hf, e = rel_err(a, r), rel_err(b, r)
        assert e <= max(4 * e_hf, tol), (name, e, e_hf)


def tiny_family(model_type: str, seed: int = 0):
    """A tiny random-weight model of any installed family, as the census builds it (fp32, CPU), with
    transformers' warnings and log lines about the tiny config silenced."""
    from patchdsl.model.tiny import build, quiet, tiny_family_config

    with quiet():
        return build(tiny_family_config(model_type), seed)
