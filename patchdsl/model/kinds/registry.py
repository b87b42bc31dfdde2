"""The kind registry: structural-kind recognisers by kind name, filled by :func:`kind` (the family
modules of this package register theirs when :mod:`patchdsl.model.kinds` is imported)."""

from __future__ import annotations

from typing import Any

KINDS: dict[str, Any] = {}
KIND_DOCS: dict[str, str] = {}


def kind(name: str, doc: str = ""):
    """Register a structural-kind recogniser: ``fn(module) -> facts dict | None``."""

    def deco(fn):
        KINDS[name] = fn
        KIND_DOCS[name] = doc or (fn.__doc__ or "").strip().splitlines()[0]
        return fn

    return deco

