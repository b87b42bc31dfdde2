"""Pick the Triton target and make sure the interpreter is on when there is no GPU.

``TRITON_INTERPRET=1`` must be in the environment before triton is imported (and before any
``@triton.jit`` runs), so every import of triton in patchdsl goes through :func:`ensure_triton`.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache


@lru_cache(maxsize=1)
def target() -> str:
    """``"cuda"`` when a CUDA device is usable and the interpreter is not forced, else ``"interpreter"``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "interpreter"


def ensure_triton():
    """Import triton, switching on its interpreter first when there is no GPU."""
    if os.environ.get("TRITON_INTERPRET") is None:
        import torch

        # Triton reads the variable when a function is decorated with @triton.jit, so setting it
        # here works even if triton itself was imported earlier (transformers may import it):
        # generated modules are imported after this call.
        if not torch.cuda.is_available():
            if "triton" in sys.modules:
                from ..kernel_support.interp import late_interpreter

                late_interpreter()          # triton came first (transformers may import it)
            os.environ["TRITON_INTERPRET"] = "1"
    import triton

    from ..kernel_support.interp import index_scalars_like_newer_triton, interpreter_on, round_bf16_like_gpu

    if interpreter_on():
        round_bf16_like_gpu()               # bf16 stores round to nearest even, as on the GPU
        index_scalars_like_newer_triton()   # range() over runtime scalars under NumPy 2.4 (Triton 3.6)
    return triton
