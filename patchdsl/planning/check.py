"""Language-level checks that need the op registry but no model: ops, flags, kinds.

``check_spec(spec)`` returns the rules with their flags typed and resolved against each op's
schema and the file's ``default`` directives.  Pure; raises located SpecErrors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ops.base import FlagTypeError, Op
from ..model.kinds import KIND_NAMES
from ..ops.registry import get_op, ops
from ..syntax.ast import Arg, Flag, Rule, Span, Spec
from ..syntax.errors import SpecError, did_you_mean
from ..syntax.transform import BAD_VALUE
from ..syntax.selectors import is_glob


@dataclass(frozen=True)
class FlagValue:
    value: Any
    source: str          # "op default", or "file:line" of the rule / default directive that set it


@dataclass(frozen=True)
class CheckedRule:
    rule: Rule
    op: str
    explicit: tuple[tuple[str, FlagValue], ...]   # flags this rule sets, in order


@dataclass(frozen=True)
class CheckedSpec:
    spec: Spec
    rules: tuple[CheckedRule, ...]
    defaults: tuple[tuple[str, str, FlagValue], ...]   # (op, flag, value) from default directives

    def base_flags(self, op: Op) -> dict[str, FlagValue]:
        """Op defaults overlaid with the file's ``default`` directives (later wins)."""
        out = {f.name: FlagValue(f.default, "op default") for f in op.flags}
        for opname, name, fv in self.defaults:
            if opname == op.name:
                out[name] = fv
        return out


def _op_or_error(name: str, span: Span) -> Op:
    op = get_op(name)
    if op is None:
        hint = did_you_mean(name, ops()) or f"known ops: {', '.join(sorted(ops()))}"
        raise SpecError(f"unknown op '{name}'", span, hint=hint)
    return op


def _positional(op: Op, args: tuple[Arg, ...]) -> tuple[Flag, ...]:
    """Positional values as the flags they stand for (``hub("org/repo", "Layer")``: repo, layer)."""
    if args and not op.positional:
        raise SpecError(f"{op.name} takes no positional values", args[0].span,
                        hint=f"write flags as name=value" + (f" ({', '.join(f.name for f in op.flags)})" if op.flags else ""))
    if len(args) > len(op.positional):
        raise SpecError(f"{op.name} takes at most {len(op.positional)} positional value(s) "
                        f"({', '.join(op.positional)})", args[len(op.positional)].span)
    return tuple(Flag(name, a.value, a.span) for name, a in zip(op.positional, args))


def _typed_flags(op: Op, flags: tuple[Flag, ...], errors: list[SpecError],
                 args: tuple[Arg, ...] = ()) -> list[tuple[str, FlagValue]]:
    out: list[tuple[str, FlagValue]] = []
    seen: dict[str, Span] = {}
    try:
        positional = _positional(op, args)
    except SpecError as e:
        errors.append(e)
        positional = ()
    for fl in positional + tuple(flags):
        if fl.value is BAD_VALUE:       # its literal was already reported by the parser
            continue
        spec = op.flag(fl.name)
        if spec is None:
            names = [f.name for f in op.flags]
            hint = did_you_mean(fl.name, names) or (
                f"{op.name} takes: {', '.join(names)}" if names else f"{op.name} takes no flags")
            errors.append(SpecError(f"unknown flag '{fl.name}' for {op.name}", fl.span, hint=hint))
            continue
        if fl.name in seen:
            errors.append(SpecError(f"flag '{fl.name}' given twice", fl.span,
                                    notes=[("first given here", seen[fl.name])]))
            continue
        seen[fl.name] = fl.span
        try:
            value = spec.coerce(fl.value)
        except FlagTypeError as e:
            errors.append(SpecError(str(e), fl.span, hint=spec.doc))
            continue
        try:
            if op.external:
                value = op.locate(fl.name, value, fl.span.file)
        except SpecError as e:
            errors.append(e)
            continue
        out.append((fl.name, FlagValue(value, fl.span.short)))
    return out


def kind_typo(name: str) -> str | None:
    """The kind ``name`` is a typo of, when no class is likely to be called so: the kind in other
    case (``rmsnorm``), with two letters swapped or shuffled (``RMSNrom``), or with one letter
    dropped (``RMSNor``).  Without a model ``check`` cannot see class names, so only these."""
    for k in KIND_NAMES:
        if name.lower() == k.lower() or (len(name) == len(k) and sorted(name.lower()) == sorted(k.lower())):
            return k
        if len(name) == len(k) - 1 and len(name) >= 4 and any(k[:i] + k[i + 1:] == name for i in range(len(k))):
            return k
    return None


def _check_kinds(rule: Rule, op: Op) -> None:
    alts = rule.class_pattern.alternatives
    kinds = [a for a in alts if a in KIND_NAMES]
    for a in alts:
        if a not in KIND_NAMES and not is_glob(a):
            typo = kind_typo(a)
            if typo:
                raise SpecError(f"unknown kind '{a}'", rule.class_pattern.span,
                                hint=f"did you mean '{typo}'? (a class name is written as the model spells it)")
    bad = [k for k in kinds if k not in op.kinds]
    if bad and not op.any_kind:
        raise SpecError(
            f"{op.name} replaces {' or '.join(op.kinds)} modules, not {' or '.join(bad)}",
            rule.class_pattern.span, hint=f"write '{op.kinds[0]} -> {op.name}'")


def check_spec(spec: Spec, *, prior: SpecError | None = None) -> CheckedSpec:
    """Check every rule and directive; raise one SpecError carrying all the errors found.

    ``prior``: errors already found in the same spec (a parse that failed part-way, whose
    ``partial`` spec is being checked), reported together with these, in file order.
    """
    errors: list[SpecError] = []
    defaults: list[tuple[str, str, FlagValue]] = []
    for d in spec.defaults:
        try:
            op = _op_or_error(d.op, d.span)
        except SpecError as e:
            errors.append(e)
            continue
        for name, fv in _typed_flags(op, d.flags, errors):
            defaults.append((op.name, name, fv))
    rules = []
    for r in spec.rules:
        try:
            op = _op_or_error(r.op.name, r.op.span)
            _check_kinds(r, op)
        except SpecError as e:
            errors.append(e)
            continue
        rules.append(CheckedRule(r, op.name, tuple(_typed_flags(op, r.op.flags, errors, r.op.args))))
    if prior is not None:
        errors = in_file_order(list(prior.errors) + errors)
        if errors or prior.more:
            raise SpecError.combine(errors, prior.more)
    if errors:
        raise SpecError.combine(errors)
    return CheckedSpec(spec, tuple(rules), tuple(defaults))


def in_file_order(errors: list[SpecError]) -> list[SpecError]:
    """Sort errors by position, files in the order they first appear (stable for the rest)."""
    files: dict[str, int] = {}
    for e in errors:
        if e.span is not None:
            files.setdefault(e.span.file, len(files))

    def key(e: SpecError):
        if e.span is None:
            return (len(files), 0, 0)
        return (files[e.span.file], e.span.line, e.span.col)

    return sorted(errors, key=key)


def check_loaded(load) -> CheckedSpec:
    """``check_spec(load())``; when loading fails part-way, the rules that did parse are
    checked too and every error is raised at once."""
    try:
        spec = load()
    except SpecError as e:
        if e.partial is None:
            raise
        check_spec(e.partial, prior=e)
        raise
    return check_spec(spec)
