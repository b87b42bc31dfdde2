"""Structural kinds: recognise a module by what it computes, not by what its class is called.

Each recogniser takes a live module (possibly on the meta device) and returns the facts the
ops need (sizes, eps, offset, casting mode, activation, ...) or None if the module does not fit.
Where behaviour cannot be read off attributes (Gemma's ``(1 + w)``, the cast order, which GELU)
the recogniser *probes*: it runs the module's own class ``forward`` on a tiny CPU stand-in with
known weights and compares the output bit for bit with each candidate formula.

One module per family of kinds registers its recognisers with ``@kind`` (:mod:`.registry`) when
this package is imported: :mod:`.norms`, :mod:`.mlp`, :mod:`.layers`, :mod:`.experts`, :mod:`.moe`
(in this order: the order of ``KINDS`` and of each module's facts in the index).  Shared probing
helpers are in :mod:`.probe`; what each kind needs, for the errors, in :mod:`.misses`.
"""

from __future__ import annotations

from . import norms, mlp, layers, experts, moe  # noqa: F401,I001  (each registers its kinds, in this order)
from .registry import KIND_DOCS, KINDS, kind

# every kind name, in registration order (a spec's pattern is a kind name when it is one of these)
KIND_NAMES = tuple(KINDS)

__all__ = ["KINDS", "KIND_DOCS", "KIND_NAMES", "kind"]
