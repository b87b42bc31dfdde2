"""The one op registry.

Adding an op = one template in ``templates/``, one module in ``patchdsl/ops/`` that calls
:func:`register`, and its tests.  (Structural kinds have their own registry:
:mod:`patchdsl.model.kinds`.)
"""

from __future__ import annotations

import importlib

from .base import Op

_OPS: dict[str, Op] = {}

# Op modules, imported on first registry access.  Order is the documentation order.
OP_MODULES = (
    "rmsnorm", "add_rmsnorm", "rmsnorm_gated", "layernorm", "swiglu", "geglu", "mlp", "experts", "router", "rope", "qk_norm_rope",
    "cross_entropy", "linear_cross_entropy", "linear_logprobs", "linear_jsd", "fp8_linear",
    "hub", "liger",      # external ops (patchdsl/ops/external.py)
)

_loaded = False


def register(op: Op) -> Op:
    if op.name in _OPS:
        raise ValueError(f"op {op.name!r} registered twice")
    _OPS[op.name] = op
    return op


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for m in OP_MODULES:
        importlib.import_module(f"patchdsl.ops.{m}")


def _module_rank(op: Op) -> int:
    m = type(op).__module__.rsplit(".", 1)[-1]
    return OP_MODULES.index(m) if m in OP_MODULES else len(OP_MODULES)


def ops() -> dict[str, Op]:
    """Every op, in OP_MODULES order (whatever order their modules happened to be imported in)."""
    _load()
    return dict(sorted(_OPS.items(), key=lambda kv: _module_rank(kv[1])))


def get_op(name: str) -> Op | None:
    _load()
    return _OPS.get(name)
