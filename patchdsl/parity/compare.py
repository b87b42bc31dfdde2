"""Error metrics and the tolerance rule of ``patchdsl verify``.

Every quantity is computed three times: by a float64 reference (the unpatched model in float64),
by the unpatched model in the run dtype ("HF") and by the patched model in the run dtype.  The
patched error is judged against the error the unpatched model itself makes in that dtype:

    err_patched = ||patched - ref64|| / ||ref64||          (relative Frobenius error)
    err_hf      = ||hf      - ref64|| / ||ref64||
    pass  <=>   err_patched <= FACTOR * err_hf + FLOOR[dtype]   and everything is finite

FACTOR = 4: a fused kernel rounds in different places than eager PyTorch (one rounding of the
fused result instead of one per intermediate, fp32 accumulation in another order), so its error
is of the same size as HF's, not bit-identical; across the tiny models and dtypes we measured,
a correct kernel stays within 2.7x of HF's error (at most 56% of the bound), while a real bug
(a dropped term, a wrong sign, a halved gradient, an unwritten tail) is off by 10x to 10^6x.  The floor covers
quantities that HF happens to compute (almost) exactly, where FACTOR * err_hf is ~0:

    fp32: 1e-5   (~170 units of roundoff: fp32 accumulation order over long reductions)
    bf16: 2^-8   (~3.9e-3, one unit of roundoff)
    fp16: 2^-11  (~4.9e-4, one unit of roundoff)

NaN or inf in a patched value always fails.  ``max_abs_err`` and ``max_rel_err`` (elementwise,
with a denominator guard of 1e-3 * max|ref|) are reported for reading, not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FACTOR = 4.0
from ..ops.base import DTYPE_FLOORS as FLOORS

REL_GUARD = 1e-3          # max_rel_err denominator: |ref| + REL_GUARD * max|ref|
_CHUNK = 1 << 24          # elements per chunk when reducing big tensors in float64


@dataclass(frozen=True)
class Tolerance:
    factor: float
    floor: float

    def bound(self, reference_err: float) -> float:
        if math.isnan(reference_err):
            return float("nan")
        return self.factor * reference_err + self.floor

    def to_json(self) -> dict[str, float]:
        return {"factor": self.factor, "floor": self.floor}


def tolerance_for(dtype: str, factor: float | None = None, floor: float | None = None) -> Tolerance:
    if dtype not in FLOORS:
        raise ValueError(f"dtype must be one of {', '.join(FLOORS)}, got {dtype!r}")
    return Tolerance(FACTOR if factor is None else float(factor), FLOORS[dtype] if floor is None else float(floor))


@dataclass(frozen=True)
class Errors:
    """Errors of one value against the float64 reference."""

    rel_fro: float       # ||x - ref|| / ||ref||  (inf if x is not finite)
    max_abs: float
    max_rel: float
    finite: bool

    @staticmethod
    def nonfinite() -> "Errors":
        inf = float("inf")
        return Errors(inf, inf, inf, False)


def errors(x: Any, ref: Any) -> Errors:
    """Relative Frobenius, max abs and guarded max relative error of ``x`` against ``ref``.

    Works chunk by chunk in float64 on the tensors' device, so a full vocabulary's logits or an
    embedding gradient do not need a float64 copy of the whole tensor.
    """
    import torch

    if x is None or ref is None:
        raise ValueError("errors() needs two tensors")
    x = x.detach()
    ref = ref.detach()
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    if x.device != ref.device:
        x = x.to(ref.device)
    xf, rf = x.reshape(-1), ref.reshape(-1)
    n = xf.numel()
    if n == 0:
        return Errors(0.0, 0.0, 0.0, True)
    finite = True
    ref_max = 0.0
    for s in range(0, n, _CHUNK):
        xc = xf[s:s + _CHUNK]
        if not bool(torch.isfinite(xc).all()):
            finite = False
            break
        ref_max = max(ref_max, float(rf[s:s + _CHUNK].double().abs().max()))
    if not finite:
        return Errors.nonfinite()
    guard = REL_GUARD * ref_max if ref_max > 0 else 1e-30
    diff2 = ref2 = 0.0
    max_abs = max_rel = 0.0
    for s in range(0, n, _CHUNK):
        r = rf[s:s + _CHUNK].double()
        d = xf[s:s + _CHUNK].double() - r
        diff2 += float((d * d).sum())
        ref2 += float((r * r).sum())
        ad = d.abs()
        max_abs = max(max_abs, float(ad.max()))
        max_rel = max(max_rel, float((ad / (r.abs() + guard)).max()))
    dn, rn = math.sqrt(diff2), math.sqrt(ref2)
    rel = dn / rn if rn > 0 else (0.0 if dn == 0 else float("inf"))
    return Errors(rel, max_abs, max_rel, True)


def judge(patched: Errors, hf: Errors, tol: Tolerance) -> tuple[bool, float, float]:
    """(passed, reference_err, bound).  A non-finite reference makes the bound infinite."""
    ref_err = hf.rel_fro if hf.finite else float("inf")
    bound = tol.bound(ref_err)
    ok = patched.finite and math.isfinite(patched.rel_fro) and patched.rel_fro <= bound
    return ok, ref_err, bound
