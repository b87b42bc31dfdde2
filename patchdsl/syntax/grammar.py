"""The spec grammar's Lark parser, and Lark's errors made located SpecErrors ("unexpected ... expected
..." with the terminals named for people)."""

from __future__ import annotations

from functools import lru_cache

from lark import Lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..util.resources import grammar_path
from .ast import Span
from .errors import SpecError, clip

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
def lark_parser() -> Lark:
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


def syntax_error(e: UnexpectedInput, chunk: list[str], file: str, parser: Lark, offset: int = 0,
                  echo: bool = True) -> SpecError:
    """A located SpecError for a Lark error in ``chunk`` (lines of the file from ``offset``)."""
    def src(ln: int) -> str:
        return chunk[ln - 1] if echo and 0 < ln <= len(chunk) else ""

    if isinstance(e, UnexpectedEOF) or getattr(e, "line", -1) in (-1, None):
        # UnexpectedEOF carries no position: point after the last character.
        nonempty = [i for i, l in enumerate(chunk) if l.strip()]
        ln = (nonempty[-1] + 1) if nonempty else 1
        col = len(chunk[ln - 1]) + 1 if chunk else 1
        exp = sorted({_human(t, parser) for t in getattr(e, "expected", [])})
        return SpecError("unexpected end of file", Span(file, ln + offset, col, col + 1, src(ln)),
                         hint=("expected " + " or ".join(exp)) if exp else None)
    ln, col = e.line, e.column
    line = chunk[ln - 1] if 0 < ln <= len(chunk) else ""
    if isinstance(e, UnexpectedCharacters):
        ch = line[col - 1] if 0 < col <= len(line) else "?"
        allowed = getattr(e, "allowed", None) or set()
        exp = sorted({_human(t, parser) for t in allowed})
        msg = f"unexpected character {ch!r}" if echo else "unexpected character"
        return SpecError(msg, Span(file, ln + offset, col, col + 1, src(ln)),
                         hint=("expected " + " or ".join(exp)) if exp else None)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    exp = sorted({_human(t, parser) for t in e.expected if not t.startswith("__ANON") or t == "__ANON_0"})
    shown = "end of line" if tok.type == "_NL" else ("end of file" if tok.type == "$END" else repr(clip(str(tok), 60)))
    width = max(1, len(str(tok))) if tok.type not in ("_NL", "$END") else 1
    msg = f"unexpected {shown}" if echo or tok.type in ("_NL", "$END") else "unexpected text"
    return SpecError(msg, Span(file, ln + offset, col, col + width, src(ln)),
                     hint=("expected " + " or ".join(exp)) if exp else None)
