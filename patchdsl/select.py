"""Selection: which modules of a ModelIndex each rule matches (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from .model.index import ModelIndex
from .model.info import ModuleInfo
from .ops.base import Op
from .model.kinds import KIND_NAMES
from .syntax.ast import Rule
from .syntax.errors import SpecError, did_you_mean
from .syntax.selectors import _RANGE, _split_top, class_glob_regex, compile_selector


@dataclass(frozen=True)
class Match:
    info: ModuleInfo
    how: str          # "kind SwiGLU" or "class Qwen3MLP"


def path_matches(rule: Rule, path: str) -> bool:
    if path == "":
        return False
    pos = [s for s in rule.selectors if not s.negated]
    neg = [s for s in rule.selectors if s.negated]
    return any(compile_selector(s.text).match(path) for s in pos) and not any(
        compile_selector(s.text).match(path) for s in neg)


def class_match(rule: Rule, info: ModuleInfo, op: Op) -> str | None:
    """How the rule's class pattern accepts ``info`` (None if it does not).

    Whatever the pattern says, the module must fit one of the op's kinds: a kind alternative
    names one of those, a class alternative only narrows.
    """
    fits = [k for k in op.kinds if k in info.kinds]
    if not fits and not op.any_kind:       # a Hub layer may replace any module the rule names
        return None
    for alt in rule.class_pattern.alternatives:
        if alt in KIND_NAMES:
            if alt in fits:
                return f"kind {alt}"
            continue
        rx = class_glob_regex(alt)
        name = next((n for n in (info.cls,) + info.bases if rx.match(n)), None)
        if name is not None:
            return f"class {name} ({fits[0]})" if fits else f"class {name}"
    return None


def select(rule: Rule, op: Op, index: ModelIndex) -> list[Match]:
    """The modules ``rule`` selects for ``op`` (path, class pattern, and a place the op can go)."""
    return select_all(rule, op, index)[0]


def select_all(rule: Rule, op: Op, index: ModelIndex) -> tuple[list[Match], list[tuple[Match, str]]]:
    """(matches, misfits): misfits fit the op's kind but are no place for it (``Op.misfit``)."""
    out, bad = [], []
    for info in index:
        if not path_matches(rule, info.path):
            continue
        how = class_match(rule, info, op)
        if how:
            why = op.misfit(info, index)
            if why is None:
                out.append(Match(info, how))
            else:
                bad.append((Match(info, how), why))
    return out, bad


def explain_misfits(rule: Rule, op: Op, misfits: list[tuple[Match, str]], n_fit: int = 0,
                    index: ModelIndex | None = None) -> SpecError:
    """A rule selected modules of the right kind where the op cannot go (a loss op on q_proj)."""
    paths = [m.info.path for m, _ in misfits]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    sel = ", ".join(("!" if s.negated else "") + s.text for s in rule.selectors)
    why0 = misfits[0][1]
    if "no causal LM holds" in why0:
        from .model.kinds.misses import KIND_NEEDS

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
            from .ops.registry import ops as all_ops
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


# ------------------------------------------------------------------ members that match nothing
MAX_MEMBERS = 256          # brace members checked one by one (= selectors.MAX_ALTERNATIVES)


def brace_members(text: str, limit: int = MAX_MEMBERS) -> list[str]:
    """``text`` with every ``{a,b}`` alternation expanded: one selector per member (ranges
    ``{N..M}`` stay whole); ``[text]`` when there is none or more than ``limit`` members."""
    out: list[str] = []
    todo = [text]
    while todo:
        t = todo.pop(0)
        depth, start = 0, -1
        for k, c in enumerate(t):
            if c == "{":
                if depth == 0:
                    start = k
                depth += 1
            elif c == "}" and depth:
                depth -= 1
                if depth == 0:
                    inner = t[start + 1:k]
                    parts = [p for p, _ in _split_top(inner)]
                    if len(parts) > 1 or not _RANGE.fullmatch(inner):
                        todo.extend(t[:start] + p + t[k + 1:] for p in parts)
                        break
        else:
            out.append(t)
        if len(out) + len(todo) > limit:
            return [text]
    return out


def dead_members(rule: Rule, matches: list[Match]) -> list[tuple[object, str]]:
    """(selector, member) of ``rule`` that select none of ``matches`` (the modules the rule
    patches): a misspelt selector in a list, a brace member that fits nothing.  Only when the rule
    has several positive selectors or a brace alternation; a rule's single selector that matches
    nothing is :func:`explain_no_match`'s."""
    pos = [s for s in rule.selectors if not s.negated]
    out = []
    for s in pos:
        members = brace_members(s.text)
        if len(pos) == 1 and len(members) == 1:
            continue
        for m in members:
            rx = compile_selector(m)
            if not any(rx.match(x.info.path) for x in matches):
                out.append((s, m))
    return out


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
    from .model.kinds.misses import KIND_NEEDS, kind_misses

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
