"""Spec errors for people: ``file:line:col``, the source line, a caret, what was expected."""

from __future__ import annotations

import difflib
from typing import Iterable

from .ast import Span


MAX_ERRORS = 20   # errors reported for one spec; the rest are counted
SHOWN_COLUMNS = 120   # a longer source line is shown as a window around the caret


class SpecError(Exception):
    """An error in a spec (or in resolving it against a model) that points at source text.

    ``notes`` are extra located lines (e.g. the other rule in a conflict).

    One SpecError can carry several errors of the same spec: ``errors`` is the tuple of the
    single errors (just ``(self,)`` for a single one), ``message``/``span``/``hint`` are those
    of the first, and ``render()`` shows every one (at most ``MAX_ERRORS``, then a count).
    Build one with :meth:`SpecError.combine`.
    """

    exit_code = 2

    def __init__(self, message: str, span: Span | None = None, *, hint: str | None = None,
                 notes: Iterable[tuple[str, Span]] = ()):
        self.message = message
        self.span = span
        self.hint = hint
        self.notes = tuple(notes)
        self.errors: tuple[SpecError, ...] = (self,)
        self.more = 0          # errors found beyond the ones kept
        self.partial = None    # the Spec parsed so far, when parsing failed part-way (see check.check_loaded)
        super().__init__(self.render())

    @classmethod
    def combine(cls, errors: Iterable["SpecError"], more: int = 0) -> "SpecError":
        """One SpecError carrying ``errors`` (flattened, first MAX_ERRORS kept, sorted by nothing:
        they stay in the order found, which is file order)."""
        flat: list[SpecError] = []
        extra = more
        for e in errors:
            extra += e.more
            flat.extend(e.errors)
        if not flat:
            raise ValueError("SpecError.combine needs at least one error")
        extra += max(0, len(flat) - MAX_ERRORS)
        flat = flat[:MAX_ERRORS]
        if len(flat) == 1 and not extra:
            return flat[0]
        first = flat[0]
        e = cls.__new__(cls)
        e.message, e.span, e.hint, e.notes = first.message, first.span, first.hint, first.notes
        e.errors = tuple(flat)
        e.more = extra
        e.partial = None
        Exception.__init__(e, e.render())
        return e

    @property
    def count(self) -> int:
        """How many errors were found (including those not kept)."""
        return len(self.errors) + self.more

    def render(self) -> str:
        if len(self.errors) > 1 or self.more:
            blocks = [e.render_one() for e in self.errors]
            n = len(self.errors) + self.more
            tail = f"{n} errors"
            if self.more:
                tail += f" (the first {len(self.errors)} shown)"
            return "\n".join(blocks) + "\n" + tail
        return self.render_one()

    def render_one(self) -> str:
        lines = []
        if self.span is not None:
            lines.append(f"{self.span}: error: {self.message}")
            lines.extend(_caret_block(self.span))
        else:
            lines.append(f"error: {self.message}")
        for text, span in self.notes:
            lines.append(f"{span}: note: {text}")
            lines.extend(_caret_block(span))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def _caret_block(span: Span) -> list[str]:
    src = span.source_line.rstrip("\n")
    if not src:
        return []
    width = max(1, (span.end_col or span.col + 1) - span.col)
    col = span.col
    if len(src) > SHOWN_COLUMNS:                   # show a window around the caret
        start = max(0, col - 1 - SHOWN_COLUMNS // 3)
        end = start + SHOWN_COLUMNS
        lead = "..." if start > 0 else ""
        src = lead + src[start:end] + ("..." if end < len(src) else "")
        col = col - start + len(lead)
        width = min(width, SHOWN_COLUMNS - (col - 1 - len(lead)))
    gutter = f"{span.line} | "
    pad = " " * (len(gutter) + col - 1)
    return [f"  {gutter}{src}", f"  {pad}^{'~' * (max(1, width) - 1)}"]


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    cands = list(candidates)
    close = difflib.get_close_matches(word, cands, n=1, cutoff=0.6)
    if not close:
        lower = {c.lower(): c for c in cands}
        close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
        close = [lower[c] for c in close]
    return f"did you mean '{close[0]}'?" if close else None


def clip(t: str, n: int = 24) -> str:
    return t if len(t) <= n else t[:n] + f"... ({len(t)} characters)"
