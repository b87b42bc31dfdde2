"""The vocabulary shared by every stage: dtype names and their torch / Triton spellings, kernel targets.

A dtype is named ``fp32``, ``bf16`` or ``fp16`` everywhere in patchdsl (specs, plans, kernel keys,
the command line); the long names users may type (``bfloat16``, ``torch.bfloat16``, ``half`` ...)
are aliases of those.  torch is imported only by :func:`torch_dtype`.
"""

from __future__ import annotations

from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
# the long names a user may type for each (specs, the command line, training arguments)
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
# torch's attribute names (``torch.bfloat16``); fp64 is verify's reference precision, never a kernel's
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
DTYPE_NAMES = {f"torch.{t}": n for n, t in TORCH_NAMES.items() if n in DTYPES}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp8 is no model dtype here: patchdsl runs projections in fp8 with the op fp8_linear (docs/fp8.md)
FP8_RULE = "*.mlp.{gate_proj,up_proj,down_proj}: Linear -> fp8_linear(recipe=rowwise)"
# where a kernel runs: compiled for a CUDA GPU, or in Triton's interpreter (no GPU)
TARGETS = ("cuda", "interpreter")


def dtype_name(dt: Any) -> str:
    """A torch dtype's short name (``torch.bfloat16`` -> ``bf16``; others without ``torch.``)."""
    return DTYPE_NAMES.get(str(dt), str(dt).replace("torch.", ""))


def canonical_dtype(dtype: Any) -> Any:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``"bf16"`` (other values
    unchanged)."""
    s = str(dtype)
    s = s[len("torch."):] if s.startswith("torch.") else s
    return DTYPE_ALIASES.get(s, s)


def torch_dtype(name: Any) -> Any:
    """The torch dtype of a dtype name (or alias, or fp64)."""
    import torch

    return getattr(torch, TORCH_NAMES[canonical_dtype(name)])


def is_fp8_name(name: Any) -> bool:
    """``fp8``, ``float8``, ``e4m3``, ``torch.float8_e4m3fn``, ``fp8_e5m2`` ...: a name for fp8."""
    s = str(name).strip().lower().removeprefix("torch.")
    return s.startswith(("fp8", "float8", "f8", "e4m3", "e5m2"))


def dtype_hint(name: Any) -> str:
    """The hint for a dtype name that is not fp32, bf16 or fp16 -- the one every place that refuses a
    dtype gives (command line, spec, training arguments, ``load_model``): fp8 points at the op that runs
    it, ``fp8_linear``, with a rule that works; anything else gets the names there are."""
    if is_fp8_name(name):
        return (f"fp8 is not a model dtype in patchdsl but an op: keep the model in bf16 and run its projections in "
                f"fp8 with a rule such as `{FP8_RULE}` (add emulate=true on a CPU or a GPU without fp8; docs/fp8.md)")
    return f"expected one of {', '.join(DTYPES)}"
