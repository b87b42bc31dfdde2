"""Launch generated Triton kernels straight through their compiled launcher (issue 15, item 2).

Generated host functions write ``launch(kernel, grid, *args, **kwargs)`` where they would write
``kernel[grid](*args, **kwargs)``.  Both launch the same compiled kernel with the same arguments;
``launch`` skips most of the ~20-40 us that Triton's ``JITFunction.run`` spends binding the
arguments, formatting its cache key as a string and building launch metadata on every call.

How.  Triton (3.6 to 3.9) picks a compiled kernel per (current device, the *specialisation* of the
arguments, the options).  The specialisation of an argument is:

* a tensor: its dtype, and whether ``data_ptr() % 16 == 0`` ("D");
* an int: 1 is compiled in as a constant; otherwise i32 / i64 / u64 by range, and "D" if the value
  is a multiple of 16;
* a float: fp32; a bool: u1; None: a constant; a ``tl.constexpr`` parameter: its value;
* options (``num_warps``, ``num_stages``, ...) and constexprs passed by keyword: their values,
  plus Triton's debug / instrumentation knobs.

:func:`spec_key` computes a key that is at least as fine as that (a pure function; the tests check
it against Triton's own ``native_specialize_impl`` on a table of arguments).  The first call with a
new key goes through the normal ``kernel[grid](...)`` launch, which compiles (or finds) the kernel
and launches it; the ``CompiledKernel`` it returns is cached under the key.  Later calls with the
same key call ``CompiledKernel.run`` directly with the arguments packed as ``JITFunction.run``
packs them (every parameter in order, constexprs included).  An argument whose alignment changes,
an int that becomes 1 or stops being a multiple of 16, another dtype or device: another key, so
another normal launch (Triton recompiles or finds the other kernel), never the wrong kernel.

The normal launch is used, always, whenever anything is unexpected: the interpreter
(``TRITON_INTERPRET``), a Triton outside 3.6-3.9, a backend other than CUDA (AMD specialises
tensors differently), an argument type the key does not know, an unhashable keyword value, a
callable grid, launch hooks or pre-run hooks installed (profilers such as proton), a stage
inspection hook, or ``PATCHDSL_FAST_LAUNCH=0`` in the environment (for A/B measurements).

Not checked on the fast path: Triton's "a global the kernel reads has changed since it was
compiled" error.  Generated modules bind their ``tl.constexpr`` globals once, at render time.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

ENV_FLAG = "PATCHDSL_FAST_LAUNCH"
SUPPORTED = ((3, 6), (3, 7), (3, 8), (3, 9))
# Keys per kernel beyond which new keys are launched normally and not remembered (a runtime int
# passed by keyword would otherwise grow the cache with every distinct value).
MAX_KEYS = 64

_I32_MIN, _I32_MAX = -(2 ** 31), 2 ** 31 - 1
_I64_MIN, _I64_MAX = -(2 ** 63), 2 ** 63 - 1


class Unsupported(Exception):
    """An argument the key does not know how to specialise: use the normal launch."""


def int_code(v: int) -> int:
    """The specialisation class of a runtime int argument, as Triton's: -1 for 1 (compiled in as a
    constant); otherwise 0/2/4 for i32/i64/u64 by range, plus 1 when ``v % 16 == 0``."""
    if v == 1:
        return -1
    if _I32_MIN <= v <= _I32_MAX:
        r = 0
    elif _I64_MIN <= v <= _I64_MAX:
        r = 2
    elif 0 <= v < 2 ** 64:
        r = 4
    else:
        raise Unsupported(f"int {v} does not fit 64 bits")
    return r + (1 if (v & 15) == 0 else 0)


def spec_key(args: tuple, constexpr_pos: frozenset = frozenset(), tensor_type: Any = None) -> tuple:
    """A hashable key of the positional ``args`` at least as fine as Triton's specialisation.

    Per position: a tensor gives its dtype and adds a bit to the alignment mask when its
    ``data_ptr()`` is a multiple of 16; an int gives :func:`int_code`; a float ``"f"``, a bool
    ``"b"``, None None; a position in ``constexpr_pos`` gives its value.  The last element is the
    alignment mask.  Raises :class:`Unsupported` for anything else (the caller launches normally).
    """
    if tensor_type is None:
        tensor_type = _Tensor
    out = []
    append = out.append
    mask = 0
    bit = 1
    i = 0
    for a in args:
        t = type(a)
        if constexpr_pos and i in constexpr_pos:
            append(("c", a))
        elif t is int:
            if a == 1:
                append(-1)
            elif _I32_MIN <= a <= _I32_MAX:
                append(0 if a & 15 else 1)
            else:
                append(int_code(a))
        elif t is tensor_type or isinstance(a, tensor_type):
            append(a.dtype)
            if not a.data_ptr() & 15:
                mask |= bit
        elif t is float:
            append("f")
        elif t is bool:
            append("b")
        elif a is None:
            append(None)
        else:
            raise Unsupported(f"argument {i} of type {t.__name__}")
        bit <<= 1
        i += 1
    append(mask)
    return tuple(out)


def version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "0")
    except (IndexError, ValueError):
        return (0, 0)


def fast_path_refusal(*, kernel_type: str, triton_version: str, backend: str, env: Optional[str]) -> Optional[str]:
    """Why a kernel must always take the normal launch (None when the fast path may be used).

    Pure: decided once per kernel from the kernel's class name, Triton's version, the active
    backend and the value of ``PATCHDSL_FAST_LAUNCH``."""
    if env is not None and env.strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_FLAG}={env}"
    if kernel_type != "JITFunction":
        return f"kernel is a {kernel_type} (interpreter or wrapper), not a JITFunction"
    if version_tuple(triton_version) not in SUPPORTED:
        return f"triton {triton_version} is not one of the versions read for this launcher (3.6-3.9)"
    if backend != "cuda":
        return f"backend {backend!r} (only CUDA's specialisation is mirrored)"
    return None


class TritonRuntime:
    """What the launcher needs from Triton, looked up once.  Tests substitute a fake."""

    def __init__(self) -> None:
        import triton
        from triton import knobs
        from triton.compiler import CompiledKernel
        from triton.runtime.driver import driver

        self.version = triton.__version__
        self.rt = knobs.runtime
        self.compilation = knobs.compilation
        self.hook_chain = getattr(knobs, "HookChain", None)
        self.compiled_kernel_type = CompiledKernel
        active = driver.active
        self.get_current_device = active.get_current_device
        self.get_current_stream = active.get_current_stream
        self._driver = driver
        self._active = active

    def backend(self) -> str:
        return self._active.get_current_target().backend

    def driver_changed(self) -> bool:
        return self._driver.active is not self._active

    def hooks_idle(self) -> bool:
        """No launch hook, pre-compile stage hook or profiler wants to see launches."""
        rt = self.rt
        for h in (rt.launch_enter_hook, rt.launch_exit_hook):
            if h is not None and not (type(h) is self.hook_chain and not h.calls):
                return False
        return getattr(rt, "add_stages_inspection_hook", None) is None

    def knob_key(self) -> tuple:
        """The knobs ``JITFunction.run`` folds into its options (so into its cache key)."""
        c = self.compilation
        return (self.rt.debug, getattr(c, "instrumentation_mode", None), getattr(c, "fpsan_homomorphic_casts", None))

    def binder(self, fn: Any, device: int) -> Callable:
        return fn.device_caches[device][4]

    def kernel_cache(self, fn: Any, device: int) -> dict:
        return fn.device_caches[device][0]


class Launcher:
    """The fast path of one ``@triton.jit`` kernel: key -> (run, function, packed metadata, tail)."""

    def __init__(self, fn: Any, runtime: Any = None) -> None:
        self.fn = fn
        self.cache: dict = {}
        self.refusal: Optional[str] = None
        self._rt = runtime
        self._decided = False
        self._lock = threading.Lock()
        self.constexpr_pos = frozenset()
        self.fast_calls = 0
        self.normal_calls = 0

    # -- decided on first call (Triton's driver needs a GPU, so not at import)
    def _decide(self) -> None:
        with self._lock:
            if self._decided:
                return
            fn = self.fn
            env = os.environ.get(ENV_FLAG)
            refusal = None
            try:
                rt = self._rt
                if rt is None and type(fn).__name__ == "JITFunction" and (env or "1").strip().lower() not in (
                        "0", "false", "no", "off"):
                    rt = self._rt = TritonRuntime()
                refusal = fast_path_refusal(
                    kernel_type=type(fn).__name__,
                    triton_version=rt.version if rt is not None else "0.0",
                    backend=rt.backend() if rt is not None else "",
                    env=env)
                if refusal is None:
                    self.constexpr_pos = frozenset(p.num for p in fn.params if p.is_constexpr)
                    fn.pre_run_hooks  # noqa: B018 - the attribute must exist
                    fn.device_caches  # noqa: B018
            except Exception as e:  # anything unexpected: the normal launch, always
                refusal = f"{type(e).__name__}: {e}"
            self.refusal = refusal
            self._decided = True

    def __call__(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        if not self._decided:
            self._decide()
        if self.refusal is not None:
            self.normal_calls += 1
            return self.fn[grid](*args, **kwargs)
        rt = self._rt
        fn = self.fn
        if type(grid) is not tuple or fn.pre_run_hooks or not rt.hooks_idle() or rt.driver_changed():
            self.normal_calls += 1
            return fn[grid](*args, **kwargs)
        try:
            dev = rt.get_current_device()
            key = (dev, rt.knob_key(), tuple(kwargs.items()), spec_key(args, self.constexpr_pos))
            entry = self.cache.get(key)
        except (Unsupported, TypeError):  # TypeError: an unhashable keyword value
            self.normal_calls += 1
            return fn[grid](*args, **kwargs)
        if entry is None:
            return self._first(key, dev, grid, args, kwargs)
        run, function, packed, tail = entry
        n = len(grid)
        self.fast_calls += 1
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, rt.get_current_stream(dev),
            function, packed, None, None, None, *args, *tail)
        return None

    def _first(self, key: tuple, dev: int, grid: tuple, args: tuple, kwargs: dict) -> Any:
        """Launch normally and remember the compiled kernel it used for ``key``."""
        fn, rt = self.fn, self._rt
        self.normal_calls += 1
        kernel = fn[grid](*args, **kwargs)
        if len(self.cache) >= MAX_KEYS or type(kernel) is not rt.compiled_kernel_type:
            return kernel
        try:
            bound, _spec, _opts = rt.binder(fn, dev)(*args, **kwargs)
            values = tuple(bound.values())
            if len(values) < len(args) or any(v is not a for v, a in zip(values, args)):
                return kernel
            if not any(k is kernel for k in rt.kernel_cache(fn, dev).values()):
                return kernel
            entry = (kernel.run, kernel.function, kernel.packed_metadata, values[len(args):])
            if entry[1] is None:
                return kernel
        except Exception:
            return kernel
        self.cache[key] = entry
        return kernel


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints (``triton.cdiv`` is a constexpr function whose call costs
    microseconds of argument unwrapping in host code)."""
    return -(-a // b)


# ---------------------------------------------------------------------------- autograd.Function
_C_APPLY: dict = {}


def _c_apply_of(cls: Any) -> Any:
    """The C-level ``apply`` of an autograd.Function, or False where the Python ``apply`` has work
    to do that this shortcut does not (a ``setup_context``, a torch without the private hooks)."""
    try:
        import torch
        from torch.autograd.function import _is_setup_context_defined

        if _is_setup_context_defined(cls.setup_context):
            return False
        torch._C._are_functorch_transforms_active  # noqa: B018
        torch._C._functorch.unwrap_if_dead  # noqa: B018
        return torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    except Exception:
        return False


def apply_function(cls: Any, *args: Any) -> Any:
    """``cls.apply(*args)`` for a Function with ``forward(ctx, ...)`` and no ``setup_context``,
    without the Python layer of ``Function.apply`` when no functorch transform (vmap, grad...) is
    active: the same C call on the same arguments (dead functorch wrappers unwrapped, as there)."""
    c_apply = _C_APPLY.get(cls)
    if c_apply is None:
        c_apply = _C_APPLY[cls] = _c_apply_of(cls)
    if c_apply is False or _functorch_active():
        return cls.apply(*args)
    return c_apply(*[_unwrap_if_dead(a) if isinstance(a, _Tensor) else a for a in args])


def _init_torch_hooks() -> None:
    global _functorch_active, _unwrap_if_dead, _Tensor
    import torch

    _Tensor = torch.Tensor
    try:
        _functorch_active = torch._C._are_functorch_transforms_active
        _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    except AttributeError:  # pragma: no cover - a torch without them: always the Python apply
        _functorch_active = lambda: True  # noqa: E731
        _unwrap_if_dead = lambda t: t  # noqa: E731


_init_torch_hooks()


_LAUNCHERS: dict[int, Launcher] = {}
_make_lock = threading.Lock()


def launcher_of(fn: Any) -> Launcher:
    """The :class:`Launcher` of a kernel (made once; holds the kernel, so its id stays unique)."""
    lau = _LAUNCHERS.get(id(fn))
    if lau is None:
        with _make_lock:
            lau = _LAUNCHERS.get(id(fn))
            if lau is None:
                lau = _LAUNCHERS[id(fn)] = Launcher(fn)
    return lau


def launch(fn: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn[grid](*args, **kwargs)``, through the compiled kernel's launcher when that is safe.

    Returns what the normal launch returns on a first (or normal) launch, None on a fast one."""
    lau = _LAUNCHERS.get(id(fn))
    if lau is None:
        lau = launcher_of(fn)
    return lau(grid, args, kwargs)


def counts() -> tuple[int, int]:
    """(fast, normal) launches so far through :func:`launch`, over every kernel (the bench records
    the difference over its host-time loop, so a run shows whether the fast path was taken)."""
    fast = normal = 0
    for lau in list(_LAUNCHERS.values()):
        fast += lau.fast_calls
        normal += lau.normal_calls
    return fast, normal


def refusals() -> dict[str, str]:
    """Kernel name -> why it always takes the normal launch (kernels launched so far)."""
    out = {}
    for lau in list(_LAUNCHERS.values()):
        if lau.refusal is not None:
            out[getattr(lau.fn, "__name__", repr(lau.fn))] = lau.refusal
    return out


def reset() -> None:
    """Forget every cached kernel and decision (tests; after changing ``PATCHDSL_FAST_LAUNCH``)."""
    with _make_lock:
        _LAUNCHERS.clear()
