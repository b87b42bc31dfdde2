"""Switch Triton's interpreter on before anything imports triton, when there is no GPU.

Triton decorates its own standard library (``tl.sigmoid``, ``tl.cdiv``...) with ``@jit`` when
it is imported, choosing compiled or interpreted functions from ``TRITON_INTERPRET`` at that
moment; so the variable must be set before the first ``import triton`` anywhere in the process
(transformers and torch may import it).  This runs when ``patchdsl`` is imported and costs no
torch import: it looks for GPU device nodes.
"""

from __future__ import annotations

import glob
import os


def gpu_present() -> bool:
    """Any sign of a GPU, cheaply and without importing torch (unless it is already imported)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            pass
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia"):
        return True
    if os.path.exists("/dev/kfd") or glob.glob("/dev/dxg"):
        return True
    import ctypes.util

    return ctypes.util.find_library("cuda") is not None


def early_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") is None and not gpu_present():
        os.environ["TRITON_INTERPRET"] = "1"


early_interpreter()
