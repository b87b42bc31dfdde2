"""Selection: which modules of a ModelIndex each rule matches (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.index import ModelIndex
from ..model.info import ModuleInfo
from ..ops.base import Op
from ..model.kinds import KIND_NAMES
from ..syntax.ast import Rule

from ..syntax.selectors import RANGE, split_top, class_glob_regex, compile_selector


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
                    parts = [p for p, _ in split_top(inner)]
                    if len(parts) > 1 or not RANGE.fullmatch(inner):
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
