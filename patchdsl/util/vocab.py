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
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def dtype_name(dt: Any) -> str:
    return DTYPE_NAMES.get(str(dt), str(dt).replace("torch.", ""))
