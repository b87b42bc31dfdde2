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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from .check import CheckedSpec, check_spec
from .codegen.keys import KernelKey
from .index import ModelIndex, build_index
from .ops.attention_impl import AttentionChoice, choose_attention
from .ops.base import ModuleInfo
from .ops.registry import get_op
from .select import explain_no_match, select
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
                "source": self.source, "kernels": [k.to_json() for k in self.keys]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Site":
        return cls(d["path"], d["class"], d["op"], tuple(d["flags"].items()), tuple(d["flag_sources"].items()),
                   d["rule"], tuple(d["rules"]), d["matched_by"], d["host"],
                   tuple(KernelKey.from_json(k) for k in d["kernels"]), tuple(d.get("covers", ())),
                   d.get("source", ""))


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

    def __iter__(self):
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def site(self, path: str) -> Site | None:
        return next((s for s in self.sites if s.path == path), None)

    def kernel_keys(self) -> list[KernelKey]:
        """The generated kernels the plan needs (external ops load theirs: see ``external_sites``)."""
        seen: dict[KernelKey, None] = {}
        for s in self.sites:
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
            "modules": {p: {"class": i.cls, "bases": list(i.bases), "kinds": {k: dict(v) for k, v in i.kinds.items()},
                            "dtype": i.dtype, "children": list(i.children)}
                        for p, i in self.infos.items()},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False, default=str)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PatchPlan":
        infos = {p: ModuleInfo(p, m["class"], tuple(m["bases"]), m["kinds"], m["dtype"], tuple(m["children"]))
                 for p, m in d.get("modules", {}).items()}
        return cls(d["spec"], d["model_class"], d["model_type"], d["target"], tuple(d["dtypes"]),
                   tuple(Site.from_json(s) for s in d["sites"]), tuple(d["unmatched_optional"]),
                   tuple((t["name"], t["patched"], t["present"]) for t in d["totals"]), infos,
                   AttentionChoice.from_json(d["attention"]) if d.get("attention") else None)


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else "<root>"


def plan_index(checked: CheckedSpec, index: ModelIndex, *, target: str = "cuda",
               dtypes: tuple[str, ...] | None = None) -> PatchPlan:
    """Resolve a checked spec against a model index.  Pure."""
    spec = checked.spec
    dts = tuple(dtypes or spec.dtypes or (index.dtype,))
    state: dict[str, dict[str, Any]] = {}   # path -> {"op", "flags", "rules", "how", "span"}
    order: list[str] = []
    unmatched: list[str] = []
    for cr in checked.rules:
        rule = cr.rule
        op = get_op(cr.op)
        assert op is not None
        matches = select(rule, op, index)
        if not matches:
            if rule.optional:
                unmatched.append(f"{rule.span.short}: {rule.text}")
                continue
            raise explain_no_match(rule, op, index)
        for m in matches:
            st = state.get(m.info.path)
            if st is None:
                flags = checked.base_flags(op)
                st = {"op": op.name, "flags": flags, "rules": [], "how": m.how, "span": rule.span}
                state[m.info.path] = st
                order.append(m.info.path)
            elif st["op"] != op.name:
                raise SpecError(
                    f"{m.info.path} would get two different ops: {st['op']} and {op.name}", rule.op.span,
                    notes=[(f"{st['op']} given here", st["span"])],
                    hint="a module gets one op; narrow one selector (e.g. with !path) or drop a rule")
            for name, fv in cr.explicit:
                st["flags"][name] = fv
            st["rules"].append(rule.span.short)
    # fused children: an op that covers q_norm/k_norm conflicts with rules patching them
    covered: dict[str, str] = {}
    for path in order:
        op = get_op(state[path]["op"])
        for child in op.covers:
            cp = f"{path}.{child}" if path else child
            if cp in state:
                raise SpecError(
                    f"{cp} is fused into {path} by {op.name}, and also patched with {state[cp]['op']}",
                    state[cp]["span"], notes=[(f"{op.name} given here", state[path]["span"])],
                    hint=f"drop the rule for {child}, or exclude it: '!*.{child}'")
            if cp in index.infos:
                covered[cp] = path
    sites = []
    hosts: dict[str, str] = {}
    for path in order:
        st = state[path]
        op = get_op(st["op"])
        info = index.infos[path]
        host = op.host(info, index)
        if host in hosts and hosts[host] != path:
            raise SpecError(f"{path} and {hosts[host]} both need to replace the forward of "
                            f"'{host or '<model>'}'", st["span"])
        hosts[host] = path
        flags = {k: v.value for k, v in st["flags"].items()}
        sources = {k: v.source for k, v in st["flags"].items()}
        bad = op.validate(flags)
        if bad:
            raise SpecError(f"{path}: {bad}", st["span"])
        minfo = info.with_host(index.infos.get(host))
        keys = []
        for dt in dts:
            params = op.key_params(minfo, flags, dt, target)
            keys.append(KernelKey.make(op.name, op.template, op.kernel_name(params), params))
        covers = tuple(c for c, by in covered.items() if by == path)
        sites.append(Site(path, info.cls, op.name, tuple(flags.items()), tuple(sources.items()),
                          st["rules"][0], tuple(st["rules"]), st["how"], host, tuple(keys), covers,
                          op.source(keys[0].param_dict) if keys else ""))
    # totals: per leaf name, patched (directly or fused) / present
    present = Counter(_leaf(i.path) for i in index if i.path)
    patched = Counter(_leaf(s.path) for s in sites)
    for c in covered:
        patched[_leaf(c)] += 1
    totals = tuple((name, patched[name], present[name]) for name in dict.fromkeys(
        [_leaf(s.path) for s in sites] + [_leaf(c) for c in covered]))
    used = set(order) | set(covered) | {s.host for s in sites}
    infos = {p: index.infos[p] for p in index.infos if p in used}
    attention = choose_attention(spec.attention) if spec.attention is not None else None
    return PatchPlan(spec.path, index.model_class, index.model_type, target, dts, tuple(sites),
                     tuple(unmatched), totals, infos, attention)


def check_available(checked: CheckedSpec, plan: PatchPlan, model_cls: type | None = None) -> PatchPlan:
    """Raise a SpecError naming the site (and its rule) whose kernel cannot be had on this machine:
    an external op whose package, GPU or files are missing, an attention implementation that
    cannot run here.  Returns the plan with each external site's source as resolved here (a local
    repository's content hash, the commit a Hub pin resolved to).  Not pure: it looks at installed
    packages, the device and the file system."""
    from dataclasses import replace

    spans = {cr.rule.span.short: cr.rule for cr in checked.rules}
    said: dict[tuple, str | None] = {}
    sites = []
    for s in plan.sites:
        op = get_op(s.op)
        if not op.external:
            sites.append(s)
            continue
        for k in s.keys:
            key = (s.op, k.params)
            if key not in said:
                said[key] = op.unavailable(k.param_dict)
            if said[key]:
                rule = spans.get(s.rule)
                raise SpecError(f"{s.path}: {s.source or s.op} cannot be used here: {said[key]}",
                                rule.op.span if rule is not None else None)
        sites.append(replace(s, source=op.resolved_source(s.keys[0].param_dict)) if s.keys else s)
    if plan.attention is not None:
        why = plan.attention.unavailable(plan.target, model_cls)
        if why:
            raise SpecError(f"attention {plan.attention.impl} cannot run here: {why}", checked.spec.attention.span)
    return replace(plan, sites=tuple(sites))


def plan(spec: Spec | str, model: Any, *, target: str | None = None,
         dtypes: tuple[str, ...] | None = None) -> PatchPlan:
    """Plan ``spec`` (a Spec, a path or spec text) against ``model`` (a module, possibly on meta)."""
    from .syntax import load_spec

    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    if target is None:
        from .codegen.env import target as _target
        target = _target()
    index = model if isinstance(model, ModelIndex) else build_index(model)
    checked = check_spec(spec)
    p = plan_index(checked, index, target=target, dtypes=dtypes)
    return check_available(checked, p, None if isinstance(model, ModelIndex) else type(model))
