"""Compile selector globs and class patterns to matchers (pure Python, no regular expressions).

Selector semantics (anchored against the whole dotted module path):

=============  ===============================================================
``*``          any run of characters, dots included (``*.mlp`` = every ``mlp``)
``**``         as a whole path component: zero or more components
               (``model.**.mlp`` matches ``model.mlp`` and ``model.layers.3.mlp``)
``?``          exactly one character other than a dot
``{a,b}``      alternation; alternatives may hold globs
``{0..11}``    every integer from 0 to 11 inclusive (written without leading zeros)
``!sel``       exclusion (handled by the selection stage)
=============  ===============================================================

A selector compiles to a small nondeterministic automaton (Thompson's construction) that is
run as a lazily built DFA, so matching a path costs time linear in the path's length whatever
the selector looks like (no backtracking: ``*?*?*?...`` is as cheap as ``*.mlp``).  A range
``{N..M}`` compiles to a handful of digit-class sequences (``{0..11}`` is ``[0-9]|1[0-1]``),
never to one alternative per integer.

Limits (each a located :class:`SpecError`): a selector is at most ``MAX_SELECTOR_CHARS``
characters, braces nest at most ``MAX_BRACE_DEPTH`` deep, a selector has at most
``MAX_ALTERNATIVES`` alternatives in all, a range bound has at most ``MAX_RANGE_DIGITS`` digits
and a range at most ``MAX_RANGE + 1`` values, and the automaton has at most ``MAX_STATES`` states.
"""

from __future__ import annotations

import re
from functools import lru_cache

from .ast import Span
from .errors import SpecError

MAX_SELECTOR_CHARS = 1000
MAX_BRACE_DEPTH = 8
MAX_ALTERNATIVES = 256
MAX_RANGE = 100_000          # hi - lo of one {lo..hi}
MAX_RANGE_DIGITS = 18
MAX_STATES = 5_000
_DFA_CACHE_LIMIT = 2_000     # DFA states kept per matcher before the cache is dropped

# A range body: two (possibly negative) integers; the digit runs are checked for length before
# int() ever sees them (int() refuses strings over 4300 digits with a ValueError).
RANGE = re.compile(r"\s*(-?)(\d+)\s*\.\.\s*(-?)(\d+)\s*")


def _err(msg: str, span: Span | None, offset: int = 0, width: int = 1, hint: str | None = None):
    if span is not None:
        span = Span(span.file, span.line, span.col + offset, span.col + offset + max(1, width), span.source_line)
    return SpecError(msg, span, hint=hint)


# --------------------------------------------------------------------------- syntax tree
# Nodes: ("lit", c) | ("any",) | ("nondot",) | ("digits", lo, hi) | ("seq", [n...]) |
#        ("alt", [n...]) | ("star", n)

_ANY = ("any",)
_NONDOT = ("nondot",)


def _seq(nodes):
    return nodes[0] if len(nodes) == 1 else ("seq", list(nodes))


class _Parser:
    def __init__(self, text: str, span: Span | None):
        self.text = text
        self.span = span
        self.alternatives = 0

    def parse(self) -> tuple:
        text = self.text
        if not text:
            raise _err("empty selector", self.span)
        comps = _split_components(text)
        n = len(comps)
        nodes: list[tuple] = []
        dot = ("lit", ".")
        comp_nondot = ("seq", [_NONDOT, ("star", _NONDOT)])     # [^.]+
        for idx, (comp, start) in enumerate(comps):
            if comp == "**":
                if n == 1:
                    nodes.append(("star", _ANY))
                elif idx == 0:
                    nodes.append(("star", ("seq", [comp_nondot, dot])))
                elif idx == n - 1:
                    nodes.append(("star", ("seq", [dot, comp_nondot])))
                else:
                    nodes.append(("star", ("seq", [dot, comp_nondot])))
                    nodes.append(dot)
            else:
                if "**" in comp:
                    raise _err("'**' must be a whole path component (e.g. model.**.mlp)", self.span,
                               start + comp.index("**"), 2, hint="use '*' inside a name")
                if comp == "":
                    raise _err("empty path component in selector", self.span, start,
                               hint="module paths look like model.layers.0.mlp")
                if idx > 0 and comps[idx - 1][0] != "**":
                    nodes.append(dot)
                nodes.append(self.glob(comp, start, 0))
        if len(text) > MAX_SELECTOR_CHARS:     # checked last: a more precise error may come first
            raise _err(f"selector is too long ({len(text)} characters; at most {MAX_SELECTOR_CHARS})",
                       self.span, 0, len(text))
        return _seq(nodes)

    def glob(self, text: str, base: int, depth: int) -> tuple:
        out: list[tuple] = []
        i = 0
        while i < len(text):
            c = text[i]
            if c == "*":
                while i + 1 < len(text) and text[i + 1] == "*":
                    i += 1
                out.append(("star", _ANY))
            elif c == "?":
                out.append(_NONDOT)
            elif c == "{":
                d, j = 1, i + 1
                while j < len(text) and d:
                    d += {"{": 1, "}": -1}.get(text[j], 0)
                    j += 1
                if d:
                    raise _err("unclosed '{' in selector", self.span, base + i,
                               hint="alternation is written {a,b}, a range {0..11}")
                if depth + 1 > MAX_BRACE_DEPTH:
                    raise _err(f"braces nest too deep (at most {MAX_BRACE_DEPTH} levels)", self.span, base + i,
                               j - i)
                out.append(self.brace(text[i + 1:j - 1], base + i + 1, depth + 1))
                i = j - 1
            elif c == "}":
                raise _err("unexpected '}' in selector", self.span, base + i, hint="expected '{' before it")
            elif c == ",":
                raise _err("',' outside braces in selector", self.span, base + i)
            else:
                out.append(("lit", c))
            i += 1
        return _seq(out) if out else ("seq", [])

    def brace(self, inner: str, base: int, depth: int) -> tuple:
        width = len(inner) + 2
        m = RANGE.fullmatch(inner)
        if m:
            for g in (2, 4):
                if len(m.group(g)) > MAX_RANGE_DIGITS:
                    raise _err(f"range bound has {len(m.group(g))} digits (at most {MAX_RANGE_DIGITS})",
                               self.span, base - 1, width)
            lo = int(m.group(1) + m.group(2))
            hi = int(m.group(3) + m.group(4))
            if lo > hi:
                raise _err(f"empty range {{{lo}..{hi}}}: the first number must not exceed the second",
                           self.span, base - 1, width)
            if hi - lo > MAX_RANGE:
                raise _err(f"range {{{lo}..{hi}}} is too large (at most {MAX_RANGE + 1} values)", self.span,
                           base - 1, width)
            alts = _range_alternatives(lo, hi)
            self.count(len(alts), base, width)
            return ("alt", alts)
        if ".." in inner and "," not in inner:
            raise _err(f"bad range {{{inner}}}", self.span, base - 1, width,
                       hint="a range is two integers, e.g. {0..11}")
        parts = split_top(inner)
        if any(not p.strip() for p, _ in parts):
            raise _err("empty alternative in {...}", self.span, base - 1, width,
                       hint="write alternatives as {q_norm,k_norm}")
        self.count(len(parts), base, width)
        return ("alt", [self.glob(p.strip(), base + off + (len(p) - len(p.lstrip())), depth) for p, off in parts])

    def count(self, n: int, base: int, width: int) -> None:
        self.alternatives += n
        if self.alternatives > MAX_ALTERNATIVES:
            raise _err(f"selector has too many alternatives (more than {MAX_ALTERNATIVES})", self.span,
                       base - 1, width, hint="split it into several rules or use a glob")


def split_top(inner: str) -> list[tuple[str, int]]:
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


def _split_components(text: str) -> list[tuple[str, int]]:
    """Split at dots outside braces ('..' inside braces is a range)."""
    comps, depth, start = [], 0, 0
    for k, c in enumerate(text):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "." and depth == 0:
            comps.append((text[start:k], start))
            start = k + 1
    comps.append((text[start:], start))
    return comps


# --------------------------------------------------------------------------- integer ranges
def _digit_seqs(a: str, b: str) -> list[list[tuple[str, str]]]:
    """Digit-class sequences matching exactly the numbers a..b (same length, as strings)."""
    n = len(a)
    if a == b:
        return [[(c, c) for c in a]]
    if n == 1:
        return [[(a, b)]]
    if a[0] == b[0]:
        return [[(a[0], a[0])] + rest for rest in _digit_seqs(a[1:], b[1:])]
    out: list[list[tuple[str, str]]] = []
    lo_first, hi_first = a[0], b[0]
    if a[1:] != "0" * (n - 1):
        out += [[(a[0], a[0])] + rest for rest in _digit_seqs(a[1:], "9" * (n - 1))]
        lo_first = chr(ord(a[0]) + 1)
    tail_full = b[1:] == "9" * (n - 1)
    if not tail_full:
        hi_first = chr(ord(b[0]) - 1)
    if lo_first <= hi_first:
        out.append([(lo_first, hi_first)] + [("0", "9")] * (n - 1))
    if not tail_full:
        out += [[(b[0], b[0])] + rest for rest in _digit_seqs("0" * (n - 1), b[1:])]
    return out


def _nonneg_seqs(lo: int, hi: int) -> list[list[tuple[str, str]]]:
    out = []
    for length in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (length - 1) if length > 1 else 0)
        b = min(hi, 10 ** length - 1)
        if a <= b:
            out += _digit_seqs(str(a), str(b))
    return out


def _range_alternatives(lo: int, hi: int) -> list[tuple]:
    seqs: list[tuple] = []

    def node(prefix: list[tuple], s: list[tuple[str, str]]) -> tuple:
        return _seq(prefix + [("lit", x) if x == y else ("digits", x, y) for x, y in s])

    if lo < 0:
        neg_hi = min(hi, -1)
        seqs += [node([("lit", "-")], s) for s in _nonneg_seqs(-neg_hi, -lo)]
    if hi >= 0:
        seqs += [node([], s) for s in _nonneg_seqs(max(lo, 0), hi)]
    return seqs


# --------------------------------------------------------------------------- automaton
class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[tuple, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise _TooBig
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: tuple, start: int) -> int:
        """Add ``node`` starting at ``start``; return its end state."""
        kind = node[0]
        if kind in ("lit", "any", "nondot", "digits"):
            end = self.state()
            self.edges[start].append((node, end))
            return end
        if kind == "seq":
            cur = start
            for sub in node[1]:
                cur = self.build(sub, cur)
            return cur
        if kind == "alt":
            end = self.state()
            for sub in node[1]:
                s = self.state()
                self.eps[start].append(s)
                self.eps[self.build(sub, s)].append(end)
            return end
        if kind == "star":
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(node[1], loop)].append(loop)
            return loop
        raise AssertionError(kind)


class _TooBig(Exception):
    pass


def _accepts(pred: tuple, ch: str) -> bool:
    kind = pred[0]
    if kind == "lit":
        return ch == pred[1]
    if kind == "any":
        return True
    if kind == "nondot":
        return ch != "."
    return pred[1] <= ch <= pred[2]          # digits


class Matcher:
    """An anchored matcher: ``match(path)`` is True when the whole path matches.  Linear time."""

    def __init__(self, text: str, nfa: _NFA, start: int, accept: int):
        self.pattern = text
        self._nfa = nfa
        self._accept = accept
        self._nfa_start = start
        self._ids: dict[frozenset, int] = {}
        self._sets: list[frozenset] = []
        self._next: list[dict[str, int]] = []
        self._final: list[bool] = []
        self._start = self._intern(self._closure({start}))

    def _closure(self, states) -> frozenset:
        stack = list(states)
        seen = set(stack)
        while stack:
            s = stack.pop()
            for t in self._nfa.eps[s]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    def _intern(self, states: frozenset) -> int:
        i = self._ids.get(states)
        if i is None:
            if len(self._sets) >= _DFA_CACHE_LIMIT:     # bound memory: start the cache afresh
                self._ids.clear(); self._sets.clear(); self._next.clear(); self._final.clear()  # noqa: E702
            i = len(self._sets)
            self._ids[states] = i
            self._sets.append(states)
            self._next.append({})
            self._final.append(self._accept in states)
        return i

    def _step(self, d: int, ch: str) -> int:
        targets = {t for s in self._sets[d] for pred, t in self._nfa.edges[s] if _accepts(pred, ch)}
        states = self._closure(targets)
        before = len(self._sets)
        nd = self._intern(states)
        if len(self._sets) < before:          # the cache was reset: d is gone, do not record
            return nd
        self._next[d][ch] = nd
        return nd

    def match(self, path: str) -> bool:
        if len(self._sets) >= _DFA_CACHE_LIMIT - len(path) - 1:
            self._ids.clear(); self._sets.clear(); self._next.clear(); self._final.clear()  # noqa: E702
            self._start = self._intern(self._closure({self._nfa_start}))
        d = self._start
        nxt = self._next
        for ch in path:
            n = nxt[d].get(ch)
            if n is None:
                n = self._step(d, ch)
            d = n
            if not self._sets[d]:
                return False
        return self._final[d]

    fullmatch = match

    def __repr__(self) -> str:
        return f"Matcher({self.pattern!r})"


def _compile(text: str, span: Span | None) -> Matcher:
    tree = _Parser(text, span).parse()
    nfa = _NFA()
    try:
        start = nfa.state()
        accept = nfa.build(tree, start)
    except _TooBig:
        raise _err(f"selector is too complex (its matcher would need more than {MAX_STATES} states)", span, 0,
                   len(text), hint="split it into several rules") from None
    return Matcher(text, nfa, start, accept)


@lru_cache(maxsize=4096)
def compile_selector(text: str) -> Matcher:
    """The matcher of a selector (without the ``!``); raises SpecError (without a location) if bad."""
    return _compile(text, None)


def check_selector(text: str, span: Span) -> None:
    """Raise a located SpecError if ``text`` is not a valid selector."""
    _compile(text, span)


# --------------------------------------------------------------------------- class patterns
class ClassGlob:
    """``*`` any run, ``?`` one character: the two-pointer glob algorithm (linear, no backtracking
    blow-up: at most one saved star position)."""

    def __init__(self, pattern: str):
        self.pattern = pattern

    def match(self, name: str) -> bool:
        p, s = self.pattern, name
        i = j = 0
        star = -1
        mark = 0
        while j < len(s):
            if i < len(p) and (p[i] == "?" or p[i] == s[j]):
                i += 1
                j += 1
            elif i < len(p) and p[i] == "*":
                star, mark = i, j
                i += 1
            elif star >= 0:
                i = star + 1
                mark += 1
                j = mark
            else:
                return False
        while i < len(p) and p[i] == "*":
            i += 1
        return i == len(p)

    fullmatch = match


@lru_cache(maxsize=1024)
def class_glob(text: str) -> ClassGlob:
    return ClassGlob(text)


class_glob_regex = class_glob   # the old name


def is_glob(text: str) -> bool:
    return any(c in text for c in "*?{")
