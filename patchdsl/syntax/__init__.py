"""Syntax layer: spec text -> frozen syntax tree.  Imports neither torch nor triton."""

from .ast import ClassPattern, DefaultDirective, Flag, OpCall, Rule, Selector, Span, Spec
from .errors import SpecError
from .parser import load_spec, parse_spec, read_spec

__all__ = [
    "ClassPattern", "DefaultDirective", "Flag", "OpCall", "Rule", "Selector", "Span", "Spec",
    "SpecError", "load_spec", "parse_spec", "read_spec",
]
