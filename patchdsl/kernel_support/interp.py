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


# ------------------------------------------------------------------ fp32 -> bf16 rounding
# Triton's interpreter (3.6 to 3.9 at least) converts fp32 to bf16 by dropping the low 16 bits
# (InterpreterBuilder.cast_impl -> _convert_float(..., rounding_mode=None)): truncation towards
# zero, where the GPU's fptrunc (cvt.rn.bf16.f32) rounds to nearest even.  Every bf16 store of a
# kernel (``tl.store(p, y.to(p.dtype.element_ty))``, the implicit cast of ``tl.store`` and bf16
# constants) goes through that cast, so under the interpreter bf16 outputs were biased towards
# zero.  round_bf16_like_gpu() replaces that one conversion (fp32 -> bf16 through cast_impl)
# with round to nearest even; every other cast, and explicit ``fp_downcast_rounding`` modes
# (create_fp_to_fp), are left to Triton.
INTERP_FIX_VERSIONS = ((3, 6), (4, 0))    # [from, to): the interpreter API the fixes below are written for
_bf16_fixed = False


def interpreter_on() -> bool:
    """Whether Triton runs interpreted (TRITON_INTERPRET as Triton reads it: 1 / true / on)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def f32_to_bf16_rne(data):
    """The bf16 bit patterns (uint16) of float32 ``data``, rounded to nearest, ties to even, as
    the GPU and ``torch.Tensor.to(torch.bfloat16)`` do; NaN stays NaN (quiet), overflow is inf."""
    import numpy as np

    a = np.array(data, dtype=np.float32, copy=True)
    u = a.view(np.uint32)
    with np.errstate(over="ignore"):
        r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r = np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16), r)
    return r


def _version(v: str) -> tuple[int, int]:
    import re

    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _truncates(cast_impl, builder, TensorHandle, tl) -> bool:
    """Probe: does ``cast_impl`` turn fp32 into bf16 by truncation?  (False if it already rounds.)"""
    import numpy as np

    bits = np.array([0x3F808001, 0x3F818000, 0x3F808000, 0xBF808001], dtype=np.uint32)   # above half, ties
    src = TensorHandle(bits.view(np.float32), tl.float32)
    got = np.asarray(cast_impl(builder, src, tl.bfloat16).data).view(np.uint16)
    return not np.array_equal(got, f32_to_bf16_rne(bits.view(np.float32)))


def round_bf16_like_gpu() -> bool:
    """Make the interpreter's fp32 -> bf16 conversion round to nearest even (once per process).
    Only on a triton in INTERP_FIX_VERSIONS whose conversion is found to truncate; True when the
    conversion rounds to nearest even afterwards.  Called by ``codegen.env.ensure_triton`` when
    the interpreter is on; never on a GPU."""
    global _bf16_fixed
    if _bf16_fixed:
        return True
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except Exception:  # pragma: no cover - no triton
        return False
    cls, TensorHandle = getattr(ti, "InterpreterBuilder", None), getattr(ti, "TensorHandle", None)
    orig = getattr(cls, "cast_impl", None)
    lo, hi = INTERP_FIX_VERSIONS
    if orig is None or TensorHandle is None or not lo <= _version(triton.__version__) < hi:
        return False
    builder = getattr(ti, "interpreter_builder", None) or cls()
    if not _truncates(orig, builder, TensorHandle, tl):
        _bf16_fixed = True                  # this triton rounds already
        return True

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(f32_to_bf16_rne(src.data), dst_type.scalar)
        return orig(self, src, dst_type)

    cast_impl.__wrapped__ = orig
    cls.cast_impl = cast_impl
    _bf16_fixed = not _truncates(cls.cast_impl, builder, TensorHandle, tl)
    return _bf16_fixed


# ------------------------------------------------------------------ scalar tensors as indices
# Inside an interpreted kernel a runtime scalar (``row_start = pid * rows_per_prog``) is a tensor over
# a one-element NumPy array, and ``range(row_start, row_end, BLOCK)`` calls its ``__index__``.
# Triton 3.6's interpreter (``_patch_lang_tensor``) defines that as ``int(self.handle.data)``, which
# NumPy 2.4 refuses for arrays of one or more dimensions ("only 0-dimensional arrays can be converted
# to Python scalars"); later Tritons squeeze the array first.  index_scalars_like_newer_triton() makes
# a Triton whose ``__index__`` fails on the installed NumPy do the same; a Triton or NumPy that works
# is left alone (decided by a probe, not by version numbers).
_index_fixed = False


def _index_fails(patch_tensor) -> bool:
    """Probe: does the ``__index__`` that ``patch_tensor`` (Triton's ``_patch_lang_tensor``) installs
    fail on a one-element, one-dimensional handle under this NumPy?"""
    import operator
    from types import SimpleNamespace

    import numpy as np

    class Tensor:                           # stands in for tl.tensor: only the attributes are read
        pass

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    patch_tensor(Tensor, Scope())
    probe = Tensor()
    probe.handle = SimpleNamespace(data=np.array([3], dtype=np.int32))
    try:
        return operator.index(probe) != 3
    except TypeError:
        return True


def index_scalars_like_newer_triton() -> bool:
    """Make the interpreter's ``tensor.__index__`` accept one-element arrays under NumPy >= 2.4 (once
    per process), as Triton 3.9's does (``int(data.squeeze())``).  True when ``__index__`` works
    afterwards.  Called by ``codegen.env.ensure_triton`` when the interpreter is on; never on a GPU."""
    global _index_fixed
    if _index_fixed:
        return True
    try:
        import numpy as np
        import triton
        from triton.runtime import interpreter as ti
    except Exception:  # pragma: no cover - no triton
        return False
    orig = getattr(ti, "_patch_lang_tensor", None)
    lo, hi = INTERP_FIX_VERSIONS
    if orig is None or not lo <= _version(triton.__version__) < hi:
        return False
    if not _index_fails(orig):
        _index_fixed = True                 # this Triton (or NumPy) works already
        return True

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.squeeze(self.handle.data)))

    _patch_lang_tensor.__wrapped__ = orig
    ti._patch_lang_tensor = _patch_lang_tensor
    _index_fixed = not _index_fails(ti._patch_lang_tensor)
    return _index_fixed


def early_interpreter() -> None:
    """Called on ``import patchdsl``: the interpreter when there is no GPU, whatever was imported first."""
    import sys

    if os.environ.get("TRITON_INTERPRET") is None and not gpu_present():
        if "triton" in sys.modules:
            late_interpreter()
        else:
            os.environ["TRITON_INTERPRET"] = "1"


early_interpreter()
