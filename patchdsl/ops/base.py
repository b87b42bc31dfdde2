"""What an op is: a flag schema, the kinds it accepts, a template, and how it patches a module.

An op module (``patchdsl/ops/<name>.py``) defines one :class:`Op` subclass and registers an
instance with :func:`patchdsl.ops.registry.register`.  The class body is plain data and pure
functions; torch is only imported inside the methods that touch modules, so ``patchdsl check``
and the syntax layer stay light.

Life of a site:
  1. ``index``:    each registered kind's recogniser describes modules (``ModuleInfo.kinds``).
  2. ``plan``:     ``Op.key_params(info, flags, dtype, target)`` -> the kernel's specialisation
                   parameters (pure; becomes the ``KernelKey``).
  3. ``codegen``:  the op's template is rendered with those parameters (plus ``target``) and
                   imported from the on-disk cache.
  4. ``runtime``:  ``Op.check(module, flags)`` validates the live module (a reason string
                   refuses it), then ``Op.make_forward(module, kernels, flags)`` returns a
                   function ``forward(self, *args, **kwargs)`` bound to the instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from ..model.info import ModuleInfo


# Upper bounds of int flags (every int flag has both bounds: tests/test_hostile_inputs.py checks the registry).
BLOCK_MAX = 1 << 16            # a block / tile flag in elements: Triton tiles hold at most 2**20 elements, and
                               # the row kernels put up to 16 rows of a block in one tile
INDEX_MIN, INDEX_MAX = -(2 ** 31), 2 ** 31 - 1    # label values (ignore_index): int32, as token ids
SIZE_MAX = 2 ** 31 - 1         # a size or count: what plan files and config.json take
CHUNK_MAX = 1 << 24            # tokens per chunk of the chunked LM-head ops
TEACHER_HIDDEN_MAX = 1 << 20   # the teacher's hidden size (verify allocates batch x seq x this in float64)
PROGRAMS_PER_SM_MAX = 64
# verify's floor for relative errors near zero, per dtype (patchdsl.parity.compare's rule; an op's
# parity_floor adds its own on top, e.g. fp8_linear's recipe bound)
DTYPE_FLOORS = {"fp32": 1e-5, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


class FlagTypeError(ValueError):
    """A flag value of the wrong type; the message says what was expected."""


@dataclass(frozen=True)
class FlagSpec:
    """One typed flag: ``type`` is bool, int, float, str, or ``choice`` (then ``choices``).

    ``auto_ok``: the word ``auto`` is also accepted (meaning: let the op decide).
    ``none_ok``: the word ``none`` is also accepted.
    """

    name: str
    type: str
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()
    auto_ok: bool = False
    none_ok: bool = False
    min: float | None = None
    max: float | None = None

    def describe_type(self) -> str:
        t = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
             "choice": " or ".join(repr(c) for c in self.choices)}[self.type]
        if self.auto_ok:
            t += " or auto"
        if self.none_ok:
            t += " or none"
        return t

    def coerce(self, value: Any) -> Any:
        if self.auto_ok and value == "auto":
            return "auto"
        if self.none_ok and value is None:
            return None
        ok = False
        if self.type == "bool":
            ok = isinstance(value, bool)
        elif self.type == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                try:
                    value = float(value)
                except OverflowError:           # an int too big for a float
                    value = math.inf
                if not math.isfinite(value):    # inf / nan are no Python literal (docs/reliability.md)
                    raise FlagTypeError(f"flag '{self.name}' must be a finite number, got {value}")
        elif self.type == "str":
            ok = isinstance(value, str)
        elif self.type == "choice":
            ok = value in self.choices and not isinstance(value, bool)
        if not ok:
            raise FlagTypeError(f"flag '{self.name}' expects {self.describe_type()}, got {_show(value)}")
        if self.min is not None and value < self.min:
            raise FlagTypeError(f"flag '{self.name}' must be >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise FlagTypeError(f"flag '{self.name}' must be <= {self.max}, got {value}")
        return value


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, int) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= 40 else s[:40] + f"... ({len(s)} characters)"


class Op:
    """Base class of every op.  Subclasses set the class attributes and override the methods."""

    name: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]]          # structural kinds this op can replace
    template: ClassVar[str]                   # file name under templates/
    flags: ClassVar[tuple[FlagSpec, ...]] = ()
    covers: ClassVar[tuple[str, ...]] = ()    # child modules whose work this op fuses in
    # True when the op's replacement forward calls a forward already set on the instance (TRL's
    # fused LM head, for fused_linear_logprobs): the runtime then lets it wrap that forward
    wraps_instance_forward: ClassVar[bool] = False
    doc: ClassVar[str] = ""
    # External ops (patchdsl/ops/external.py, ExternalOp): a third-party kernel (a Hub kernel layer,
    # an installed Liger-Kernel op) loaded instead of a generated one.  They plan, patch, undo and
    # verify through the same planner, runtime and parity code as generated ops.
    external: ClassVar[bool] = False
    # whether the generated module holds Triton kernels (fp8_linear's calls torch._scaled_mm): the
    # sm_90 compile test asks every op that has them to launch one
    triton_kernels: ClassVar[bool] = True
    positional: ClassVar[tuple[str, ...]] = ()  # flags that may be given as positional values
    # The DTensor layouts (patchdsl.distributed.PLACEMENTS: "replicated", "heads", "columns", "vocab",
    # "experts") a site of this op can run on, besides unsharded parameters.  Every op declares it in its
    # own class body (tests/distributed/test_placements.py); a site whose parameters show another layout
    # is refused at apply time with the reason.
    placements: ClassVar[tuple[str, ...] | None] = None
    any_kind: ClassVar[bool] = False          # may replace any selected module (Hub layers)

    # ---- pure, planning time -------------------------------------------------------
    def flag(self, name: str) -> FlagSpec | None:
        return next((f for f in self.flags if f.name == name), None)

    def default_flags(self) -> dict[str, Any]:
        return {f.name: f.default for f in self.flags}

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        """Specialisation parameters of the kernel for this site (JSON-able, deterministic)."""
        raise NotImplementedError

    def validate(self, flags: Mapping[str, Any]) -> str | None:
        """Why the resolved flags of a site do not go together (None if they do).  Pure."""
        return None

    # ---- the machine-dependent part (plan time and runtime) ------------------------
    def unavailable(self, params: Mapping[str, Any]) -> str | None:
        """Why the kernel of ``params`` cannot be had on this machine (None if it can).

        Called when a plan is made for this machine, so a missing package or kernel is an error
        naming the site before anything runs.  Generated ops are available unless their kernel needs
        hardware this machine lacks (fp8_linear: fp8 tensor cores)."""
        return None

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        """A readable file stem naming what the kernel is specialised for."""
        parts = [self.name]
        for k in ("dtype", "hidden", "n_cols", "vocab", "head_dim"):
            if k in params:
                v = params[k]
                parts.append(f"{k[0]}{v}" if isinstance(v, int) else str(v))
        parts.append(params.get("target", "cuda"))
        return "_".join(str(p) for p in parts)

    def host(self, info: ModuleInfo, index: Any) -> str:
        """Path of the module whose ``forward`` this op replaces (default: the site itself).

        ``fused_linear_cross_entropy`` is selected on ``lm_head`` but replaces the forward of the
        causal LM that owns it; ``index`` is the :class:`patchdsl.model.index.ModelIndex`.
        """
        return info.path

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        """Planning time: None if ``info`` (which fits one of the op's kinds) is a place this op
        can go, else why not (e.g. a loss op on a Linear that is not the causal LM's lm_head)."""
        return None

    # ---- runtime (imports torch lazily) -------------------------------------------
    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        """Return None if the live module fits this op, else a one-line reason it does not."""
        return None

    def make_forward(self, module: Any, kernels: Callable[[str], Any], flags: Mapping[str, Any],
                     info: ModuleInfo) -> Callable:
        """Return ``forward(self, *args, **kwargs)`` to bind on ``module``.

        ``kernels(dtype)`` returns the imported generated module for that dtype (rendered on
        first use and cached), so the forward can dispatch on its input's dtype.
        Weights must be read from ``self`` at call time (FSDP2 / PEFT safety), never captured.
        """
        raise NotImplementedError

    def install(self, host: Any, kernels: Callable[[Any], Any], flags: Mapping[str, Any],
                info: ModuleInfo) -> list[tuple[Any, str, Any]]:
        """The attribute assignments that patch ``host``: a list of (object, attribute, value).

        The runtime performs them, remembers what was there (or that nothing was) and undoes
        them in reverse order.  Default: bind ``make_forward(...)`` as ``host.forward``.
        """
        import types

        return [(host, "forward", types.MethodType(self.make_forward(host, kernels, flags, info), host))]

    def placement_reason(self, flags: Mapping[str, Any], layout: str) -> str | None:
        """Why this site's flags do not go with ``layout`` (one of :attr:`placements`), or None."""
        return None

    def parity_floor(self, flags: Mapping[str, Any], dtype: str) -> float | None:
        """verify's floor for this op's sites instead of the dtype's (None: the dtype's).  Ops that are
        not exact by design (fp8_linear) state their bound here."""
        return None

    # ---- verify (patchdsl.parity): ops whose calls the unpatched model cannot answer ------------
    def parity_reference(self, host: Any, flags: Mapping[str, Any]) -> list[tuple[Any, str, Any]]:
        """Assignments (as :meth:`install`'s) that let an *unpatched* copy of the model answer the calls
        :meth:`parity_kwargs` adds, in plain PyTorch: verify gives them to its float64 reference and its
        unpatched copy (a distillation loss needs a teacher, which HF's forward does not take).
        Default: nothing (the unpatched model is the reference as it is)."""
        return []

    def parity_kwargs(self, host: Any, flags: Mapping[str, Any], batch: int, seq: int, gen: Any) -> dict[str, Any]:
        """Extra keyword arguments of verify's calls for a site of this op (float tensors in float64,
        made from ``gen``; verify casts them to each model's dtype and device).  Default: none."""
        return {}
