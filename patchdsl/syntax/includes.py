"""Where spec files come from: the include policy (which folders an include may read, cycles, depth and
size limits), reading a spec file as untrusted text, and the shipped specs by name."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..util import files
from ..util.resources import specs_dir
from .ast import Span
from .errors import MAX_ERRORS, SpecError, clip, did_you_mean

MAX_SPEC_BYTES = 64 * 1024          # one spec file
MAX_TOTAL_BYTES = 256 * 1024        # a spec and everything it includes
MAX_INCLUDE_DEPTH = 16
MAX_INCLUDES = 64                   # include directives expanded in all


@dataclass
class LoadContext:
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


def default_roots(base_dir: Path | None, include_dirs: tuple[Path, ...]) -> tuple[Path, ...]:
    roots = [Path(os.path.realpath(d)) for d in include_dirs]
    if base_dir is not None:
        roots.insert(0, Path(os.path.realpath(base_dir)))
    try:
        roots.append(Path(os.path.realpath(specs_dir())))
    except FileNotFoundError:  # pragma: no cover - a broken install
        pass
    return tuple(dict.fromkeys(roots))


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def resolve_include(name: str, span: Span, ctx: LoadContext, base_dir: Path | None) -> Path:
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


def read_spec_text(path: Path, span: Span | None, ctx: LoadContext | None = None, shown: str | None = None) -> str:
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


def display_name(path: Path, default: str) -> str:
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
    return SpecError(f"spec '{clip(name, 200)}' not found: no such file and no shipped spec of that name", hint=hint)
