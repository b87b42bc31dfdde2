"""Apply a PatchPlan to a live model; undo it.

The rules (docs/reliability.md, "Runtime, plan files and the kernel cache"):

* ``apply`` checks every site on the LIVE module, not only the facts recorded at plan time: the
  class, the structural facts the op specialises on (sizes, eps, offset, casting, ...), the
  parameter dtype, and that the parameters sit on the device the kernels target.  A site whose
  facts changed since planning (eps set after planning, a plan made on another instance) is
  refused with the difference as its reason.  The op's own ``check`` then runs on the live module.
* Strict mode is all or nothing: the first refusal raises PatchError and nothing stays patched;
  any error while patching undoes what was done.
* Forward hooks (``register_forward_hook`` / pre-hooks) live on the module and keep running.
  A ``forward`` set on the instance BEFORE apply: an accelerate hook (``_hf_hook`` plus
  ``_old_forward``) keeps being called; apply replaces ``_old_forward``, the function the hook
  calls.  Any other instance-level forward is refused (patchdsl does not drop or blindly wrap
  code it does not know): apply first, or remove it.
* ``undo`` restores an attribute only while it still holds the value apply set: a forward the
  user set after apply stays (listed in ``handle.left``).
* A ``copy.deepcopy`` of a patched model is patched too, consistently: its forwards are bound to
  the copy and read the copy's weights, and it carries its own record, so ``undo`` of the
  original leaves it alone and :func:`unpatch` (``patchdsl.unpatch``) restores it.
* DTensor parameters (tensor / sequence / expert parallelism applied before apply): each site's layout
  is read once here (patchdsl.distributed), refused unless its op declares it, and the kernels are
  specialised for what the rank holds; a model without DTensor parameters pays one look over its
  parameters.  A parallel plan applied after apply is refused at ``register_parameter``.
* Kernels exist for fp32, bf16 and fp16.  A patched forward called with another dtype (a model
  cast to float64 after apply) raises :class:`UnsupportedDtype`, which says to undo first.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..codegen import KernelKey, load_kernel
from ..distributed import has_dtensors, localise, placement_reason, site_layout, wrap_installs
from ..distributed.layout import has_fsdp
from ..distributed.layout import site_scope
from ..distributed.local import covered_hooks
from ..distributed.watch import watch
from ..kernel_support.custom_ops import compiling
from ..codegen.env import target as detect_target
from ..model.index import module_info
from ..model.info import ModuleInfo
from ..ops.base import Op
from ..util.vocab import dtype_name
from ..ops.registry import get_op
from ..util.vocab import DTYPES, dtype_name, torch_dtype
from ..planning.plan import PatchPlan
from ..planning.plan_file import PlanError
from ..planning.availability import Unavailable, resolve_here
from ..planning.site_check import check_site
from ..planning.planner import plan as make_plan

class _Missing:
    """'There was no instance attribute': one object, kept by copy/deepcopy/pickle."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
SITE_ATTR = "_patchdsl_site"


class PatchError(RuntimeError):
    """The plan does not fit the model (wrong model, already patched, a refused site with strict=True)."""


class UnsupportedDtype(PatchError, TypeError):
    """A patched forward was called with a dtype its kernels do not cover (e.g. float64)."""


@dataclass(frozen=True)
class Refusal:
    path: str
    op: str
    rule: str
    reason: str
    optional: bool = False

    def __str__(self) -> str:
        return f"{self.rule}: refused {self.op} on {self.path}: {self.reason}"


@dataclass
class SiteRecord:
    """Stored on a patched host (``host._patchdsl_site``): what apply set there and what it replaced.
    Deep-copied with the module, so a copy can be unpatched on its own (:func:`unpatch`)."""

    label: str
    changes: list = field(default_factory=list)    # (attribute, old value or _MISSING, new value)

    def __str__(self) -> str:
        return self.label


def kernel_getter(op: Op, info: ModuleInfo, flags: dict, target: str, preload: list[str] = ()) -> Callable:
    """``get(torch_dtype) -> generated module`` with a per-site dict cache (cheap per call)."""
    cache: dict[Any, Any] = {}

    def get(dt):
        mod = cache.get(dt)
        if mod is None:
            if compiling():
                # rendering and importing a module cannot be traced: say what to do instead of
                # letting Dynamo fail somewhere inside importlib
                have = ", ".join(dtype_name(d) for d in cache) or "none"
                raise RuntimeError(
                    f"{op.name} on {info.path or '<model>'}: no kernel was loaded for {dtype_name(dt)} before "
                    f"torch.compile traced the model (loaded: {have}); add {dtype_name(dt)} to the spec's "
                    "dtype line, or run one eager step first")
            name = dtype_name(dt)
            if name not in DTYPES:
                raise UnsupportedDtype(
                    f"{op.name} has kernels for float32, bfloat16 and float16 only, not {dt} (was the model cast "
                    f"after patchdsl.apply? call handle.undo() before casting, then apply again)")
            params = op.key_params(info, flags, name, target)
            # an external op loads its third-party kernel; a generated one is rendered and imported
            mod = op.load(params) if op.external else load_kernel(
                KernelKey.for_op(op, params))
            cache[dt] = mod
        return mod

    if preload:
        import torch

        for d in preload:
            get(torch_dtype(d))
    return get


def _holds(obj: Any, attr: str, value: Any) -> bool:
    d = getattr(obj, "__dict__", None)
    cur = d.get(attr, _MISSING) if d is not None else getattr(obj, attr, _MISSING)
    return cur is value


def _restore(obj: Any, attr: str, old: Any) -> None:
    if old is _MISSING:
        try:
            delattr(obj, attr)
        except AttributeError:
            pass
    else:
        setattr(obj, attr, old)


@dataclass
class PatchHandle:
    """What ``apply`` did: the patched sites, the refused ones, and how to undo it all."""

    plan: Any
    patched: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    # site path -> the DTensor layout it runs on (patchdsl.distributed), for sites that have one
    placements: dict[str, str] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)       # attributes undo left alone (changed since apply)
    _undo: list[tuple[Any, str, Any, Any]] = field(default_factory=list, repr=False)
    active: bool = True

    def undo(self) -> None:
        """Restore every attribute this handle changed, in reverse order, where it still holds
        the value apply set (a value set since is left alone and listed in ``left``).  Idempotent."""
        while self._undo:
            obj, attr, old, new = self._undo.pop()
            if _holds(obj, attr, new):
                _restore(obj, attr, old)
            else:
                self.left.append(f"{type(obj).__name__}.{attr}")
        self.active = False

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    @property
    def refused_required(self) -> list[Refusal]:
        """Refusals of sites the spec asked for (not marked optional)."""
        return [r for r in self.refused if not r.optional]

    def summary(self) -> str:
        s = f"patched {len(self.patched)} site(s)"
        if self.refused:
            s += f", refused {len(self.refused)}"
        return s


def set_recorded(handle: PatchHandle, record: SiteRecord | None, obj: Any, attr: str, value: Any) -> None:
    old = obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, attr, _MISSING)
    handle._undo.append((obj, attr, old, value))
    setattr(obj, attr, value)
    if record is not None:
        record.changes.append((attr, old, value))


def unpatch(model: Any) -> int:
    """Remove every patchdsl patch found on ``model``'s modules (e.g. on a deepcopy of a patched
    model, which has no handle); return how many sites were restored.  Attributes changed since
    they were patched are left alone."""
    n = 0
    for _, m in model.named_modules():
        rec = m.__dict__.get(SITE_ATTR)
        if not isinstance(rec, SiteRecord):
            continue
        for attr, old, new in reversed(rec.changes):
            if _holds(m, attr, new):
                _restore(m, attr, old)
        m.__dict__.pop(SITE_ATTR, None)
        n += 1
    return n


def _fmt(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=repr) if not isinstance(v, str) else repr(v)


def _fact_diff(planned: ModuleInfo, live: ModuleInfo, kinds: tuple[str, ...]) -> list[str]:
    out = []
    if planned.cls != live.cls:
        out.append(f"class: plan {planned.cls}, module {live.cls}")
    for k in kinds:
        a, b = dict(planned.facts(k)), dict(live.facts(k))
        if not a and not b:
            continue
        if not b:
            out.append(f"no longer a {k}")
            continue
        if not a:
            continue
        for n in sorted(set(a) | set(b)):
            if _fmt(a.get(n)) != _fmt(b.get(n)):
                out.append(f"{k} {n}: plan {_fmt(a.get(n))}, module {_fmt(b.get(n))}")
    if planned.dtype != live.dtype:
        out.append(f"dtype: plan {planned.dtype}, module {live.dtype}")
    return out


def _device_reason(module: Any, target: str) -> str | None:
    p = next(module.parameters(), None) if hasattr(module, "parameters") else None
    if p is None:
        return None
    dev = p.device.type
    if dev == "meta":
        return "its parameters are on the meta device (load or materialise the weights before apply)"
    want = "cuda" if target == "cuda" else "cpu"
    if dev != want:
        return (f"its parameters are on {dev} but the kernels target {target} "
                f"(move the model to {want}, or plan for the matching target)")
    return None


def _live_reason(site, op: Op, plan: PatchPlan, module: Any, host: Any, target: str) -> tuple[str | None, ModuleInfo]:
    """Compare the live module (and host) with the plan; return (reason or None, live info)."""
    planned = plan.infos.get(site.path)
    live = module_info(module, site.path)
    live_host = module_info(host, site.host) if host is not module else None
    info = live.with_host(live_host)
    kinds = tuple(dict.fromkeys(op.kinds + ("CausalLM", "Linear")))
    diffs = []
    if planned is not None:
        diffs += _fact_diff(planned, live, kinds)
        ph = plan.infos.get(site.host)
        if live_host is not None and ph is not None:
            diffs += [f"host {d}" for d in _fact_diff(ph, live_host, ("CausalLM",))]
    if not diffs:
        flags = site.flag_dict
        for key in site.keys:
            dt = key.param_dict.get("dtype")
            try:
                params = op.key_params(info, flags, dt, target)
            except Exception as e:
                return f"its facts no longer fit {op.name}: {type(e).__name__}: {e}", info
            derived = KernelKey.for_op(op, params)
            if derived != key:
                rec = key.param_dict
                diffs += [f"kernel {n}: plan {_fmt(rec.get(n))}, module {_fmt(params.get(n))}"
                          for n in sorted(set(rec) | set(params)) if _fmt(rec.get(n)) != _fmt(params.get(n))]
                break
    if diffs:
        return ("the module does not match the plan (changed since planning, or another model): "
                + "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")), info
    return _device_reason(module, target) or _device_reason(host, target), info


def _forward_slot(obj: Any) -> tuple[str | None, str | None]:
    """Where a patched forward goes on ``obj``: ("forward", None) normally, ("_old_forward", None)
    under an accelerate hook, (None, reason) for an unknown instance-level forward."""
    d = getattr(obj, "__dict__", {})
    if "forward" not in d:
        return "forward", None
    if hasattr(obj, "_hf_hook") and "_old_forward" in d:
        return "_old_forward", None
    f = d["forward"]
    name = getattr(f, "__qualname__", None) or type(f).__name__
    return None, (f"its forward was replaced on the instance before apply (by {name}); patchdsl will not drop "
                  f"it or guess how to wrap it: apply patchdsl first, or remove that wrapper "
                  f"(accelerate hooks are kept)")


def unsharded_name(class_name: str) -> str:
    """The class name without the ``FSDP`` prefix of the subclass FSDP2's ``fully_shard`` swaps in
    (``FSDPQwen3ForCausalLM`` -> ``Qwen3ForCausalLM``): a plan made before sharding fits after it."""
    return class_name[4:] if class_name.startswith("FSDP") and class_name[4:5].isupper() else class_name



def distributed_site(op: Op, module: Any, info: ModuleInfo, flags: dict, fsdp: bool | None):
    """(layout or None, the info the kernels are specialised for, refusal or None) of a site under DTensor
    parallelism; ``fsdp`` None: the model has no DTensor parameter (nothing is looked at)."""
    if fsdp is None:
        return None, info, None
    from ..model.modules import unwrap

    layout = site_layout(op.kinds, unwrap(module), info, fsdp, op.covers)
    if layout is None:
        return None, info, None
    why = placement_reason(op, layout, flags)
    if why is None and layout.name == "heads":
        why = covered_hooks(unwrap(module), op.covers)
    return layout, (localise(info, layout) if why is None else info), why


def placements(plan_or_spec: Any, model: Any) -> dict[str, str]:
    """What each site of the plan (or of the spec, planned here) will run on in ``model``, as apply will
    decide it, without patching: ``"whole"`` (no DTensor parameters), a layout (``"heads over 2 ranks
    (...)"``), or ``"refused: <reason>"``."""
    plan = plan_or_spec if isinstance(plan_or_spec, PatchPlan) else make_plan(plan_or_spec, model)
    fsdp = has_fsdp(model) if has_dtensors(model) else None
    modules = dict(model.named_modules())
    out = {}
    for site in plan.sites:
        if site.refused:
            out[site.path] = f"refused: {site.refused}"
            continue
        op, module = get_op(site.op), modules.get(site.path, model)
        info = plan.infos[site.path].with_host(plan.infos.get(site.host))
        layout, _, why = distributed_site(op, module, info, site.flag_dict, fsdp)
        out[site.path] = f"refused: {why}" if why else layout.describe() if layout is not None else "whole"
    return out


def _watch_whole(op: Op, module: Any, host: Any, record: SiteRecord, path: str, what: str) -> None:
    """A site patched on unsharded parameters refuses a tensor-parallel plan applied to it afterwards
    (patchdsl.distributed.watch: at parallelize_module's register_parameter, nothing per call)."""
    import weakref

    from ..model.modules import unwrap

    ref = weakref.ref(host)

    def still_patched() -> bool:
        h = ref()
        return h is not None and h.__dict__.get(SITE_ATTR) is record

    mods = [(".".join(x for x in (path, pre, sub) if x), m)
            for pre, top in site_scope(op.kinds, op.covers, unwrap(module)) for sub, m in top.named_modules()]
    watch(mods, what, still_patched)


def uncovered_modules(plan: PatchPlan, model: Any) -> list[Refusal]:
    """Modules of ``model`` the plan never saw (not in ``plan.structure``) that are like a site of it
    (same leaf name and class: ``model.layers.5.mlp`` beside a plan for ``model.layers.1.mlp``), as
    refusals: the spec would have selected them, the plan cannot patch them."""
    from ..model.modules import unwrap

    if not plan.structure:
        raise PlanError("the plan records no model structure (make it with patchdsl.plan or read it from a plan file)")
    seen = dict(plan.structure)
    like: dict[tuple[str, str], Any] = {}
    for s in plan.sites:
        like.setdefault((s.path.rsplit(".", 1)[-1], unsharded_name(s.cls)), s)
    out = []
    for path, m in model.named_modules():
        if path in seen:
            continue
        s = like.get((path.rsplit(".", 1)[-1], unsharded_name(type(unwrap(m)).__name__)))
        if s is not None:
            out.append(Refusal(path, s.op, s.rule, f"not covered by the plan: the model it was made on has no {path} "
                                                   f"(it patches {s.path} alike); plan again for this model", s.optional))
    return out


def apply(plan_or_spec: Any, model: Any, *, strict: bool = False, preload: bool = True,
          target: str | None = None, log: Callable[[str], None] | None = None) -> PatchHandle:
    """Patch ``model`` according to a PatchPlan, a plan file (``*.json`` path, or its parsed JSON
    dict: checked by :meth:`PatchPlan.from_json`), or a spec / spec path / spec text (planned here).

    A site whose module does not fit its op, or no longer matches the plan, is refused with a
    one-line reason (``handle.refused``) and left unpatched; ``strict=True`` raises PatchError
    instead, with nothing patched.
    """
    target = target or detect_target()
    partitioned = next((n for n, p in model.named_parameters() if hasattr(p, "ds_shape")), None)
    if partitioned is not None:
        raise PatchError(f"the model's weights are DeepSpeed ZeRO-3 partitions (e.g. {partitioned}): patch "
                         "before deepspeed.initialize and outside deepspeed.zero.Init (docs/distributed.md)")
    if isinstance(plan_or_spec, dict):                      # a plan file's JSON: checked like a fresh plan
        plan_or_spec = PatchPlan.from_json(plan_or_spec)
    elif isinstance(plan_or_spec, (str, os.PathLike)) and str(plan_or_spec).endswith(".json"):
        plan_or_spec = PatchPlan.load(plan_or_spec)
    fresh = not isinstance(plan_or_spec, PatchPlan)
    plan = make_plan(plan_or_spec, model, target=target) if fresh else plan_or_spec
    if unsharded_name(plan.model_class) != unsharded_name(type(model).__name__):
        raise PatchError(f"the plan was made for {plan.model_class}, not {type(model).__name__}")
    if plan.target != target:
        raise PatchError(f"the plan's kernels target {plan.target}, but this process runs {target} kernels; "
                         f"plan again with target={target!r}")
    uncovered: list[Refusal] = []
    if not fresh:
        # a plan not made in this call meets the availability and attention checks plan makes
        # (planning.availability.resolve_here: packages, GPU, a local repository's files against its sha256 pin,
        # before anything is imported), and must know every module like the ones it patches
        try:
            plan = resolve_here(plan, type(model))
        except Unavailable as e:
            where = f" ({e.site.rule})" if e.site is not None and e.site.rule else ""
            raise PlanError(f"{'site ' if e.site is not None else ''}{e}{where}") from None
        uncovered = uncovered_modules(plan, model)
        if uncovered and strict:
            names = ", ".join(r.path for r in uncovered[:6]) + (f" and {len(uncovered) - 6} more" if len(uncovered) > 6 else "")
            raise PatchError(f"the plan does not cover this model: {len(uncovered)} module(s) like the ones it patches "
                             f"are not in the model it was made on: {names}; plan again for this model")
    handle = PatchHandle(plan)
    handle.refused.extend(uncovered)
    for r in uncovered:
        if log:
            log(str(r))
    modules = dict(model.named_modules())      # snapshot before patching
    fsdp = has_fsdp(model) if has_dtensors(model) else None     # DTensor layouts: looked at only then
    try:
        for site in plan.sites:
            op = get_op(site.op)
            if site.path not in modules and site.path != "":
                raise PatchError(f"{site.path} is in the plan but not in the model")
            if site.host not in modules and site.host != "":
                raise PatchError(f"{site.host} is in the plan but not in the model")
            module = modules.get(site.path, model)
            host = modules.get(site.host, model) if site.host else model
            owner = getattr(host, SITE_ATTR, None)
            if owner is not None:
                raise PatchError(f"{site.host or '<model>'} is already patched ({owner}); undo that handle first")
            flags = site.flag_dict
            reason = site.refused or None
            info = None
            if reason is None:
                if fresh:
                    info = plan.infos[site.path].with_host(plan.infos.get(site.host))
                    reason = _device_reason(module, target) or _device_reason(host, target)
                else:
                    reason, info = _live_reason(site, op, plan, module, host, target)
            if reason is None:
                reason = check_site(op, module, host, info, flags)
            layout = None
            if reason is None:
                layout, info, reason = distributed_site(op, module, info, flags, fsdp)
            installs = []
            if reason is None:
                kernels = kernel_getter(op, info, flags, target, list(plan.dtypes) if preload else [])
                wanted = op.install(host, kernels, flags, info)
                if layout is not None:          # what the layout needs around the forward (distributed/)
                    wanted, reason = wrap_installs(layout.name, op.covers, host, wanted)
                for obj, attr, value in wanted if reason is None else ():
                    if attr == "forward" and not op.wraps_instance_forward:
                        attr, why = _forward_slot(obj)
                        if why:
                            reason = why
                            break
                    installs.append((obj, attr, value))
            if reason:
                r = Refusal(site.path, site.op, site.rule, reason, site.optional)
                if strict:
                    raise PatchError(str(r))
                handle.refused.append(r)
                if log:
                    log(str(r))
                continue
            record = SiteRecord(f"{site.op} from {site.rule}")
            for obj, attr, value in installs:
                set_recorded(handle, record if obj is host else None, obj, attr, value)
            set_recorded(handle, None, host, SITE_ATTR, record)
            handle.patched.append(site.path)
            if layout is not None:
                handle.placements[site.path] = layout.describe()
                if log:
                    log(f"{site.path}: {site.op} on {layout.describe()}")
            else:
                _watch_whole(op, module, host, record, site.path, f"{site.path or '<model>'} ({site.op})")
        if plan.attention is not None:
            # the model's attention implementation, on this instance only (see ops/attention_impl.py)
            for obj, attr, value in plan.attention.install(model):
                set_recorded(handle, None, obj, attr, value)
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
    info = module_info(module, "")
    resolved = op.default_flags()
    for k, v in flags.items():
        spec = op.flag(k)
        if spec is None:
            raise PatchError(f"unknown flag {k!r} for {op_name}")
        resolved[k] = spec.coerce(v)
    handle = PatchHandle(None)
    reason = check_site(op, module, module, info, resolved)
    layout = None
    if reason is None and has_dtensors(module):
        layout, info, reason = distributed_site(op, module, info, resolved, has_fsdp(module))
    if reason:
        raise PatchError(f"refused {op_name} on {type(module).__name__}: {reason}")
    # the module's own dtype is loaded now: a kernel cannot be loaded while torch.compile traces
    preload = [info.dtype] if info.dtype in DTYPES else []
    kernels = kernel_getter(op, info, resolved, target, preload)
    installs = op.install(module, kernels, resolved, info)
    if layout is not None:
        installs, why = wrap_installs(layout.name, op.covers, module, installs)
        if why:
            raise PatchError(f"refused {op_name} on {type(module).__name__}: {why}")
        handle.placements[""] = layout.describe()
    for obj, attr, value in installs:
        if attr == "forward" and not op.wraps_instance_forward:
            attr, why = _forward_slot(obj)
            if why:
                handle.undo()
                raise PatchError(f"refused {op_name} on {type(module).__name__}: {why}")
        set_recorded(handle, None, obj, attr, value)
    handle.patched.append("")
    return handle
