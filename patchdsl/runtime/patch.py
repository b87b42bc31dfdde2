"""Apply a PatchPlan to a live model; undo it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..codegen import KernelKey, load_kernel
from ..codegen.env import target as detect_target
from ..index import build_index
from ..ops.base import ModuleInfo, Op
from ..ops.kinds import unwrap
from ..ops.registry import get_op
from ..planner import PatchPlan
from ..planner import plan as make_plan
from ..ops.common import dtype_name

_MISSING = object()
SITE_ATTR = "_patchdsl_site"


class PatchError(RuntimeError):
    """The plan does not fit the model (wrong model, already patched, a refused site with strict=True)."""


@dataclass(frozen=True)
class Refusal:
    path: str
    op: str
    rule: str
    reason: str

    def __str__(self) -> str:
        return f"{self.rule}: refused {self.op} on {self.path}: {self.reason}"


def kernel_getter(op: Op, info: ModuleInfo, flags: dict, target: str, preload: list[str] = ()) -> Callable:
    """``get(torch_dtype) -> generated module`` with a per-site dict cache (cheap per call)."""
    cache: dict[Any, Any] = {}

    def get(dt):
        mod = cache.get(dt)
        if mod is None:
            params = op.key_params(info, flags, dtype_name(dt), target)
            # an external op loads its third-party kernel; a generated one is rendered and imported
            mod = op.load(params) if op.external else load_kernel(
                KernelKey.make(op.name, op.template, op.kernel_name(params), params))
            cache[dt] = mod
        return mod

    if preload:
        import torch

        for d in preload:
            get({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[d])
    return get


@dataclass
class PatchHandle:
    """What ``apply`` did: the patched sites, the refused ones, and how to undo it all."""

    plan: Any
    patched: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    _undo: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    active: bool = True

    def undo(self) -> None:
        """Restore every attribute this handle changed, in reverse order.  Idempotent."""
        while self._undo:
            obj, attr, old = self._undo.pop()
            if old is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, old)
        self.active = False

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def summary(self) -> str:
        s = f"patched {len(self.patched)} site(s)"
        if self.refused:
            s += f", refused {len(self.refused)}"
        return s


def _set(handle: PatchHandle, obj: Any, attr: str, value: Any) -> None:
    old = obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, attr, _MISSING)
    handle._undo.append((obj, attr, old))
    setattr(obj, attr, value)


def _resolve(model: Any, path: str) -> Any:
    return model if path == "" else model.get_submodule(path)


def apply(plan_or_spec: Any, model: Any, *, strict: bool = False, preload: bool = True,
          target: str | None = None, log: Callable[[str], None] | None = None) -> PatchHandle:
    """Patch ``model`` according to a PatchPlan (or a spec / spec path / spec text, planned here).

    A site whose module does not fit its op is refused with a one-line reason (``handle.refused``)
    and left unpatched; ``strict=True`` raises PatchError instead.
    """
    target = target or detect_target()
    plan = plan_or_spec if isinstance(plan_or_spec, PatchPlan) else make_plan(plan_or_spec, model, target=target)
    if plan.model_class != type(model).__name__:
        raise PatchError(f"the plan was made for {plan.model_class}, not {type(model).__name__}")
    handle = PatchHandle(plan)
    modules = dict(model.named_modules())      # snapshot before patching
    try:
        for site in plan.sites:
            op = get_op(site.op)
            if site.path not in modules and site.path != "":
                raise PatchError(f"{site.path} is in the plan but not in the model")
            module = modules.get(site.path, model)
            host = modules.get(site.host, model) if site.host else model
            owner = getattr(host, SITE_ATTR, None)
            if owner is not None:
                raise PatchError(f"{site.host or '<model>'} is already patched ({owner}); undo that handle first")
            info = plan.infos.get(site.path)
            if info is None:
                info = build_index(module).infos[""]
            info = info.with_host(plan.infos.get(site.host))
            flags = site.flag_dict
            reason = op.check(unwrap(module), info, flags)
            if reason is None and host is not module:
                # ops hosted elsewhere (the loss path on the causal LM) also vet the host
                reason = op.check(unwrap(host), info, flags)
            if reason:
                r = Refusal(site.path, site.op, site.rule, reason)
                if strict:
                    raise PatchError(str(r))
                handle.refused.append(r)
                if log:
                    log(str(r))
                continue
            kernels = kernel_getter(op, info, flags, target, list(plan.dtypes) if preload else [])
            for obj, attr, value in op.install(host, kernels, flags, info):
                _set(handle, obj, attr, value)
            _set(handle, host, SITE_ATTR, f"{site.op} from {site.rule}")
            handle.patched.append(site.path)
        if plan.attention is not None:
            # the model's attention implementation, on this instance only (see ops/attention_impl.py)
            for obj, attr, value in plan.attention.install(model):
                _set(handle, obj, attr, value)
    except BaseException:
        handle.undo()
        raise
    return handle


def patch_module(module: Any, op_name: str, *, target: str | None = None, **flags: Any) -> PatchHandle:
    """Patch one module with one op (no spec): for tests and for programmatic use."""
    op = get_op(op_name)
    if op is None:
        raise PatchError(f"unknown op {op_name!r}")
    target = target or detect_target()
    info = build_index(module).infos[""]
    resolved = op.default_flags()
    for k, v in flags.items():
        spec = op.flag(k)
        if spec is None:
            raise PatchError(f"unknown flag {k!r} for {op_name}")
        resolved[k] = spec.coerce(v)
    handle = PatchHandle(None)
    reason = op.check(unwrap(module), info, resolved)
    if reason:
        raise PatchError(f"refused {op_name} on {type(module).__name__}: {reason}")
    kernels = kernel_getter(op, info, resolved, target)
    for obj, attr, value in op.install(module, kernels, resolved, info):
        _set(handle, obj, attr, value)
    handle.patched.append("")
    return handle
