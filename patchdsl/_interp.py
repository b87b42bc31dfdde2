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


def late_interpreter() -> int:
    """Switch an already imported triton over to its interpreter; returns how many functions moved.

    ``TRITON_INTERPRET`` is read each time ``@triton.jit`` decorates a function, so kernels decorated
    after this point are interpreted anyway; but triton decorated its own standard library
    (``tl.sigmoid``, ``tl.cdiv``, ``tl.softmax``...) when it was imported, and an interpreted kernel
    that calls one of those compiled functions fails with "Cannot call @triton.jit'd outside of the
    scope of a kernel".  Each such function in the ``triton.language`` modules is replaced by its
    interpreted twin.  Only ever done on a machine without a GPU, where the compiled functions
    cannot run at all.
    """
    import sys

    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except Exception:  # pragma: no cover - a triton without these names
        return 0
    moved: dict[int, object] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, val in list(vars(mod).items()):
            if isinstance(val, JITFunction):
                twin = moved.get(id(val))
                if twin is None:
                    twin = moved[id(val)] = InterpretedFunction(val.fn)
                setattr(mod, attr, twin)
    return len(moved)


def early_interpreter() -> None:
    """Called on ``import patchdsl``: the interpreter when there is no GPU, whatever was imported first."""
    import sys

    if os.environ.get("TRITON_INTERPRET") is None and not gpu_present():
        if "triton" in sys.modules:
            late_interpreter()
        else:
            os.environ["TRITON_INTERPRET"] = "1"


early_interpreter()
