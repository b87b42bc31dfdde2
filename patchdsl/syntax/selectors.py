"""Compile selector globs and class patterns to regular expressions (pure Python).

Selector semantics (anchored against the whole dotted module path):

=============  ===============================================================
``*``          any run of characters, dots included (``*.mlp`` = every ``mlp``)
``**``         as a whole path component: zero or more components
               (``model.**.mlp`` matches ``model.mlp`` and ``model.layers.3.mlp``)
``?``          exactly one character other than a dot
``{a,b}``      alternation; alternatives may hold globs
``{0..11}``    every integer from 0 to 11 inclusive
``!sel``       exclusion (handled by the selection stage)
=============  ===============================================================
"""

from __future__ import annotations

import re
from functools import lru_cache

from .ast import Span
from .errors import SpecError

_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")
MAX_RANGE = 100_000


def _err(msg: str, span: Span | None, offset: int = 0, width: int = 1, hint: str | None = None):
    if span is not None:
        span = Span(span.file, span.line, span.col + offset, span.col + offset + width, span.source_line)
    return SpecError(msg, span, hint=hint)


def _glob_body(text: str, span: Span | None, base: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "*":
            out.append(".*")
            while i + 1 < len(text) and text[i + 1] == "*":
                i += 1
        elif c == "?":
            out.append("[^.]")
        elif c == "{":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise _err("unclosed '{' in selector", span, base + i,
                           hint="alternation is written {a,b}, a range {0..11}")
            inner = text[i + 1:j - 1]
            out.append(_brace(inner, span, base + i + 1))
            i = j - 1
        elif c == "}":
            raise _err("unexpected '}' in selector", span, base + i, hint="expected '{' before it")
        elif c == ",":
            raise _err("',' outside braces in selector", span, base + i)
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _split_top(inner: str) -> list[tuple[str, int]]:
    parts, depth, start = [], 0, 0
    for k, c in enumerate(inner):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append((inner[start:k], start))
            start = k + 1
    parts.append((inner[start:], start))
    return parts


def _brace(inner: str, span: Span | None, base: int) -> str:
    m = _RANGE.match(inner)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise _err(f"empty range {{{lo}..{hi}}}: the first number must not exceed the second",
                       span, base - 1, len(inner) + 2)
        if hi - lo > MAX_RANGE:
            raise _err(f"range {{{lo}..{hi}}} is too large (at most {MAX_RANGE} values)", span, base - 1,
                       len(inner) + 2)
        return "(?:" + "|".join(str(n) for n in range(hi, lo - 1, -1)) + ")"
    if ".." in inner and "," not in inner:
        raise _err(f"bad range {{{inner}}}", span, base - 1, len(inner) + 2,
                   hint="a range is two integers, e.g. {0..11}")
    parts = _split_top(inner)
    if any(not p.strip() for p, _ in parts):
        raise _err("empty alternative in {...}", span, base - 1, len(inner) + 2,
                   hint="write alternatives as {q_norm,k_norm}")
    return "(?:" + "|".join(_glob_body(p.strip(), span, base + off) for p, off in parts) + ")"


def selector_regex(text: str, span: Span | None = None) -> str:
    """Return the anchored regex source for a selector (without the ``!``)."""
    if not text:
        raise _err("empty selector", span)
    comps = _split_components(text)
    pieces: list[str] = []
    pos = 0
    n = len(comps)
    for idx, comp in enumerate(comps):
        if comp == "**":
            if n == 1:
                pieces.append(".*")
            elif idx == 0:
                pieces.append(r"(?:[^.]+\.)*")
            elif idx == n - 1:
                pieces.append(r"(?:\.[^.]+)*")
            else:
                pieces.append(r"(?:\.[^.]+)*\.")
        else:
            if "**" in comp:
                raise _err("'**' must be a whole path component (e.g. model.**.mlp)", span,
                           pos + comp.index("**"), 2, hint="use '*' inside a name")
            if comp == "":
                raise _err("empty path component in selector", span, pos,
                           hint="module paths look like model.layers.0.mlp")
            prefix = ""
            if idx > 0 and comps[idx - 1] != "**":
                prefix = r"\."
            pieces.append(prefix + _glob_body(comp, span, pos))
        pos += len(comp) + 1
    return "".join(pieces)


def _split_components(text: str) -> list[str]:
    comps, depth, start = [], 0, 0
    for k, c in enumerate(text):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "." and depth == 0:
            # '..' inside braces is a range; at top level it is an empty component
            comps.append(text[start:k])
            start = k + 1
    comps.append(text[start:])
    return comps


@lru_cache(maxsize=4096)
def compile_selector(text: str) -> re.Pattern[str]:
    return re.compile(r"\A(?:" + selector_regex(text) + r")\Z")


def check_selector(text: str, span: Span) -> None:
    """Raise a located SpecError if ``text`` is not a valid selector."""
    selector_regex(text, span)


def class_glob_regex(text: str) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)
    return re.compile(r"\A" + body + r"\Z")


def is_glob(text: str) -> bool:
    return any(c in text for c in "*?{")
