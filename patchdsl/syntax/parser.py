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

import os
import re
from dataclasses import replace
from pathlib import Path

from lark.exceptions import UnexpectedInput, VisitError

from ..util import files
from .ast import AttentionDirective, DefaultDirective, Rule, Span, Spec
from .errors import SpecError
from .grammar import lark_parser, syntax_error
from .includes import (MAX_INCLUDE_DEPTH, MAX_INCLUDES, MAX_SPEC_BYTES, LoadContext, default_roots, display_name,
                       find_spec_file, read_spec_text, resolve_include, spec_not_found)
from .transform import SpecBuilder

MAX_RULES = 500                     # rules after expanding includes


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


def parse_spec(text: str, file: str = "<spec>", *, base_dir: Path | str | None = None,
               include_dirs: tuple[Path | str, ...] | list = (), _key: str | None = None) -> Spec:
    """Parse spec text.  ``file`` names the source in error messages.

    ``base_dir``: the folder of the spec file (relative includes resolve there and may read
    anywhere below it); None for spec text with no file.  ``include_dirs``: further folders
    includes may read.  Raises one SpecError carrying every error found.
    """
    dirs = tuple(Path(d) for d in include_dirs)
    ctx = LoadContext(default_roots(Path(base_dir) if base_dir is not None else None, dirs), dirs)
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


def _parse(text: str, file: str, ctx: LoadContext, base_dir: Path | None, chain: tuple[str, ...], depth: int,
           echo: bool = True) -> Spec:
    parser = lark_parser()
    if not text.endswith("\n"):
        text = text + "\n"
    lines = text.split("\n")
    items: list = []

    def build(tree, offset: int) -> None:
        b = SpecBuilder(file, lines if echo else [""] * len(lines), offset)
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
                ctx.add(syntax_error(e, chunk, file, parser, first, echo))
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


def _include(name: str, span: Span, ctx: LoadContext, base_dir: Path | None, chain: tuple[str, ...],
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
        target = resolve_include(name, span, ctx, base_dir)
        key = str(target)
        if key in chain:
            names = [Path(c).name for c in chain[chain.index(key):]] + [target.name]
            raise SpecError(f"include cycle: {' -> '.join(names)}", span,
                            hint="a spec cannot include itself, directly or through other files")
        text = read_spec_text(target, span, ctx)
    except SpecError as e:
        ctx.add(e)
        return None
    sub = _parse(text, display_name(target, str(target)), ctx, target.parent, chain + (key,), depth + 1)
    return replace(sub, includes=(key,) + sub.includes)


def read_spec(name: str | Path, *, include_dirs: tuple[Path | str, ...] | list = ()) -> Spec:
    """Parse the spec file ``name`` (a path or a shipped spec's name); SpecError if missing or bad."""
    p = find_spec_file(name)
    if p is None:
        if files.is_dir(str(name)):
            raise SpecError(f"'{files.show(name)}' is a folder, not a spec file")
        if files.exists(str(name)):
            raise SpecError(f"'{files.show(name)}' is not a regular file (a FIFO, a device or a socket)")
        raise spec_not_found(str(name))
    shown = display_name(p, str(p))
    text = read_spec_text(p, None, shown=shown)
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
