"""Ops: one module per fused op, all listed in the registry."""

from .base import FlagSpec, FlagTypeError, Op
from .registry import get_op, ops, register

__all__ = ["FlagSpec", "FlagTypeError", "Op", "get_op", "ops", "register"]
