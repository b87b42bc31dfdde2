"""The Lark transformer: a parse tree of one statement -> the frozen syntax tree's nodes with their
spans; literal values checked (integers of 64 bits, finite floats, dtype names)."""

from __future__ import annotations

import math
import re

from lark import Token, Transformer, v_args

from ..util.vocab import DTYPE_ALIASES, DTYPES, dtype_hint, is_fp8_name
from .ast import Arg, AttentionDirective, ClassPattern, DefaultDirective, Flag, OpCall, Rule, Selector, Span
from .errors import SpecError, clip, did_you_mean
from .selectors import check_selector

MAX_INT_DIGITS = 19                 # integers must fit 64 bits


class _BadValue:
    """The value of a flag whose literal was already reported as an error."""

    def __repr__(self) -> str:
        return "<bad value>"


BAD_VALUE = _BadValue()


class SpecBuilder(Transformer):
    def __init__(self, file: str, lines: list[str], line_offset: int = 0):
        super().__init__()
        self.file = file
        self.lines = lines
        self.offset = line_offset
        self.errors: list[SpecError] = []     # errors that did not stop the statement

    def span(self, tok_or_meta, width: int | None = None) -> Span:
        line, col = tok_or_meta.line + self.offset, tok_or_meta.column
        if width is None:
            end = getattr(tok_or_meta, "end_column", None)
            end_line = getattr(tok_or_meta, "end_line", line - self.offset) + self.offset
            if end is None or end_line != line:
                end = col + 1
        else:
            end = col + width
        src = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return Span(self.file, line, col, end, src)

    def start(self, items):
        return list(items)

    @v_args(meta=True)
    def dtype_directive(self, meta, items):
        names = []
        for tok in items:
            name = DTYPE_ALIASES.get(str(tok), str(tok))
            if name not in DTYPES:
                raise SpecError(f"unknown dtype '{tok}'", self.span(tok),
                                hint=(None if is_fp8_name(tok) else did_you_mean(str(tok), DTYPES))
                                or dtype_hint(tok))
            names.append(name)
        return ("dtype", tuple(dict.fromkeys(names)), self.span(meta))

    @v_args(meta=True)
    def include_directive(self, meta, items):
        tok = items[0]
        return ("include", str(tok)[1:-1], self.span(tok))

    @v_args(meta=True)
    def default_directive(self, meta, items):
        name, name_span = items[0]
        flags = tuple(i for i in items[1:] if isinstance(i, Flag))
        return ("default", DefaultDirective(name, flags, name_span))

    @v_args(meta=True)
    def attention_directive(self, meta, items):
        tok = items[0]
        text = str(tok)
        if tok.type == "STRING":
            text = text[1:-1]
        flags = tuple(i for i in items[1:] if isinstance(i, Flag))
        return ("attention", AttentionDirective(text, flags, self.span(tok)))

    @v_args(meta=True)
    def op_name(self, meta, items):
        """``fused_rmsnorm`` or a dotted external op ``liger.rms_norm``: (name, span of the whole name)."""
        first, last = items[0], items[-1]
        s = self.span(first)
        return ".".join(str(t) for t in items), Span(self.file, s.line, s.col, last.end_column, s.source_line)

    @v_args(meta=True)
    def arg(self, meta, items):
        return Arg(items[0], self.span(meta))

    def selector(self, items):
        tok = items[0]
        text = str(tok)
        sp = self.span(tok)
        negated = text.startswith("!")
        body = text[1:] if negated else text
        body_span = Span(sp.file, sp.line, sp.col + int(negated), sp.end_col, sp.source_line)
        check_selector(body, body_span)
        return Selector(body, negated, sp)

    @v_args(meta=True)
    def class_pattern(self, meta, items):
        return ClassPattern(tuple(str(t) for t in items), self.span(meta))

    def flag(self, items):
        name, value = items
        return Flag(str(name), value, self.span(name))

    def number(self, items):
        try:
            return self._number(items)
        except SpecError as e:        # keep going: the rule's other flags may hold errors too
            self.errors.append(e)
            return BAD_VALUE

    def _number(self, items):
        tok = items[0]
        t = str(tok)
        mant = re.split(r"[eE]", t)[0]
        if re.fullmatch(r"[+-]?\d+", t):
            if len(t.lstrip("+-").lstrip("0")) > MAX_INT_DIGITS or not -2**63 <= int(t) < 2**63:
                raise SpecError(f"integer {clip(t)} is out of range", self.span(tok),
                                hint="integers must fit in 64 bits (-2**63 .. 2**63-1)")
            return int(t)
        v = float(t)
        if not math.isfinite(v):
            raise SpecError(f"number {clip(t)} is out of range (not a finite 64-bit float)", self.span(tok),
                            hint="finite numbers only: at most about 1.8e308 in magnitude")
        if v == 0.0 and any(c in "123456789" for c in mant):
            raise SpecError(f"number {clip(t)} is too small: it rounds to 0", self.span(tok),
                            hint="the smallest positive 64-bit float is about 5e-324")
        return v

    def string(self, items):
        return str(items[0])[1:-1]

    def word(self, items):
        t = str(items[0])
        return {"true": True, "false": False, "none": None}.get(t, t)

    @v_args(meta=True)
    def op_call(self, meta, items):
        name, name_span = items[0]
        flags = tuple(i for i in items[1:] if isinstance(i, Flag))
        args = tuple(i for i in items[1:] if isinstance(i, Arg))
        seen_flag = False
        for i in items[1:]:
            seen_flag = seen_flag or isinstance(i, Flag)
            if isinstance(i, Arg) and seen_flag:
                raise SpecError("a positional value after a flag", i.span,
                                hint="put the positional values first: hub(\"org/repo\", \"Layer\", version=1)")
        return OpCall(name, flags, name_span, args)

    @v_args(meta=True)
    def rule(self, meta, items):
        optional = bool(items) and isinstance(items[0], Token) and items[0].type == "OPTIONAL"
        rest = items[1:] if optional else items
        sels = tuple(i for i in rest if isinstance(i, Selector))
        cp = next(i for i in rest if isinstance(i, ClassPattern))
        op = next(i for i in rest if isinstance(i, OpCall))
        first = sels[0].span
        sp = Span(first.file, first.line, (items[0].column if optional else first.col), None, first.source_line)
        if all(s.negated for s in sels):
            raise SpecError("a rule needs at least one selector that is not an exclusion", sels[0].span,
                            hint="write e.g. '*.mlp, !model.layers.0.mlp'")
        return ("rule", Rule(sels, cp, op, optional, sp))
