"""Spec errors for people: ``file:line:col``, the source line, a caret, what was expected."""

from __future__ import annotations

import difflib
from typing import Iterable

from .ast import Span


class SpecError(Exception):
    """An error in a spec (or in resolving it against a model) that points at source text.

    ``notes`` are extra located lines (e.g. the other rule in a conflict).
    """

    exit_code = 2

    def __init__(self, message: str, span: Span | None = None, *, hint: str | None = None,
                 notes: Iterable[tuple[str, Span]] = ()):
        self.message = message
        self.span = span
        self.hint = hint
        self.notes = tuple(notes)
        super().__init__(self.render())

    def render(self) -> str:
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
    gutter = f"{span.line} | "
    pad = " " * (len(gutter) + span.col - 1)
    return [f"  {gutter}{src}", f"  {pad}^{'~' * (width - 1)}"]


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    cands = list(candidates)
    close = difflib.get_close_matches(word, cands, n=1, cutoff=0.6)
    if not close:
        lower = {c.lower(): c for c in cands}
        close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
        close = [lower[c] for c in close]
    return f"did you mean '{close[0]}'?" if close else None
