"""Parse .kpatch text into a :class:`Spec` (text in, frozen tree out).

Every error of a spec is collected (up to ``errors.MAX_ERRORS``) and raised as one
:class:`SpecError` whose ``errors`` are the single, located errors in file order.

Includes (documented in docs/language.md, "Includes and limits"):

* ``include "other.kpatch"`` is expanded in place.  A relative name resolves against the folder
  of the file holding the directive, then against each folder in ``include_dirs``; a bare name
  (``include "qwen3"``) also finds a shipped spec.
* The file found (after following links) must lie inside an allowed folder: the folder of the
  top-level spec file (and its subfolders), a folder in ``include_dirs``, or the shipped specs
  folder.  Spec text given as a string has no folder of its own: it may include only shipped
  specs and files in ``include_dirs``.
* Only regular files named ``*.kpatch`` are read, at most ``MAX_SPEC_BYTES`` each, and they
  must be UTF-8 text.  An error about a file that is not a spec never shows its content.
* Limits, each a located error: include depth ``MAX_INCLUDE_DEPTH``, include directives
  expanded ``MAX_INCLUDES``, rules after expansion ``MAX_RULES``, bytes read in all
  ``MAX_TOTAL_BYTES``; cycles are errors.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from .. import files
from ..resources import grammar_path, specs_dir
from .ast import Arg, AttentionDirective, ClassPattern, DefaultDirective, Flag, OpCall, Rule, Selector, Span, Spec
from .errors import MAX_ERRORS, SpecError, did_you_mean
from .selectors import check_selector

MAX_SPEC_BYTES = 64 * 1024          # one spec file
MAX_TOTAL_BYTES = 256 * 1024        # a spec and everything it includes
MAX_INCLUDE_DEPTH = 16
MAX_INCLUDES = 64                   # include directives expanded in all
MAX_RULES = 500                     # rules after expanding includes
MAX_INT_DIGITS = 19                 # integers must fit 64 bits

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


def _clip(t: str, n: int = 24) -> str:
    return t if len(t) <= n else t[:n] + f"... ({len(t)} characters)"


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


class _BadValue:
    """The value of a flag whose literal was already reported as an error."""

    def __repr__(self) -> str:
        return "<bad value>"


BAD_VALUE = _BadValue()


class _Build(Transformer):
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
                raise SpecError(f"integer {_clip(t)} is out of range", self.span(tok),
                                hint="integers must fit in 64 bits (-2**63 .. 2**63-1)")
            return int(t)
        v = float(t)
        if not math.isfinite(v):
            raise SpecError(f"number {_clip(t)} is out of range (not a finite 64-bit float)", self.span(tok),
                            hint="finite numbers only: at most about 1.8e308 in magnitude")
        if v == 0.0 and any(c in "123456789" for c in mant):
            raise SpecError(f"number {_clip(t)} is too small: it rounds to 0", self.span(tok),
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


def _syntax_error(e: UnexpectedInput, chunk: list[str], file: str, parser: Lark, offset: int = 0,
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
    shown = "end of line" if tok.type == "_NL" else ("end of file" if tok.type == "$END" else repr(_clip(str(tok), 60)))
    width = max(1, len(str(tok))) if tok.type not in ("_NL", "$END") else 1
    msg = f"unexpected {shown}" if echo or tok.type in ("_NL", "$END") else "unexpected text"
    return SpecError(msg, Span(file, ln + offset, col, col + width, src(ln)),
                     hint=("expected " + " or ".join(exp)) if exp else None)


def _code_of(line: str) -> tuple[bool, bool]:
    """(has code outside comments, ends with a line-continuation backslash)."""
    quote = None
    last = ""
    has_code = False
    for c in line.rstrip("\r"):
        if quote:
            if c == quote:
                quote = None
            last = c
            continue
        if c == "#":
            return has_code, False
        if c in "\"'":
            quote = c
        if not c.isspace():
            has_code = True
        last = c
    return has_code, last == "\\" and not quote


def _statements(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) 0-based line indices of each statement (backslash continuations joined)."""
    out, start = [], None
    for i, line in enumerate(lines):
        code, cont = _code_of(line)
        if start is None:
            if not (code or cont):
                continue
            start = i
        if not cont:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(lines) - 1))
    return out


@dataclass
class _Ctx:
    """What one load shares across its includes."""

    roots: tuple[Path, ...]              # real paths includes may read under
    include_dirs: tuple[Path, ...]
    errors: list[SpecError] = field(default_factory=list)
    more: int = 0
    rules: int = 0
    includes: int = 0
    bytes: int = 0
    stop: bool = False                   # a limit was hit: stop expanding

    def add(self, e: SpecError) -> None:
        for one in e.errors:
            if len(self.errors) < MAX_ERRORS:
                self.errors.append(one)
            else:
                self.more += 1
        self.more += e.more


def _default_roots(base_dir: Path | None, include_dirs: tuple[Path, ...]) -> tuple[Path, ...]:
    roots = [Path(os.path.realpath(d)) for d in include_dirs]
    if base_dir is not None:
        roots.insert(0, Path(os.path.realpath(base_dir)))
    try:
        roots.append(Path(os.path.realpath(specs_dir())))
    except FileNotFoundError:  # pragma: no cover - a broken install
        pass
    return tuple(dict.fromkeys(roots))


def parse_spec(text: str, file: str = "<spec>", *, base_dir: Path | str | None = None,
               include_dirs: tuple[Path | str, ...] | list = (), _key: str | None = None) -> Spec:
    """Parse spec text.  ``file`` names the source in error messages.

    ``base_dir``: the folder of the spec file (relative includes resolve there and may read
    anywhere below it); None for spec text with no file.  ``include_dirs``: further folders
    includes may read.  Raises one SpecError carrying every error found.
    """
    dirs = tuple(Path(d) for d in include_dirs)
    ctx = _Ctx(_default_roots(Path(base_dir) if base_dir is not None else None, dirs), dirs)
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"spec text is too large ({len(text):,} characters; at most {MAX_SPEC_BYTES:,})",
                        Span(file, 1, 1, 2, ""), hint="a spec is a few lines; split it with include")
    ctx.bytes = len(text)
    spec = _parse(text, file, ctx, Path(base_dir) if base_dir is not None else None,
                  (_key,) if _key else (), depth=0)
    if ctx.errors:
        err = SpecError.combine(ctx.errors, ctx.more)
        err.partial = spec
        raise err
    return spec


def _parse(text: str, file: str, ctx: _Ctx, base_dir: Path | None, chain: tuple[str, ...], depth: int,
           echo: bool = True) -> Spec:
    parser = _parser()
    if not text.endswith("\n"):
        text = text + "\n"
    lines = text.split("\n")
    items: list = []

    def build(tree, offset: int) -> None:
        b = _Build(file, lines if echo else [""] * len(lines), offset)
        for stmt in tree.children:
            try:
                item = b.transform(stmt)
            except VisitError as e:
                if not isinstance(e.orig_exc, SpecError):
                    raise
                item, err = None, e.orig_exc
            except SpecError as e:
                item, err = None, e
            else:
                err = None
            for e in b.errors:
                ctx.add(e)
            b.errors.clear()
            if err is not None:
                ctx.add(err)
            if item is not None:
                items.append(item)

    try:
        tree = parser.parse(text)
    except UnexpectedInput:
        tree = None
    if tree is not None:
        build(tree, 0)
    else:
        # Parse statement by statement so that every statement's errors are found.
        for first, last in _statements(lines):
            chunk = lines[first:last + 1]
            try:
                sub = parser.parse("\n".join(chunk) + "\n")
            except UnexpectedInput as e:
                ctx.add(_syntax_error(e, chunk, file, parser, first, echo))
                continue
            build(sub, first)
    dtypes: tuple[str, ...] = ()
    dtype_span = None
    attention: AttentionDirective | None = None
    rules: list[Rule] = []
    defaults: list[DefaultDirective] = []
    includes: list[str] = []
    for item in items:
        if ctx.stop:
            break
        kind = item[0]
        if kind == "dtype":
            if dtype_span is not None:
                ctx.add(SpecError("'dtype' given twice", item[2], notes=[("first given here", dtype_span)],
                                  hint="list every dtype in one directive: dtype bf16, fp32"))
                continue
            dtypes, dtype_span = item[1], item[2]
        elif kind == "include":
            sub = _include(item[1], item[2], ctx, base_dir, chain, depth)
            if sub is None:
                continue
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
            ctx.rules += 1
            if ctx.rules > MAX_RULES:
                ctx.add(SpecError(f"too many rules: at most {MAX_RULES} after expanding includes", item[1].span,
                                  hint="a spec needs a rule per kind of module, not per module: use globs"))
                ctx.stop = True
                break
            rules.append(item[1])
    if depth == 0:
        rules = [replace(r, index=i) for i, r in enumerate(rules)]
    return Spec(file, dtypes, tuple(rules), tuple(defaults), dtype_span, tuple(includes), attention)


def _include(name: str, span: Span, ctx: _Ctx, base_dir: Path | None, chain: tuple[str, ...],
             depth: int) -> Spec | None:
    if depth + 1 > MAX_INCLUDE_DEPTH:
        ctx.add(SpecError(f"includes nest too deep (at most {MAX_INCLUDE_DEPTH} levels)", span,
                          hint="include the files from one top-level spec instead of chaining them"))
        ctx.stop = True
        return None
    ctx.includes += 1
    if ctx.includes > MAX_INCLUDES:
        ctx.add(SpecError(f"too many includes (at most {MAX_INCLUDES} in all, counting repeats)", span))
        ctx.stop = True
        return None
    try:
        target = _resolve_include(name, span, ctx, base_dir)
        key = str(target)
        if key in chain:
            names = [Path(c).name for c in chain[chain.index(key):]] + [target.name]
            raise SpecError(f"include cycle: {' -> '.join(names)}", span,
                            hint="a spec cannot include itself, directly or through other files")
        text = _read_spec_text(target, span, ctx)
    except SpecError as e:
        ctx.add(e)
        return None
    sub = _parse(text, _display_name(target, str(target)), ctx, target.parent, chain + (key,), depth + 1)
    return replace(sub, includes=(key,) + sub.includes)


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _resolve_include(name: str, span: Span, ctx: _Ctx, base_dir: Path | None) -> Path:
    if not name or "\x00" in name:
        raise SpecError("empty include name" if not name else "include name holds a NUL character", span)
    p = Path(name)
    names = [p] if p.suffix == ".kpatch" else [p.with_name(p.name + ".kpatch")] if p.name else []
    if not names:
        raise SpecError(f"include {name!r} does not name a file", span)
    if p.suffix and p.suffix != ".kpatch":
        raise SpecError(f"included file {name!r} is not a spec: only *.kpatch files can be included", span,
                        hint="spec files are named NAME.kpatch")
    cands: list[Path] = []
    for q in names:
        if q.is_absolute():
            cands.append(q)
        else:
            if base_dir is not None:
                cands.append(base_dir / q)
            cands.extend(d / q for d in ctx.include_dirs)
            if len(q.parts) == 1:
                cands.append(specs_dir() / q)
    outside = []
    for c in cands:
        real = Path(os.path.realpath(os.path.abspath(c)))
        if not _under(real, ctx.roots):
            outside.append(real)
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"included {name!r} is not a regular file", span)
        return real
    allowed = ", ".join(str(r) for r in ctx.roots)
    if outside:
        raise SpecError(f"included file {name!r} is outside the folders includes may read", span,
                        hint=f"includes may read under: {allowed}; allow another folder with "
                             f"include_dirs=[...] (Python) or --include-dir (CLI)")
    raise SpecError(f"included file {name!r} not found", span,
                    hint=f"looked in {', '.join(dict.fromkeys(str(c.parent) for c in cands))}" if cands else None)


def _read_spec_text(path: Path, span: Span | None, ctx: _Ctx | None = None, shown: str | None = None) -> str:
    """The text of a spec file; refuses (without showing any of its content) what is not one.

    ``span``: the include directive (None for a top-level file: errors then point into the file
    itself, line and column only).
    """
    shown = shown or str(path)

    def at(offset_line: int = 1, col: int = 1) -> Span:
        return span if span is not None else Span(shown, offset_line, col, col + 1, "")

    if path.suffix != ".kpatch":
        raise SpecError(f"'{shown}' is not a spec file: spec files are named NAME.kpatch", span)
    try:
        data = files.read_bytes(path, "spec", limit=MAX_SPEC_BYTES, what="spec")
    except files.FileReadError as e:
        if e.reason == "too-large":
            raise SpecError(f"'{shown}' is too large for a spec (over {MAX_SPEC_BYTES:,} bytes)", at(),
                            hint="a spec is a few lines: use globs rather than one rule per module") from None
        if e.reason == "not-regular":
            raise SpecError(f"'{shown}' is not a regular file ({str(e).rpartition(': ')[2]})", span) from None
        raise SpecError(str(e), span) from None
    if ctx is not None:
        ctx.bytes += len(data)
        if ctx.bytes > MAX_TOTAL_BYTES:
            raise SpecError(f"the spec and its includes are too large (over {MAX_TOTAL_BYTES:,} bytes in all)",
                            at())

    def where(offset: int) -> tuple[int, int]:
        head = data[:offset]
        return head.count(b"\n") + 1, offset - (head.rfind(b"\n") + 1) + 1

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        ln, col = where(e.start)
        raise SpecError(f"'{shown}' is not a spec: it is not UTF-8 text (line {ln}, column {col})",
                        at(ln, col)) from None
    bad = next((i for i, c in enumerate(text) if ord(c) < 32 and c not in "\t\n\r\f"), None)
    if bad is not None:
        ln, col = where(len(text[:bad].encode("utf-8")))
        raise SpecError(f"'{shown}' is not a spec: it holds control characters, first at line {ln}, "
                        f"column {col} (a binary file?)", at(ln, col))
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def _display_name(path: Path, default: str) -> str:
    """``specs/NAME.kpatch`` for a shipped spec, else ``default``."""
    try:
        sd = Path(os.path.realpath(specs_dir()))
        real = Path(os.path.realpath(path))
    except (FileNotFoundError, OSError):  # pragma: no cover
        return default
    if real.parent == sd:
        return f"specs/{real.name}"
    return default


def shipped_names() -> list[str]:
    try:
        return sorted(p.stem for p in specs_dir().glob("*.kpatch"))
    except FileNotFoundError:  # pragma: no cover
        return []


def find_spec_file(name: str | Path) -> Path | None:
    """``name`` itself if it is a file, else the shipped spec it names (``qwen3``, ``qwen3.kpatch``,
    ``specs/qwen3.kpatch``)."""
    text = str(name)
    if "\n" in text or "\x00" in text or len(text) > 1024:
        return None
    p = Path(text)
    try:
        if p.is_file():
            return p
        parts = Path(text).parts
        if len(parts) == 1 or (len(parts) == 2 and parts[0] == "specs"):
            stem = p.name[:-len(".kpatch")] if p.name.endswith(".kpatch") else p.name
            shipped = specs_dir() / (stem + ".kpatch")
            if stem and shipped.is_file():
                return shipped
    except OSError:          # not a usable path
        return None
    return None


def spec_not_found(name: str) -> SpecError:
    names = shipped_names()
    stem = Path(name).name
    stem = stem[:-len(".kpatch")] if stem.endswith(".kpatch") else stem
    dm = did_you_mean(stem, names)
    listing = f"shipped specs: {', '.join(names)}" if names else None
    hint = " ".join(x for x in (dm, listing) if x) or None
    return SpecError(f"spec '{_clip(name, 200)}' not found: no such file and no shipped spec of that name", hint=hint)


def read_spec(name: str | Path, *, include_dirs: tuple[Path | str, ...] | list = ()) -> Spec:
    """Parse the spec file ``name`` (a path or a shipped spec's name); SpecError if missing or bad."""
    p = find_spec_file(name)
    if p is None:
        if files.is_dir(str(name)):
            raise SpecError(f"'{files.show(name)}' is a folder, not a spec file")
        if files.exists(str(name)):
            raise SpecError(f"'{files.show(name)}' is not a regular file (a FIFO, a device or a socket)")
        raise spec_not_found(str(name))
    shown = _display_name(p, str(p))
    text = _read_spec_text(p, None, shown=shown)
    real = os.path.realpath(p)
    return parse_spec(text, shown, base_dir=Path(real).parent, include_dirs=include_dirs, _key=real)


_NAME_LIKE = re.compile(r"[^\s:]+")


def load_spec(path_or_text: str | Path, *, include_dirs: tuple[Path | str, ...] | list = ()) -> Spec:
    """Load a spec from a file path, a shipped spec name (``"qwen3"``), or spec text.

    A ``Path``, a string ending in ``.kpatch``, or a single word with no spec syntax (no spaces,
    no ``:``) must name a file or a shipped spec (else a SpecError lists the shipped names);
    anything else is spec text.  ``include_dirs``: folders includes may read besides the spec's own.
    """
    text = str(path_or_text)
    if (isinstance(path_or_text, Path) or (text.strip().endswith(".kpatch") and "\n" not in text)
            or _NAME_LIKE.fullmatch(text)):
        return read_spec(text.strip() if not isinstance(path_or_text, Path) else path_or_text,
                         include_dirs=include_dirs)
    return parse_spec(text, "<string>", include_dirs=include_dirs)
