"""The patch plan: rules resolved against a model, as frozen data that round-trips through JSON.

Precedence (documented in docs/language.md, tested in tests/test_precedence.py):
  1. Rules apply in file order (includes expanded where they stand).
  2. A later rule that gives the SAME op to a module refines its flags: each flag it sets
     overrides; flags it does not set keep their earlier value.  ``flag_sources`` records
     which rule (or default directive) set each flag.
  3. A later rule that gives a DIFFERENT op to a module is an error naming both lines.
  4. Flag values: op default < ``default OP(...)`` directives < rules, in that order.
  5. An op that fuses child modules (fused_qk_norm_rope covers q_norm and k_norm) conflicts
     with any rule patching those children.
  6. A rule that matches nothing is an error unless marked ``optional``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from .check import CheckedSpec, check_spec
from .codegen.keys import KernelKey
from .codegen.render import CodegenError, validate_key
from .model.index import ModelIndex, build_index
from .ops.attention_impl import KNOWN as KNOWN_ATTENTION
from .ops.attention_impl import AttentionChoice, attention_problem, choose_attention
from .model.info import ModuleInfo
from .ops.registry import get_op
from .select import dead_members, explain_dead_member, explain_misfits, explain_no_match, select_all
from .syntax.ast import Spec
from .syntax.errors import SpecError

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Site:
    path: str
    cls: str
    op: str
    flags: tuple[tuple[str, Any], ...]
    flag_sources: tuple[tuple[str, str], ...]
    rule: str                     # file:line of the first rule that selected the module
    rules: tuple[str, ...]        # every rule that touched it, in order
    matched_by: str               # "kind SwiGLU" / "class Qwen3MLP (SwiGLU)"
    host: str                     # module whose forward is replaced
    keys: tuple[KernelKey, ...]   # one per dtype in the plan
    covers: tuple[str, ...] = ()  # child module paths fused into this site
    refused: str = ""             # why apply would refuse this site ("" = it will be patched)
    optional: bool = False        # every rule that selected it is marked optional: a refusal is no failure

    @property
    def patched(self) -> bool:
        return not self.refused
    source: str = ""              # external ops: where the kernel comes from, with its pin

    @property
    def flag_dict(self) -> dict[str, Any]:
        return dict(self.flags)

    def key_for(self, dtype: str) -> KernelKey | None:
        return next((k for k in self.keys if k.param_dict.get("dtype") == dtype), None)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "class": self.cls, "op": self.op, "flags": dict(self.flags),
                "flag_sources": dict(self.flag_sources), "rule": self.rule, "rules": list(self.rules),
                "matched_by": self.matched_by, "host": self.host, "covers": list(self.covers),
                "refused": self.refused, "optional": self.optional, "source": self.source,
                "kernels": [k.to_json() for k in self.keys]}


@dataclass(frozen=True)
class PatchPlan:
    spec: str
    model_class: str
    model_type: str | None
    target: str
    dtypes: tuple[str, ...]
    sites: tuple[Site, ...]
    unmatched_optional: tuple[str, ...] = ()
    totals: tuple[tuple[str, int, int], ...] = ()   # (module name, patched, present)
    infos: Mapping[str, ModuleInfo] = field(default_factory=dict, compare=False, repr=False)
    attention: AttentionChoice | None = None        # the ``attention`` directive, per model instance
    # (path, class) of every module of the model planned on: apply refuses modules it does not know
    structure: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __iter__(self):
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def site(self, path: str) -> Site | None:
        return next((s for s in self.sites if s.path == path), None)

    def kernel_keys(self) -> list[KernelKey]:
        """The kernels of the sites that will be patched (a refused site needs none)."""
        seen: dict[KernelKey, None] = {}
        for s in self.sites:
            if s.refused:
                continue
            for k in s.keys:
                if k.template:
                    seen.setdefault(k, None)
        return list(seen)

    def external_sites(self) -> list[Site]:
        return [s for s in self.sites if s.source]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "spec": self.spec, "model_class": self.model_class,
            "model_type": self.model_type, "target": self.target, "dtypes": list(self.dtypes),
            "sites": [s.to_json() for s in self.sites],
            "unmatched_optional": list(self.unmatched_optional),
            "totals": [{"name": n, "patched": p, "present": t} for n, p, t in self.totals],
            "attention": self.attention.to_json() if self.attention else None,
            "structure": dict(self.structure),
            "modules": {p: {"class": i.cls, "bases": list(i.bases), "kinds": {k: dict(v) for k, v in i.kinds.items()},
                            "dtype": i.dtype, "children": list(i.children)}
                        for p, i in self.infos.items()},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False, default=str)

    @classmethod
    def from_json(cls, d: Any) -> "PatchPlan":
        """A plan read back from JSON, checked exactly as a freshly made one: every field is typed
        and validated, flags go through the op's FlagSpecs, module facts are checked, and every
        kernel key is re-derived from the recorded facts and flags with the op's ``key_params``
        (a recorded key that differs is an error).  Raises :class:`PlanError`."""
        return _load_plan(d)

    @classmethod
    def loads(cls, text: str) -> "PatchPlan":
        from .files import FileReadError, parse_json

        try:
            d = parse_json(text, "the plan")
        except FileReadError as e:
            raise PlanError(f"not a JSON plan file: {e}") from None
        return _load_plan(d)

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "PatchPlan":
        """A plan file, read through :mod:`patchdsl.files` (a regular file of at most 64 MiB, UTF-8,
        bounded nesting) and checked by :meth:`loads`.  Raises :class:`PlanError`."""
        from .files import FileReadError, read_text

        try:
            text = read_text(path, "plan", what="plan file")
        except FileReadError as e:
            raise PlanError(str(e)) from None
        return cls.loads(text)

    @property
    def refused_sites(self) -> tuple[Site, ...]:
        return tuple(s for s in self.sites if s.refused)


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else "<root>"


def count_totals(sites: tuple[Site, ...] | list[Site], present: Mapping[str, int]) -> tuple[tuple[str, int, int], ...]:
    """Per leaf name: (name, patched, present).  A refused site and what it would fuse count as
    present, never as patched."""
    names = dict.fromkeys([_leaf(s.path) for s in sites] + [_leaf(c) for s in sites for c in s.covers])
    patched = Counter(_leaf(s.path) for s in sites if not s.refused)
    for s in sites:
        if not s.refused:
            for c in s.covers:
                patched[_leaf(c)] += 1
    return tuple((n, patched[n], max(int(present.get(n, 0)), patched[n])) for n in names)


def plan_index(checked: CheckedSpec, index: ModelIndex, *, target: str = "cuda",
               dtypes: tuple[str, ...] | None = None,
               check: Callable[[Any, str, str, ModuleInfo, Mapping[str, Any]], str | None] | None = None) -> PatchPlan:
    """Resolve a checked spec against a model index.  Pure (``check`` aside).

    ``check(op, path, host, info, flags)`` says why apply would refuse a site (see
    :func:`model_checker`); a refused site stays in the plan with its reason, is never counted as
    patched in the totals, and generates no kernel."""
    spec = checked.spec
    dts = tuple(dtypes or spec.dtypes or (index.dtype,))
    state: dict[str, dict[str, Any]] = {}   # path -> {"op", "flags", "rules", "how", "span"}
    order: list[str] = []
    unmatched: list[str] = []
    errors: list[SpecError] = []     # every error of the spec is reported at once
    for cr in checked.rules:
        rule = cr.rule
        op = get_op(cr.op)
        assert op is not None
        matches, misfits = select_all(rule, op, index)
        if misfits:
            errors.append(explain_misfits(rule, op, misfits, len(matches), index))
            continue
        if not matches:
            if rule.optional:
                # say why: the selector may well have matched modules of another kind (MixtralExperts
                # under 'SwiGLU'); explain_no_match's message and hint tell which and what fits
                why = explain_no_match(rule, op, index)
                note = why.message if "matched 0 modules" not in why.message else ""
                note += (("; " if note else "") + why.hint) if why.hint and note else ""
                unmatched.append(f"{rule.span.short}: {rule.text}" + (f" ({note})" if note else ""))
                continue
            errors.append(explain_no_match(rule, op, index))
            continue
        dead = dead_members(rule, matches)
        for sel, member in dead:
            if rule.optional:
                unmatched.append(f"{rule.span.short}: {member} (in {rule.text})")
            else:
                errors.append(explain_dead_member(rule, op, index, sel, member))
        if dead and not rule.optional:
            continue
        for m in matches:
            st = state.get(m.info.path)
            if st is None:
                flags = checked.base_flags(op)
                st = {"op": op.name, "flags": flags, "rules": [], "how": m.how, "span": rule.span, "optional": True}
                state[m.info.path] = st
                order.append(m.info.path)
            elif st["op"] != op.name:
                errors.append(SpecError(
                    f"{m.info.path} would get two different ops: {st['op']} and {op.name}", rule.op.span,
                    notes=[(f"{st['op']} given here", st["span"])],
                    hint="a module gets one op; narrow one selector (e.g. with !path) or drop a rule"))
                break
            for name, fv in cr.explicit:
                st["flags"][name] = fv
            st["rules"].append(rule.span.short)
            st["optional"] = st["optional"] and bool(rule.optional)
    # fused children: an op that covers q_norm/k_norm conflicts with rules patching them
    covered: dict[str, str] = {}
    for path in order:
        op = get_op(state[path]["op"])
        for child in op.covers:
            cp = f"{path}.{child}" if path else child
            if cp in state:
                errors.append(SpecError(
                    f"{cp} is fused into {path} by {op.name}, and also patched with {state[cp]['op']}",
                    state[cp]["span"], notes=[(f"{op.name} given here", state[path]["span"])],
                    hint=f"drop the rule for {child}, or exclude it: '!*.{child}'"))
                continue
            if cp in index.infos:
                covered[cp] = path
    if errors:
        raise SpecError.combine(errors)
    sites = []
    hosts: dict[str, str] = {}
    for path in order:
        st = state[path]
        op = get_op(st["op"])
        info = index.infos[path]
        host = op.host(info, index)
        if host in hosts and hosts[host] != path:
            errors.append(SpecError(f"{path} and {hosts[host]} both need to replace the forward of "
                                    f"'{host or '<model>'}'", st["span"]))
            continue
        hosts[host] = path
        flags = {k: v.value for k, v in st["flags"].items()}
        sources = {k: v.source for k, v in st["flags"].items()}
        minfo = info.with_host(index.infos.get(host))
        covers = tuple(c for c, by in covered.items() if by == path)
        try:
            site = build_site(op, path, info.cls, host, minfo, flags, sources, dtypes=dts, target=target,
                              rule=st["rules"][0], rules=tuple(st["rules"]), matched_by=st["how"], covers=covers,
                              optional=st["optional"])
        except SiteError as e:
            raise SpecError(f"{path}: {e}", st["span"]) from None
        refused = (check(op, path, host, minfo, flags) if check is not None else None) or ""
        sites.append(replace(site, refused=refused) if refused else site)
    if errors:
        raise SpecError.combine(errors)
    present = Counter(_leaf(i.path) for i in index if i.path)
    totals = count_totals(sites, present)
    used = set(order) | set(covered) | {s.host for s in sites}
    infos = {p: index.infos[p] for p in index.infos if p in used}
    attention = choose_attention(spec.attention) if spec.attention is not None else None
    return PatchPlan(spec.path, index.model_class, index.model_type, target, dts, tuple(sites),
                     tuple(unmatched), totals, infos, attention, tuple((i.path, i.cls) for i in index))


class SiteError(ValueError):
    """Why a site cannot be built (its caller says where: a spec span, a plan file field)."""


def build_site(op: Any, path: str, cls: str, host: str, info: ModuleInfo, flags: Mapping[str, Any],
               sources: Mapping[str, str], *, dtypes: tuple[str, ...], target: str, rule: str,
               rules: tuple[str, ...], matched_by: str, covers: tuple[str, ...] = (), refused: str = "",
               optional: bool = False) -> Site:
    """The one constructor of a :class:`Site`, for the planner and for plan files alike: the op's
    ``validate`` on the resolved flags, every kernel key derived with ``key_params`` (and checked
    by ``validate_key`` for generated ops), and the external source derived from the key, never
    taken from anyone.  ``info`` is the site's facts with its host's (``with_host``).  Raises
    :class:`SiteError`."""
    bad = op.validate(flags)
    if bad:
        raise SiteError(bad)
    keys = []
    for dt in dtypes:
        try:
            params = op.key_params(info, flags, dt, target)
            key = KernelKey.for_op(op, params)
            if not op.external:         # external ops load a third-party kernel: nothing is rendered
                validate_key(key)
        except CodegenError as e:
            raise SiteError(str(e)) from None
        except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError, IndexError) as e:
            # facts of the wrong shape (a plan file's `qk_norm: true` where an object belongs)
            raise SiteError(f"the module's facts do not fit {op.name} ({type(e).__name__}: {str(e)[:120]})") from None
        keys.append(key)
    source = op.source(keys[0].param_dict) if op.external and keys else ""
    return Site(path, cls, op.name, tuple(flags.items()), tuple(sources.items()), rule, tuple(rules), matched_by,
                host, tuple(keys), tuple(covers), refused, optional, source)


class Unavailable(Exception):
    """A site's kernel (``site``) or the attention implementation (``site`` None) that this machine cannot have."""

    def __init__(self, site: Site | None, message: str):
        super().__init__(message)
        self.site = site


def resolve_here(plan: PatchPlan, model_cls: type | None = None) -> PatchPlan:
    """The availability and attention checks, for a plan just made (:func:`check_available`) and for a
    plan file at apply alike: every external site's kernel must be loadable here (package, GPU,
    files; a local repository's files must hash to its ``sha256`` pin, checked before anything is
    imported) and the attention implementation must run here.  Returns the plan with each external
    site locked (``Op.lock``: a local repository's sha256 recorded, the site rebuilt by
    :func:`build_site`) and its source as resolved here.  Raises :class:`Unavailable`.  Not pure."""
    said: dict[tuple, str | None] = {}
    sites = []
    for s in plan.sites:
        op = get_op(s.op)
        if not op.external:
            for k in s.keys:        # a generated kernel this machine cannot run (fp8_linear off Hopper)
                why = op.unavailable(k.param_dict)
                if why:
                    raise Unavailable(s, f"{s.path}: {s.op} cannot be used here: {why}")
            sites.append(s)
            continue
        for k in s.keys:
            key = (s.op, k.params)
            if key not in said:
                said[key] = op.unavailable(k.param_dict)
            if said[key]:
                raise Unavailable(s, f"{s.path}: {s.source or s.op} cannot be used here: {said[key]}")
        extra = op.lock(s.keys[0].param_dict) if s.keys else {}
        if extra:
            info = plan.infos[s.path].with_host(plan.infos.get(s.host))
            try:
                s = build_site(op, s.path, s.cls, s.host, info, {**s.flag_dict, **extra},
                               {**dict(s.flag_sources), **{n: "plan (resolved here)" for n in extra}},
                               dtypes=plan.dtypes, target=plan.target, rule=s.rule, rules=s.rules,
                               matched_by=s.matched_by, covers=s.covers, refused=s.refused, optional=s.optional)
            except SiteError as e:
                raise Unavailable(s, f"{s.path}: {e}") from None
        sites.append(replace(s, source=op.resolved_source(s.keys[0].param_dict)) if s.keys else s)
    if plan.attention is not None:
        why = plan.attention.unavailable(plan.target, model_cls)
        if why:
            raise Unavailable(None, f"attention {plan.attention.impl} cannot run here: {why}")
    return replace(plan, sites=tuple(sites))


def check_available(checked: CheckedSpec, plan: PatchPlan, model_cls: type | None = None) -> PatchPlan:
    """Raise a SpecError naming the site (and its rule) whose kernel cannot be had on this machine:
    an external op whose package, GPU or files are missing, an attention implementation that
    cannot run here (:func:`resolve_here`, which a plan file meets at apply).  Returns the plan
    with each external site locked and its source as resolved here (a local repository's content
    hash, the commit a Hub pin resolved to).  Not pure."""
    spans = {cr.rule.span.short: cr.rule for cr in checked.rules}
    try:
        return resolve_here(plan, model_cls)
    except Unavailable as e:
        if e.site is None:
            raise SpecError(str(e), checked.spec.attention.span) from None
        rule = spans.get(e.site.rule)
        raise SpecError(str(e), rule.op.span if rule is not None else None) from None


def plan(spec: Spec | str, model: Any, *, target: str | None = None,
         dtypes: tuple[str, ...] | None = None) -> PatchPlan:
    """Plan ``spec`` (a Spec, a path or spec text) against ``model`` (a module, possibly on meta)."""
    from .check import check_loaded
    from .syntax import load_spec

    if not isinstance(spec, Spec):
        text = spec
        spec = check_loaded(lambda: load_spec(text)).spec
    if target is None:
        from .codegen.env import target as _target
        target = _target()
    checked = check_spec(spec)
    if isinstance(model, ModelIndex):
        return check_available(checked, plan_index(checked, model, target=target, dtypes=dtypes), None)
    # With the module tree at hand (meta device is fine) every check apply makes that needs no
    # weights runs now, so the plan shows what apply will refuse, and why.
    p = plan_index(checked, build_index(model), target=target, dtypes=dtypes, check=model_checker(model))
    return check_available(checked, p, type(model))


# ---------------------------------------------------------------------------------- checks
def check_site(op: Any, module: Any, host: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
    """Why ``op`` cannot patch ``module`` (hosted on ``host``), or None.  The one check that both
    ``plan`` (on the meta-device model) and ``apply`` (on the live one) run."""
    from .model.modules import unwrap

    reason = op.check(unwrap(module), info, flags)
    if reason is None and host is not None and host is not module:
        # ops hosted elsewhere (the loss path on the causal LM) also vet the host
        reason = op.check(unwrap(host), info, flags)
    return reason


def _check_key(op: Any, module: Any, host: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str:
    """Memo key for :func:`check_site` at plan time: the checks look at classes and the structure
    the index recorded, so layers of one class with equal facts and flags get one answer."""
    from .model.modules import unwrap

    def shape(m):
        m = unwrap(m)
        return (type(m), "forward" in getattr(m, "__dict__", {}),
                tuple((n, type(unwrap(c))) for n, c in m.named_children()))

    return repr((op.name, shape(module), shape(host) if host is not module else None,
                 json.dumps({k: dict(v) for k, v in info.kinds.items()}, sort_keys=True, default=repr),
                 info.dtype, json.dumps(dict(flags), sort_keys=True, default=repr)))


def model_checker(model: Any) -> Callable[[Any, str, str, ModuleInfo, Mapping[str, Any]], str | None]:
    """``check(op, path, host_path, info, flags)`` on ``model``'s modules (meta device is fine)."""
    modules = dict(model.named_modules())
    memo: dict[str, str | None] = {}

    def check(op, path, host_path, info, flags):
        module = modules.get(path, model if path == "" else None)
        host = modules.get(host_path, model if host_path == "" else None)
        if module is None or host is None:
            return f"{path or host_path} is not in the model"
        key = _check_key(op, module, host, info, flags)
        if key not in memo:
            try:
                memo[key] = check_site(op, module, host, info, flags)
            except Exception as e:      # a check that cannot run on this module refuses it
                memo[key] = f"cannot be checked: {type(e).__name__}: {e}"
        return memo[key]

    return check


# ---------------------------------------------------------------------------------- plan files
class PlanError(ValueError):
    """A plan file that is not a valid plan for this version of patchdsl (the message says where).

    The message is one line of at most MAX_MESSAGE characters: a value from the file that it quotes
    cannot start a new line of output or flood it."""

    MAX_MESSAGE = 1200

    def __init__(self, message: str = ""):
        text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(message))
        if len(text) > self.MAX_MESSAGE:
            text = text[:self.MAX_MESSAGE - 30] + f"... ({len(text):,} characters)"
        super().__init__(text)


_DTYPES = ("fp32", "bf16", "fp16")
_TARGETS = ("cuda", "interpreter")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"(?:[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Facts that are sizes: positive integers below 2**31 (a size the kernels index with).
SIZE_FACTS = frozenset({"hidden", "intermediate", "vocab", "head_dim", "n_heads", "n_kv_heads", "rotary_dim",
                        "in_features", "out_features"})
_FACT_STRINGS = re.compile(r"[A-Za-z0-9_]{1,64}")


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise PlanError(f"{where}: {what}")


def _text(v: Any, where: str, limit: int = 4096) -> str:
    _need(isinstance(v, str), where, f"expected a string, got {type(v).__name__}")
    _need(len(v) <= limit, where, f"longer than {limit} characters")
    _need(not _CONTROL.search(v), where, "contains a control character (a newline?)")
    return v


def _ident(v: Any, where: str) -> str:
    _need(isinstance(v, str) and bool(_IDENT.fullmatch(v)) and len(v) <= 200, where,
          f"expected an identifier, got {v!r:.80}")
    return v


def _mpath(v: Any, where: str) -> str:
    _need(isinstance(v, str) and bool(_PATH.fullmatch(v)) and len(v) <= 1000, where,
          f"expected a dotted module path, got {v!r:.80}")
    return v


def _obj(v: Any, where: str) -> Mapping[str, Any]:
    _need(isinstance(v, dict), where, f"expected an object, got {type(v).__name__}")
    return v


def _list(v: Any, where: str) -> list:
    _need(isinstance(v, list), where, f"expected a list, got {type(v).__name__}")
    return v


def check_fact(name: str, v: Any, where: str, depth: int = 0) -> Any:
    """A module fact (index data, plan file, config): a typed scalar or a small object of them.
    Sizes are positive integers below 2**31, numbers finite, strings short identifiers."""
    if isinstance(v, dict):
        _need(depth < 2, where, "facts nest too deep")
        return {_ident(k, where): check_fact(k, x, f"{where}.{k}", depth + 1) for k, x in v.items()}
    if name in SIZE_FACTS:
        _need(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 31, where,
              f"a size must be a positive integer below 2**31, got {v!r:.40}")
        return v
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        _need(abs(v) < 2 ** 63, where, "integer out of range")
        return v
    if isinstance(v, float):
        _need(math.isfinite(v), where, f"not a finite number: {v!r}")
        if name == "eps":
            _need(v >= 0, where, f"eps must be >= 0, got {v!r}")
        return v
    _need(isinstance(v, str) and bool(_FACT_STRINGS.fullmatch(v)), where,
          f"expected a number, true/false, null or a short identifier, got {v!r:.60}")
    return v


def _module_info(path: str, m: Any) -> ModuleInfo:
    from .model.kinds import KIND_NAMES

    where = f"modules[{path!r}]"
    m = _obj(m, where)
    kinds = {}
    for k, f in _obj(m.get("kinds", {}), f"{where}.kinds").items():
        _need(k in KIND_NAMES, f"{where}.kinds", f"unknown kind {k!r:.40}")
        kinds[k] = {_ident(n, f"{where}.kinds.{k}"): check_fact(n, v, f"{where}.kinds.{k}.{n}")
                    for n, v in _obj(f, f"{where}.kinds.{k}").items()}
    dtype = m.get("dtype")
    _need(dtype is None or dtype in _DTYPES, f"{where}.dtype", f"expected one of {', '.join(_DTYPES)} or null")
    return ModuleInfo(path, _ident(m.get("class"), f"{where}.class"),
                      tuple(_ident(b, f"{where}.bases") for b in _list(m.get("bases", []), f"{where}.bases")),
                      kinds, dtype,
                      tuple(_ident(c, f"{where}.children") for c in _list(m.get("children", []), f"{where}.children")))


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, allow_nan=True, default=repr)


def _load_site(i: int, d: Any, infos: Mapping[str, ModuleInfo], dtypes: tuple[str, ...], target: str) -> Site:
    from .codegen.render import CodegenError, validate_key
    from .ops.base import FlagTypeError

    where = f"sites[{i}]"
    d = _obj(d, where)
    path = _mpath(d.get("path"), f"{where}.path")
    where = f"site {path or '<model>'}"
    _need(path in infos, where, "its module is not described in the plan's modules")
    info = infos[path]
    _need(d.get("class") == info.cls, f"{where}.class", f"{d.get('class')!r:.60} is not the module's class {info.cls}")
    op = get_op(d.get("op")) if isinstance(d.get("op"), str) else None
    _need(op is not None, f"{where}.op", f"unknown op {d.get('op')!r:.60}")
    flags = op.default_flags()
    for name, v in _obj(d.get("flags", {}), f"{where}.flags").items():
        spec = op.flag(name) if isinstance(name, str) else None
        _need(spec is not None, f"{where}.flags", f"{op.name} has no flag {name!r:.60}")
        try:
            flags[name] = spec.coerce(v)
        except FlagTypeError as e:
            raise PlanError(f"{where}.flags: {e}") from None
    sources = {n: _text(s, f"{where}.flag_sources.{n}", 400)
               for n, s in _obj(d.get("flag_sources", {}), f"{where}.flag_sources").items() if n in flags}
    host = _mpath(d.get("host"), f"{where}.host")
    _need(host in infos, f"{where}.host", "the host module is not described in the plan's modules")
    _need(host == path or host == "" or path.startswith(host + "."), f"{where}.host",
          f"{host!r} is neither the site nor one of its ancestors")
    covers = tuple(_mpath(c, f"{where}.covers") for c in _list(d.get("covers", []), f"{where}.covers"))
    _need(all(c.startswith(path + ".") if path else True for c in covers), f"{where}.covers",
          "a covered module is not a child of the site")
    _need(set(covers) <= set(f"{path}.{c}" if path else c for c in op.covers), f"{where}.covers",
          f"{op.name} fuses only {', '.join(op.covers) or 'nothing'}")
    # The site is built as plan_index builds it (validate, keys, source); then it must carry the
    # pins a plan made here records, and the recorded kernels must be the derived ones.
    minfo = info.with_host(infos.get(host))
    try:
        site = build_site(op, path, info.cls, host, minfo, flags, sources, dtypes=dtypes, target=target,
                          rule=_text(d.get("rule"), f"{where}.rule", 400),
                          rules=tuple(_text(r, f"{where}.rules", 400) for r in _list(d.get("rules", []), f"{where}.rules")),
                          matched_by=_text(d.get("matched_by"), f"{where}.matched_by", 400), covers=covers,
                          refused=_text(d.get("refused", ""), f"{where}.refused", 1000),
                          optional=d.get("optional", False) is True)
    except SiteError as e:
        raise PlanError(f"{where}: {e}") from None
    unlocked = op.unlocked(site.flag_dict)
    _need(not unlocked, f"{where}.flags", unlocked or "")
    recorded = _list(d.get("kernels", []), f"{where}.kernels")
    _need(len(recorded) == len(site.keys), f"{where}.kernels", f"expected {len(site.keys)} kernel(s), one per dtype")
    for k, r in zip(site.keys, recorded):
        if _canon(k.to_json()) != _canon(r):
            rp = r.get("params") if isinstance(r, dict) and isinstance(r.get("params"), dict) else {}
            diff = [n for n in sorted(set(k.param_dict) | set(rp)) if _canon(k.param_dict.get(n)) != _canon(rp.get(n))]
            what = (f"parameter(s) {', '.join(map(str, diff[:5]))}" if diff else "its op, template or name")
            raise PlanError(f"{where}.kernels: the recorded kernel differs from the one derived from the module's "
                            f"facts and flags in {what:.200}")
    if op.external:             # the recorded source is text for people: it is re-derived, never read
        _text(d.get("source", ""), f"{where}.source", 2000)
    return site


def _attention(d: Any) -> AttentionChoice | None:
    if d is None:
        return None
    try:
        d = _obj(d, "plan.attention")
        impl = d.get("impl")
        _need(isinstance(impl, str) and bool(re.fullmatch(r"[A-Za-z0-9_]{1,64}", impl)), "plan.attention.impl",
              "expected an implementation name")
        why = attention_problem(impl)
        _need(not why, "plan.attention.impl", f"{why} (one of {', '.join(KNOWN_ATTENTION)})")
        return AttentionChoice.from_json({"impl": impl, "rule": _text(d.get("rule", ""), "plan.attention.rule", 400)})
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"plan.attention: {type(e).__name__}: {e}") from None


def _structure(d: Any) -> dict[str, str]:
    """plan.structure: every module path of the model planned on, with its class."""
    _need(d is not None, "plan.structure", "missing (the model's module paths and classes; plan again with this version)")
    d = _obj(d, "plan.structure")
    _need(0 < len(d) <= 1_000_000, "plan.structure", "expected between 1 and 1000000 modules")
    _need("" in d, "plan.structure", "the model itself ('') is missing")
    return {_mpath(p, "plan.structure"): _ident(c, f"plan.structure[{p!r:.80}]") for p, c in d.items()}


def _load_plan(d: Any) -> PatchPlan:
    try:
        d = _obj(d, "plan")
        _need(d.get("format") == PLAN_FORMAT, "plan.format", f"expected {PLAN_FORMAT} (a plan written by this version)")
        target = d.get("target")
        _need(target in _TARGETS, "plan.target", f"expected one of {', '.join(_TARGETS)}")
        dtypes = tuple(_list(d.get("dtypes"), "plan.dtypes"))
        _need(0 < len(dtypes) <= 3 and all(isinstance(x, str) and x in _DTYPES for x in dtypes)
              and len(set(dtypes)) == len(dtypes),
              "plan.dtypes", f"expected distinct values among {', '.join(_DTYPES)}")
        model_type = d.get("model_type")
        _need(model_type is None or (isinstance(model_type, str) and bool(_FACT_STRINGS.fullmatch(model_type))),
              "plan.model_type", "expected a short identifier or null")
        infos = {_mpath(p, "plan.modules"): _module_info(p, m) for p, m in _obj(d.get("modules"), "plan.modules").items()}
        structure = _structure(d.get("structure"))
        for p, i in infos.items():
            _need(structure.get(p) == i.cls, f"modules[{p!r}]", "the module is not in the plan's structure with its class")
        sites = tuple(_load_site(i, s, infos, dtypes, target) for i, s in enumerate(_list(d.get("sites"), "plan.sites")))
        for s in sites:
            _need(all(c in structure for c in s.covers), f"site {s.path or '<model>'}.covers",
                  "a covered module is not in the plan's structure")
        paths = [s.path for s in sites]
        _need(len(set(paths)) == len(paths), "plan.sites", "a module appears in two sites")
        hosts = [s.host for s in sites]
        _need(len(set(hosts)) == len(hosts), "plan.sites", "two sites replace the forward of the same module")
        totals = []
        for i, t in enumerate(_list(d.get("totals", []), "plan.totals")):
            t = _obj(t, f"plan.totals[{i}]")
            n, a, b = t.get("name"), t.get("patched"), t.get("present")
            _need(isinstance(n, str) and bool(_PATH.fullmatch(n)) and len(n) <= 200, f"plan.totals[{i}].name",
                  "expected a module name")
            _need(all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 31 for x in (a, b)) and a <= b,
                  f"plan.totals[{i}]", "expected counts 0 <= patched <= present")
            totals.append((n, a, b))
        totals = list(count_totals(sites, {n: b for n, _, b in totals}))
        return PatchPlan(_text(d.get("spec"), "plan.spec", 1000), _ident(d.get("model_class"), "plan.model_class"),
                         model_type, target, dtypes, sites,
                         tuple(_text(u, "plan.unmatched_optional", 1000)
                               for u in _list(d.get("unmatched_optional", []), "plan.unmatched_optional")),
                         tuple(totals), infos, _attention(d.get("attention")), tuple(structure.items()))
    except RecursionError:
        raise PlanError("plan: nested too deeply") from None
