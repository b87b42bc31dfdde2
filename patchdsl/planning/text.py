"""A PatchPlan as text a person reads and grep finds: one line per rule, or one line per site.

Every row is one line of fixed columns (padded with spaces, never wrapped, never cut), whatever
the terminal's width; the counts come from one place (:func:`counts`), so the rule lines, the
per-module totals and the summary line agree.  A site is a module whose forward is replaced; an
op that fuses children (``fused_qk_norm_rope`` takes ``q_norm`` and ``k_norm``) patches those
modules too, and they are counted as modules, never as sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class RuleText:
    """What the renderer shows of a spec rule (from ``check.CheckedRule``)."""

    where: str          # file:line
    selector: str       # "*.mlp: SwiGLU" (selectors and class pattern)
    op: str
    flags: str          # the flags the rule sets, "k=v, ..."
    optional: bool = False


def rule_texts(checked_rules: Iterable[Any]) -> list[RuleText]:
    """RuleText for each ``check.CheckedRule``."""
    out = []
    for cr in checked_rules:
        r = cr.rule
        sels = ", ".join(("!" if s.negated else "") + s.text for s in r.selectors)
        out.append(RuleText(r.span.short, f"{sels}: {r.class_pattern.text}", cr.op,
                            ", ".join(f"{k}={_value(v.value)}" for k, v in cr.explicit), bool(r.optional)))
    return out


def _value(v: Any) -> str:
    return "true" if v is True else "false" if v is False else str(v)


def site_flags(site: Any) -> str:
    """The flags of a site that differ from the op's defaults, ``k=v, ...``."""
    if site.op == "hub":       # hub's flags are its source, shown in the op column
        return ""
    src = dict(site.flag_sources)
    return ", ".join(f"{k}={_value(v)}" for k, v in site.flags if src.get(k, "") != "op default")


def columns(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Fixed-width columns separated by two spaces; every cell whole (no wrapping, no cutting)."""
    rows = [[str(c).replace("\n", " ") for c in r] for r in rows]
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]

    def line(cells):
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    return [line(header)] + [line(r) for r in rows]


@dataclass(frozen=True)
class Counts:
    sites: int            # sites whose forward is replaced
    refused: int          # sites refused (kept in the plan with their reason)
    fused: int            # child modules fused into a patched site (q_norm, k_norm, ...)
    modules: int          # modules patched: sites + fused children == sum of the totals' patched
    kernels: int


def counts(plan: Any) -> Counts:
    ok = [s for s in plan.sites if not s.refused]
    fused = sum(len(s.covers) for s in ok)
    return Counts(len(ok), len(plan.sites) - len(ok), fused, len(ok) + fused, len(plan.kernel_keys()))


def title(plan: Any) -> str:
    return f"patch plan: {plan.spec} on {plan.model_class} ({plan.target}; {', '.join(plan.dtypes)})"


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else "<root>"


def totals_line(plan: Any) -> str:
    """``28/28 mlp, ...`` with the fused children named as such."""
    fused_names = {_leaf(c) for s in plan.sites for c in s.covers}
    own = [f"{a}/{b} {n}" for n, a, b in plan.totals if n not in fused_names]
    fused = [f"{a}/{b} {n}" for n, a, b in plan.totals if n in fused_names]
    return "modules patched: " + ", ".join(own) + (f"; fused into them: {', '.join(fused)}" if fused else "")


def summary_line(plan: Any) -> str:
    c = counts(plan)
    ext = plan.external_sites()
    fused = f" (+{c.fused} module(s) fused into them: {c.modules} modules patched)" if c.fused else ""
    return (f"{c.sites} site(s) to patch{fused}, {c.refused} refused, {c.kernels} kernel(s) to generate"
            + (f", {len(ext)} site(s) with external kernels" if ext else ""))


def refusal_lines(plan: Any) -> list[str]:
    """One line per (rule, op, reason): the refused sites, counted, the first named."""
    shown: dict[tuple[str, str, str], list[str]] = {}
    for s in plan.refused_sites:
        shown.setdefault((s.rule, s.op, s.refused), []).append(s.path or "<model>")
    out = []
    for (rule, op, reason), paths in shown.items():
        where = paths[0] if len(paths) == 1 else f"{len(paths)} sites ({paths[0]}, ...)"
        out.append(f"{rule}: refused {op} on {where}: {reason}")
    return out


def rule_rows(plan: Any, rules: Sequence[RuleText] | None = None) -> list[list[str]]:
    """One row per rule: where, selector, op, flags, patched, refused, present.

    A site counts under the first rule that selected it (``Site.rule``); ``present`` is how many
    modules of the model carry the leaf names of the rule's sites.  A rule that only set flags on
    sites an earlier rule selected says so in its flags cell."""
    present = {n: b for n, _, b in plan.totals}
    by_rule: dict[str, list[Any]] = {}
    for s in plan.sites:
        by_rule.setdefault(s.rule, []).append(s)
    touched: dict[str, int] = {}
    for s in plan.sites:
        for r in s.rules[1:]:
            touched[r] = touched.get(r, 0) + 1
    if rules is None:       # a plan without its spec (a plan file): the rules the sites name
        rules = []
        for where, ss in by_rule.items():
            rules.append(RuleText(where, "", ss[0].op, site_flags(ss[0])))
    unmatched = {u.split(": ", 1)[0] for u in plan.unmatched_optional}
    rows = []
    for r in rules:
        ss = by_rule.get(r.where, [])
        names = dict.fromkeys(_leaf(s.path) for s in ss)
        ok = sum(1 for s in ss if not s.refused)
        flags = r.flags or "-"
        if not ss and touched.get(r.where):
            flags += f" (on {touched[r.where]} site(s) of earlier rules)"
        elif not ss and (r.where in unmatched or r.optional):
            flags += " (optional; matched nothing)"
        op = r.op
        if ss and ss[0].source:
            op = ss[0].source if ss[0].op == "hub" else f"{r.op} from {ss[0].source}"
        rows.append([r.where, r.selector or "-", op, flags, str(ok), str(len(ss) - ok),
                     str(sum(int(present.get(n, 0)) for n in names))])
    return rows


def short_lines(plan: Any, rules: Sequence[RuleText] | None = None) -> list[str]:
    """The default view: title, a line per rule, the refusals, the totals and one summary line."""
    out = [title(plan)]
    out += columns(["rule", "selector", "op", "flags", "patched", "refused", "present"],
                   rule_rows(plan, rules), right=(4, 5, 6))
    out += refusal_lines(plan)
    out += _footer(plan)
    return out


def site_lines(plan: Any) -> list[str]:
    """``--sites``: a line per site (and per child module fused into one)."""
    rows = []
    for s in plan.sites:
        op = (s.source if s.op == "hub" else f"{s.op} from {s.source}") if s.source else s.op
        rows.append([s.path or "<model>", s.cls, op + (" (refused)" if s.refused else ""), site_flags(s) or "-",
                     ", ".join(s.rules), s.matched_by])
        for c in s.covers:
            cls = plan.infos[c].cls if c in plan.infos else ""
            rows.append([c, cls, f"(fused into {s.op})", "-", s.rule, "covered"])
    out = [title(plan)]
    out += columns(["path", "class", "op", "flags", "rule", "matched by"], rows)
    out += refusal_lines(plan)
    out += _footer(plan)
    return out


def _footer(plan: Any) -> list[str]:
    out = []
    if plan.totals:
        out.append(totals_line(plan))
    for u in plan.unmatched_optional:
        out.append(f"optional rule matched nothing: {u}")
    if plan.attention is not None:
        out.append(f"attention implementation: {plan.attention.impl} (this model instance only; {plan.attention.span})")
    out.append(summary_line(plan))
    return out
