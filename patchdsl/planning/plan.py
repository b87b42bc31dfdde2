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
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from ..codegen.keys import KernelKey
from ..model.index import ModelIndex
from ..model.info import ModuleInfo
from ..ops.attention_impl import AttentionChoice, choose_attention
from ..ops.registry import get_op
from ..syntax.errors import SpecError
from .check import CheckedSpec
from .diagnostics import explain_dead_member, explain_misfits, explain_no_match
from .plan_file import PLAN_FORMAT, PlanError, plan_fields
from .select import dead_members, select_all
from .site import Site, SiteError, _leaf, build_site, count_totals


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
        return cls(*plan_fields(d))

    @classmethod
    def loads(cls, text: str) -> "PatchPlan":
        from ..util.files import FileReadError, parse_json

        try:
            d = parse_json(text, "the plan")
        except FileReadError as e:
            raise PlanError(f"not a JSON plan file: {e}") from None
        return cls(*plan_fields(d))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "PatchPlan":
        """A plan file, read through :mod:`patchdsl.util.files` (a regular file of at most 64 MiB, UTF-8,
        bounded nesting) and checked by :meth:`loads`.  Raises :class:`PlanError`."""
        from ..util.files import FileReadError, read_text

        try:
            text = read_text(path, "plan", what="plan file")
        except FileReadError as e:
            raise PlanError(str(e)) from None
        return cls.loads(text)

    @property
    def refused_sites(self) -> tuple[Site, ...]:
        return tuple(s for s in self.sites if s.refused)


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
