"""Ops: one module per fused op, all listed in the registry."""

from .base import FlagSpec, FlagTypeError, ModuleInfo, Op
from .registry import get_op, kind, kinds, ops, register

__all__ = ["FlagSpec", "FlagTypeError", "ModuleInfo", "Op", "get_op", "kind", "kinds", "ops", "register"]
