"""Why a rule selects nothing, or less than it says: the errors of selection, with the most useful
hint found (the nearest class names, what a kind needs and what the modules lack, a misspelt member)."""

from __future__ import annotations

from ..model.index import ModelIndex
from ..model.kinds import KIND_NAMES
from ..ops.base import Op
from ..syntax.ast import Rule
from ..syntax.errors import SpecError, did_you_mean
from ..syntax.selectors import compile_selector
from .select import Match, path_matches


def explain_misfits(rule: Rule, op: Op, misfits: list[tuple[Match, str]], n_fit: int = 0,
                    index: ModelIndex | None = None) -> SpecError:
    """A rule selected modules of the right kind where the op cannot go (a loss op on q_proj)."""
    paths = [m.info.path for m, _ in misfits]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    sel = ", ".join(("!" if s.negated else "") + s.text for s in rule.selectors)
    why0 = misfits[0][1]
    if "no causal LM holds" in why0:
        from ..model.kinds.misses import KIND_NEEDS

        hint = (f"{index.model_class if index is not None else 'the model'} is not recognised as a causal LM (the CausalLM kind needs "
                f"{KIND_NEEDS['CausalLM']}), so no loss op can replace its lm_head: leave the loss unfused "
                f"(`patchdsl inspect --model M` shows what is recognised)")
    elif "lm_head" in why0:
        hint = "select it alone: 'lm_head: Linear -> " + op.name + "'"
    else:
        hint = None
    other = "other " if n_fit else ""
    return SpecError(f"{misfits[0][1]}; '{sel}' selects {len(paths)} {other}module(s): {shown}",
                     rule.selectors[0].span, hint=hint)


def nearest_classes(alt: str, op: Op, infos) -> list[str]:
    """Class names in ``infos`` that fit ``op``, nearest to ``alt`` first (at most 3)."""
    import difflib

    fits = sorted({i.cls for i in infos if any(k in i.kinds for k in op.kinds)})
    if not fits:
        return []
    ranked = sorted(fits, key=lambda c: (-difflib.SequenceMatcher(None, alt.lower(), c.lower()).ratio(), c))
    return ranked[:3]


def explain_no_match(rule: Rule, op: Op, index: ModelIndex) -> SpecError:
    """A SpecError for a rule that matched nothing, with the most useful hint we can find."""
    by_path = [i for i in index if path_matches(rule, i.path)]
    pos = [s for s in rule.selectors if not s.negated]
    span = pos[0].span
    if by_path:
        classes = sorted({i.cls for i in by_path})
        shown = ", ".join(classes[:4]) + ("..." if len(classes) > 4 else "")
        pat = rule.class_pattern
        kinds_there = sorted({k for i in by_path for k in i.kinds})
        hint = None
        for alt in pat.alternatives:
            if alt not in KIND_NAMES:
                near = nearest_classes(alt, op, by_path) or nearest_classes(alt, op, index)
                if near:
                    hint = (f"did you mean '{near[0]}'? classes here that {op.name} can replace: "
                            + ", ".join(near))
                else:
                    hint = did_you_mean(alt, classes + list(KIND_NAMES))
        if hint is None and kinds_there:
            hint = f"those modules are: {', '.join(kinds_there)}"
            from ..ops.registry import ops as all_ops
            fitting = sorted({o.name for o in all_ops().values() if not o.any_kind and not o.external
                              and any(k in kinds_there for k in o.kinds) and "Linear" not in o.kinds})
            if fitting:
                hint += f" (ops for them: {', '.join(fitting)})"
        if hint is None:
            hint = _kind_hint(pat, op, by_path)
        return SpecError(
            f"'{rule.text.split(':')[0].strip()}' matched {len(by_path)} module(s) ({shown}) but none is "
            f"{pat.text} that {op.name} can replace", pat.span, hint=hint)
    # no path matched: suggest a variant selector that would match
    hints = []
    for s in pos:
        for variant in (f"*.{s.text}", f"*{s.text}*", f"{s.text}.*"):
            try:
                rx = compile_selector(variant)
            except SpecError:
                continue
            n = sum(1 for i in index if i.path and rx.match(i.path))
            if n:
                hints.append(f"'{variant}' matches {n}")
                break
    if not hints:
        names = sorted({i.path.rsplit('.', 1)[-1] for i in index if i.path})
        dm = did_you_mean(pos[0].text.rsplit(".", 1)[-1], names)
        if dm:
            hints.append(dm)
    sel = ", ".join(("!" if s.negated else "") + s.text for s in rule.selectors)
    return SpecError(f"'{sel}' matched 0 modules of {index.model_class}", span,
                     hint="; ".join(hints) + ("; " if hints else "") + "mark the rule 'optional' if that is expected")


def explain_dead_member(rule: Rule, op: Op, index: ModelIndex, selector, member: str) -> SpecError:
    """A SpecError for one selector (or brace member) of a rule that patches nothing."""
    rx = compile_selector(member)
    by_path = [i for i in index if i.path and rx.match(i.path)]
    sel = ", ".join(("!" if s.negated else "") + s.text for s in rule.selectors)
    what = f"'{member}'" + (f" (a member of '{selector.text}')" if member != selector.text else "")
    if len(rule.selectors) > 1:
        what += f" in '{sel}'"
    if by_path:
        classes = sorted({i.cls for i in by_path})
        shown = ", ".join(classes[:4]) + ("..." if len(classes) > 4 else "")
        return SpecError(f"{what} matched {len(by_path)} module(s) ({shown}) but none is "
                         f"{rule.class_pattern.text} that {op.name} can replace", selector.span,
                         hint="drop it from the rule, or mark the rule 'optional' if that is expected")
    names = sorted({i.path.rsplit(".", 1)[-1] for i in index if i.path})
    dm = did_you_mean(member.rsplit(".", 1)[-1], names)
    return SpecError(f"{what} matched 0 modules of {index.model_class}: the rule would patch "
                     f"the others and say nothing of it", selector.span,
                     hint=(dm + "; " if dm else "") + "drop it from the rule, or mark the rule 'optional' "
                     "if that is expected")


def _kind_hint(pat, op: Op, infos) -> str | None:
    """Why modules fit none of the rule's kinds, from their structure (what the kind needs, what they lack)."""
    from ..model.kinds.misses import KIND_NEEDS, kind_misses

    kinds = [a for a in pat.alternatives if a in KIND_NAMES] or list(op.kinds)
    i = infos[0]
    parts = []
    for k in kinds:
        miss = kind_misses(k, i.children)
        need = KIND_NEEDS.get(k)
        if need:
            parts.append(f"{k} needs {need}" + (f"; {i.cls} has no {miss}" if miss else
                                                f"; {i.cls}'s forward or sizes differ"))
    if not parts:
        return None
    kids = ", ".join(i.children) or "none"
    return f"{i.cls} (children: {kids}) fits no {' or '.join(kinds)}: " + "; ".join(parts)
