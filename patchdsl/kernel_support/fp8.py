"""fp8 quantisation for grouped (per-expert) matmuls: what generated expert kernels import.

The recipe is ``fp8_linear``'s ``rowwise`` (torchao.float8's recipe of that name): every operand of
every matmul in e4m3, one scale per row along that matmul's reduction dimension, the scale
``448 / amax`` rounded down to a power of two (so quantising and dequantising are exact shifts of
the exponent).  A NaN anywhere in a row counts as an infinite amax: the row's scale is 0 and its
dequantisation factor infinite, so every output it reaches is NaN, never a finite value.

Three quantisers, each one read of the operand and one write of its fp8 copy:

* :func:`quant_rows`: rows of a 2-D tensor (an activation per token slot; a 3-D weight
  ``[E, N, K]`` flattened to ``[E * N, K]``, one scale per expert and output channel);
* :func:`quant_groups_t`: the operands of a weight gradient, ``dW[e] = A[rows of e]^T B[rows of e]``:
  the reduction runs over each expert's rows, so each column gets one scale per expert (the amax
  over that expert's rows) and the result is stored transposed, ``[C, rows]``, each expert's rows
  zero-padded to a multiple of 16 (the fp8 grouped GEMM reads every group from a 16-byte boundary);
* :func:`quantise`: the same numerics in torch, the reference the tests hold the kernels to.

:func:`scaled_grouped_mm` multiplies: ``torch._scaled_grouped_mm`` (CUTLASS, sm_90), or with
``emulate`` an fp32 matmul of the dequantised values per group (the recipe's numerics on the CPU).
Under Triton's interpreter the kernels store the scaled, clamped fp32 values and torch casts them
(the interpreter's own fp32 -> fp8 cast rounds wrongly at binade boundaries).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import launch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = 448.0
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}
AMAX_EPS = 1e-12
GROUP_ALIGN = 16                 # rows of each expert in a weight gradient's fp8 operands: a multiple of this


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def quantise(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(``t`` in e4m3, dequantisation factors): one power-of-two scale per slice along ``dim`` (kept
    as a size-1 dimension, so the factor broadcasts against ``t``); NaN gives scale 0 (see above)."""
    a = t.detach().float().abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    amax = a.amax(dim=dim, keepdim=True).clamp_min(AMAX_EPS)
    scale = FP8_MAX / amax
    _, e = torch.frexp(scale)                    # 2^floor(log2(scale)): scale = m 2^e, m in [0.5, 1)
    scale = torch.where(scale > 0, torch.ldexp(torch.ones_like(scale), e - 1), scale)
    v = t.float() * scale
    q = torch.where(torch.isnan(v), v, v.clamp(-FP8_MAX, FP8_MAX)).to(E4M3)
    return q, scale.reciprocal()


@triton.jit
def pow2_floor(v):
    """2^floor(log2(v)) of positive normal fp32 ``v``, exactly: its exponent bits alone."""
    return (v.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def mag(x):
    """|x| for an amax, NaN counted as +inf (a max would drop it)."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def clamp_keep_nan(v, FP8MAX: tl.constexpr):
    return tl.where(v != v, v, tl.minimum(tl.maximum(v, -FP8MAX), FP8MAX))


@triton.jit
def _quant_rows_kernel(X, Q, INV, M, C, stride_x, FP8MAX: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr):
    """BR rows of X [M, C]: each row's amax, power-of-two scale, and scaled, clamped values into
    Q [M, C] (BR is 1 on a GPU, where a row per program keeps the loads wide; more rows per program
    under the interpreter, whose cost is per program)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = rows < M
    offs = tl.arange(0, BLOCK)
    xp = X + rows[:, None] * stride_x
    amax = tl.zeros((BR, BLOCK), dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        m = rm[:, None] & ((c0 + offs) < C)[None, :]
        amax = tl.maximum(amax, mag(tl.load(xp + c0 + offs[None, :], mask=m, other=0.0).to(tl.float32)))
    scale = pow2_floor(FP8MAX / tl.maximum(tl.max(amax, axis=1), 1e-12))
    for c0 in range(0, C, BLOCK):
        m = rm[:, None] & ((c0 + offs) < C)[None, :]
        x = tl.load(xp + c0 + offs[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(Q + rows[:, None] * C + c0 + offs[None, :],
                 clamp_keep_nan(x * scale[:, None], FP8MAX).to(Q.dtype.element_ty), mask=m)
    tl.store(INV + rows, 1.0 / scale, mask=rm)


@triton.jit
def _quant_groups_t_kernel(X, OFFS, OFFS_P, QT, INV, C, SP, E: tl.constexpr, FP8MAX: tl.constexpr,
                           BR: tl.constexpr, BC: tl.constexpr):
    """Expert e = program_id(0), BC columns of X [rows, C] (rows sorted by expert, OFFS their ends):
    the columns' amax over e's rows, then the rows scaled, clamped and stored transposed into
    QT [C, SP] at e's padded place (OFFS_P: the padded ends), the padding zeros; INV[e * C + c]."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < C
    lo = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    hi = tl.load(OFFS + e)
    lo_p = tl.load(OFFS_P + e - 1, mask=e > 0, other=0)
    hi_p = tl.load(OFFS_P + e)
    acc = tl.zeros((BC,), dtype=tl.float32)
    for r0 in range(lo, hi, BR):
        rows = r0 + tl.arange(0, BR)
        x = tl.load(X + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=(rows < hi)[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(mag(x), axis=0))
    scale = pow2_floor(FP8MAX / tl.maximum(acc, 1e-12))
    for r0 in range(lo_p, hi_p, BR):
        dst = r0 + tl.arange(0, BR)
        src = lo + (dst - lo_p)
        x = tl.load(X + src.to(tl.int64)[:, None] * C + cols[None, :], mask=(src < hi)[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        q = clamp_keep_nan(x * scale[None, :], FP8MAX)
        tl.store(QT + cols.to(tl.int64)[:, None] * SP + dst[None, :], tl.trans(q).to(QT.dtype.element_ty),
                 mask=cm[:, None] & (dst < hi_p)[None, :])
    tl.store(INV + e.to(tl.int64) * C + cols, 1.0 / scale, mask=cm)


def _store_dtype(fp8: torch.dtype = E4M3) -> torch.dtype:
    return torch.float32 if _interpreted() else fp8


def quant_rows(t: torch.Tensor, fp8: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise(t, -1)`` of ``t`` [..., C] in one kernel: (q [..., C] in ``fp8`` (e4m3 unless told),
    inv [...] fp32)."""
    lead, C = t.shape[:-1], t.shape[-1]
    t2 = t.reshape(-1, C)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    M = t2.shape[0]
    q = torch.empty((M, C), device=t.device, dtype=_store_dtype(fp8))
    inv = torch.empty((M,), device=t.device, dtype=torch.float32)
    if M:
        block = min(4096, triton.next_power_of_2(max(C, 16)))
        br = 64 if _interpreted() else 1
        launch(_quant_rows_kernel, (triton.cdiv(M, br),), t2, q, inv, M, C, t2.stride(0), FP8MAX=FORMAT_MAX[fp8],
               BR=br, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return (q if q.dtype is fp8 else q.to(fp8)).view(*lead, C), inv.view(lead)


def padded_offsets(offs: torch.Tensor, align: int = GROUP_ALIGN) -> torch.Tensor:
    """Each group's end when every group's row count is rounded up to a multiple of ``align``
    (int32, cumulative; on the device, no host sync)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum((counts + align - 1) // align * align, 0).to(torch.int32)


def quant_groups_t(x: torch.Tensor, offs: torch.Tensor, offs_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 operand of a weight gradient from ``x`` [rows, C] sorted by expert (``offs``: the
    groups' ends, ``offs_p``: :func:`padded_offsets`): (qT [C, SP] e4m3, each expert's rows at its
    padded place, zeros between; inv [E * C] fp32, expert-major).  SP = rows + 16 E (rounded up to 16)
    covers any padding."""
    x = x.contiguous()
    rows, C = x.shape
    E = offs.numel()
    sp = -(-(rows + GROUP_ALIGN * E) // 16) * 16        # a row stride of 16 bytes, as the fp8 GEMM reads it
    qt = torch.empty((C, sp), device=x.device, dtype=_store_dtype())     # the tail past the last group: unread
    inv = torch.empty((E * C,), device=x.device, dtype=torch.float32)
    bc = 64
    interp = _interpreted()
    launch(_quant_groups_t_kernel, (E, triton.cdiv(C, bc)), x, offs, offs_p, qt, inv, C, sp, E=E, FP8MAX=FP8_MAX,
           BR=16 if interp else 64, BC=bc, num_warps=4)
    return (qt if qt.dtype is E4M3 else qt.to(E4M3)), inv


def gather_rows(q: torch.Tensor, inv: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``index`` of an fp8 tensor and their factors (fp8 gathered as bytes: every build has that)."""
    return q.view(torch.uint8).index_select(0, index).view(E4M3), inv.index_select(0, index)


def scaled_grouped_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """A grouped fp8 matmul, fp32 accumulation, one rounding to ``out_dtype``:

    * by rows: ``a`` [S, K] (row-major) x ``b`` [E, K, N] (column-major) -> [S, N], rows of group e
      (ends ``offs``) times ``b[e]``; factors ``a_inv`` [S], ``b_inv`` [E, N];
    * by reduction: ``a`` [M, SP] (row-major) x ``b`` [SP, N] (column-major) -> [E, M, N], group e
      reducing over its columns of ``a`` / rows of ``b``; factors ``a_inv`` [E * M], ``b_inv`` [E * N].
    """
    if not emulate:
        out = torch._scaled_grouped_mm(a, b, a_inv, b_inv, offs=offs, out_dtype=torch.bfloat16)
        return out if out.dtype is out_dtype else out.to(out_dtype)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.zeros((a.shape[0], b.shape[-1]), device=a.device, dtype=torch.float32)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = (a[s:t].float() * a_inv[s:t, None]) @ (b[e].float() * b_inv[e][None, :])
        return out.to(out_dtype)
    E, M, N = len(ends), a.shape[0], b.shape[-1]
    out = torch.zeros((E, M, N), device=a.device, dtype=torch.float32)
    ai, bi = a_inv.view(E, M), b_inv.view(E, N)
    for e, (s, t) in enumerate(zip(starts, ends)):
        if t > s:
            out[e] = (a[:, s:t].float() * ai[e][:, None]) @ (b[s:t].float() * bi[e][None, :])
    return out.to(out_dtype)
