"""Parse .kpatch text into a :class:`Spec` (pure: text in, frozen tree out).

``include "other.kpatch"`` is expanded in place, relative to the including file; shipped
specs can be included by bare name (``include "qwen3"``).  Cycles are errors.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from ..resources import grammar_path, specs_dir
from .ast import Arg, AttentionDirective, ClassPattern, DefaultDirective, Flag, OpCall, Rule, Selector, Span, Spec
from .errors import SpecError
from .selectors import check_selector

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}

# Human names for terminals in "expected ..." messages.
_TERMINAL_NAMES = {
    "SELECTOR": "a module selector (e.g. *.mlp)",
    "CLASSPAT": "a class pattern or kind (e.g. RMSNorm, Qwen3MLP, *Norm)",
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": "a quoted string",
    "COLON": "':'",
    "COMMA": "','",
    "VBAR": "'|'",
    "__ANON_0": "'->'",
    "LPAR": "'('",
    "RPAR": "')'",
    "EQUAL": "'='",
    "_NL": "end of line",
    "OPTIONAL": "'optional'",
    "DTYPE": "'dtype'",
    "INCLUDE": "'include'",
    "DEFAULT": "'default'",
    "ATTENTION": "'attention'",
    "DOT": "'.'",
    "$END": "end of file",
}


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(grammar_path().read_text(), parser="lalr", propagate_positions=True,
                maybe_placeholders=False)


def _human(term: str, parser: Lark) -> str:
    if term in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[term]
    try:
        pat = parser.get_terminal(term).pattern
        if pat.type == "str":
            return f"'{pat.value}'"
    except Exception:
        pass
    return term.lower()


class _Build(Transformer):
    def __init__(self, file: str, lines: list[str]):
        super().__init__()
        self.file = file
        self.lines = lines

    def span(self, tok_or_meta, width: int | None = None) -> Span:
        line, col = tok_or_meta.line, tok_or_meta.column
        if width is None:
            end = getattr(tok_or_meta, "end_column", None)
            end_line = getattr(tok_or_meta, "end_line", line)
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
                from .errors import did_you_mean
                raise SpecError(f"unknown dtype '{tok}'", self.span(tok),
                                hint=did_you_mean(str(tok), DTYPES) or f"expected one of {', '.join(DTYPES)}")
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
        src = self.lines[first.line - 1] if 0 < first.line <= len(self.lines) else ""
        return ".".join(str(t) for t in items), Span(self.file, first.line, first.column, last.end_column, src)

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
        t = str(items[0])
        try:
            return int(t)
        except ValueError:
            return float(t)

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


def _syntax_error(e: UnexpectedInput, text: str, file: str, parser: Lark) -> SpecError:
    lines = text.split("\n")
    if isinstance(e, UnexpectedEOF) or getattr(e, "line", -1) in (-1, None):
        # UnexpectedEOF carries no position: point after the last character.
        nonempty = [i for i, l in enumerate(lines) if l.strip()]
        ln = (nonempty[-1] + 1) if nonempty else 1
        col = len(lines[ln - 1]) + 1 if lines else 1
        exp = sorted({_human(t, parser) for t in getattr(e, "expected", [])})
        return SpecError("unexpected end of file", Span(file, ln, col, col + 1, lines[ln - 1] if lines else ""),
                         hint=("expected " + " or ".join(exp)) if exp else None)
    ln, col = e.line, e.column
    src = lines[ln - 1] if 0 < ln <= len(lines) else ""
    if isinstance(e, UnexpectedCharacters):
        ch = src[col - 1] if 0 < col <= len(src) else "?"
        allowed = getattr(e, "allowed", None) or set()
        exp = sorted({_human(t, parser) for t in allowed})
        msg = f"unexpected character {ch!r}"
        return SpecError(msg, Span(file, ln, col, col + 1, src),
                         hint=("expected " + " or ".join(exp)) if exp else None)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    exp = sorted({_human(t, parser) for t in e.expected if not t.startswith("__ANON") or t == "__ANON_0"})
    shown = "end of line" if tok.type == "_NL" else ("end of file" if tok.type == "$END" else repr(str(tok)))
    width = max(1, len(str(tok))) if tok.type not in ("_NL", "$END") else 1
    msg = f"unexpected {shown}"
    return SpecError(msg, Span(file, ln, col, col + width, src), hint=("expected " + " or ".join(exp)) if exp else None)


def parse_spec(text: str, file: str = "<spec>", *, _seen: tuple[str, ...] = (), base_dir: Path | None = None) -> Spec:
    """Parse spec text.  ``file`` names the source in error messages."""
    parser = _parser()
    if not text.endswith("\n"):
        text = text + "\n"
    lines = text.split("\n")
    try:
        tree = parser.parse(text)
        items = _Build(file, lines).transform(tree)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, file, parser) from None
    except VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        raise
    dtypes: tuple[str, ...] = ()
    dtype_span = None
    attention: AttentionDirective | None = None
    rules: list[Rule] = []
    defaults: list[DefaultDirective] = []
    includes: list[str] = []
    for item in items:
        kind = item[0]
        if kind == "dtype":
            if dtype_span is not None:
                raise SpecError("'dtype' given twice", item[2], notes=[("first given here", dtype_span)],
                                hint="list every dtype in one directive: dtype bf16, fp32")
            dtypes, dtype_span = item[1], item[2]
        elif kind == "include":
            target = _resolve_include(item[1], item[2], base_dir)
            key = str(target)
            if key in _seen or key == file:
                raise SpecError(f"include cycle: {item[1]!r} includes itself", item[2])
            sub = parse_spec(target.read_text(), str(target), _seen=_seen + (file, key), base_dir=target.parent)
            includes.append(key)
            includes.extend(sub.includes)
            rules.extend(sub.rules)
            defaults.extend(sub.defaults)
            if sub.dtypes and not dtypes:
                dtypes, dtype_span = sub.dtypes, sub.dtype_span
            if sub.attention is not None and attention is None:
                attention = sub.attention
        elif kind == "default":
            defaults.append(item[1])
        elif kind == "attention":
            if attention is not None:
                raise SpecError("'attention' given twice", item[1].span,
                                notes=[("first given here", attention.span)],
                                hint="a model has one attention implementation; keep one directive")
            attention = item[1]
        else:
            rules.append(item[1])
    from dataclasses import replace
    rules = [replace(r, index=i) for i, r in enumerate(rules)]
    return Spec(file, dtypes, tuple(rules), tuple(defaults), dtype_span, tuple(includes), attention)


def _resolve_include(name: str, span: Span, base_dir: Path | None) -> Path:
    cands = []
    p = Path(name)
    if p.is_absolute():
        cands.append(p)
    else:
        cands.append((base_dir or Path.cwd()) / p)
        cands.append(specs_dir() / p)
        if not name.endswith(".kpatch"):
            cands.append(specs_dir() / (name + ".kpatch"))
    for c in cands:
        if c.is_file():
            return c.resolve()
    raise SpecError(f"included file {name!r} not found", span,
                    hint=f"looked in {', '.join(str(c.parent) for c in cands)}")


def find_spec_file(name: str | Path) -> Path | None:
    """``name`` itself if it is a file, else the shipped spec it names (``qwen3`` or ``qwen3.kpatch``)."""
    text = str(name)
    if "\n" in text or len(text) > 1024:
        return None
    p = Path(text)
    try:
        if p.is_file():
            return p
        if "/" not in text:
            shipped = specs_dir() / (p.name if p.suffix == ".kpatch" else p.name + ".kpatch")
            if shipped.is_file():
                return shipped
    except OSError:          # not a usable path: spec text
        return None
    return None


def load_spec(path_or_text: str | Path) -> Spec:
    """Load a spec from a file path, a shipped spec name (``"qwen3"``), or spec text.

    A ``Path`` or a string ending in ``.kpatch`` must name a file (or a shipped spec); a string
    that names neither is spec text.
    """
    p = find_spec_file(path_or_text)
    if p is not None:
        return parse_spec(p.read_text(), str(p), base_dir=p.parent)
    if isinstance(path_or_text, Path) or str(path_or_text).endswith(".kpatch"):
        raise SpecError(f"spec file '{path_or_text}' not found")
    return parse_spec(str(path_or_text), "<string>")
