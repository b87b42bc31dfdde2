"""Runtime support of generated kernel modules: their ``torch.library`` custom ops.

Every generated module has two ways into the same ``*_forward`` / ``*_backward`` host functions:

* eager: a lean ``torch.autograd.Function`` (a few microseconds of host time per call);
* ``torch.compile`` / ``torch.export``: ``torch.library`` custom ops with a fake (meta)
  implementation and a registered autograd formula, so Dynamo puts one opaque node in the graph
  instead of tracing into Triton launches, ``data_ptr`` checks and Python-side caches.

The public entry of a module (``rmsnorm(x, w)``, ``glu(...)`` ...) picks the custom op when
:func:`compiling` is true and the autograd.Function otherwise: dispatching a custom op costs tens
of microseconds of host time in eager mode (issue 15 wants <= 30 us per norm/GLU/RoPE forward),
and inside a compiled graph the dispatch cost is gone anyway.

Templates declare their ops with the ``custom_op`` macro of ``templates/_common.j2``, which calls
:func:`custom_op` below; op names are ``patchdsl::<kernel name>_<hash>_<suffix>``, the hash
covering the template text and the specialisation parameters (``render.op_prefix``), so two
kernels that differ only in, say, eps never share an op, and importing a generated module again
(a second model, ``importlib.reload``, the flat ``codegen --out`` copy) finds the op it registered
the first time instead of failing on a duplicate registration.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

NAMESPACE = "patchdsl"

_lock = threading.Lock()
# qualified name -> CustomOpDef.  Strong references on purpose: torch keeps only weak ones
# (torch._library.custom_ops.OPDEFS), and a collected CustomOpDef unregisters its op.
_DEFS: dict[str, Any] = {}
_DIFFERENTIABLE: set[str] = set()


_forced = False


def compiling() -> bool:
    """True while Dynamo traces (torch.compile, torch.export), or inside :func:`use_custom_ops`:
    the entry points then call the custom ops instead of the autograd.Functions."""
    return _forced or torch.compiler.is_compiling()


@contextmanager
def use_custom_ops() -> Iterator[None]:
    """Route eager calls through the custom ops too (tests, tracing with make_fx).  Not thread-local."""
    global _forced
    prev, _forced = _forced, True
    try:
        yield
    finally:
        _forced = prev


def custom_op(name: str, impl: Callable, *, fake: Callable, mutates_args: Iterable[str] = (),
              setup_context: Callable | None = None, backward: Callable | None = None) -> Any:
    """Register ``patchdsl::<name>`` (once per process) and return its ``OpOverload``.

    ``impl`` is the real implementation; its type annotations give the schema.  ``fake``
    returns outputs with the real outputs' shapes, dtypes, strides and devices without running
    anything.  ``setup_context`` / ``backward`` register the autograd formula (omit both for an
    op that only runs inside another op's backward).  Every input ``impl`` writes must be named
    in ``mutates_args``; outputs must be new tensors, never inputs or views of inputs.

    Idempotent: a name already registered returns the existing op (the name's hash covers the
    template text and parameters, so an equal name means equal code).
    """
    if (setup_context is None) != (backward is None):
        raise ValueError("custom_op: give both setup_context and backward, or neither")
    qualname = f"{NAMESPACE}::{name}"
    with _lock:
        d = _DEFS.get(qualname)
        if d is None:
            d = torch.library.custom_op(qualname, impl, mutates_args=tuple(mutates_args))
            d.register_fake(fake)
            if backward is not None:
                d.register_autograd(backward, setup_context=setup_context)
                _DIFFERENTIABLE.add(qualname)
            _DEFS[qualname] = d
    return d._opoverload


def registered() -> dict[str, Any]:
    """Every op registered so far: qualified name -> ``CustomOpDef`` (for tests and ``opcheck``)."""
    with _lock:
        return dict(_DEFS)


def differentiable(qualname: str) -> bool:
    """Whether the op has an autograd formula (backward ops have none: they run in a backward,
    where grad mode is off; double backward through them raises)."""
    return qualname in _DIFFERENTIABLE


def op_def(op: Any) -> Any:
    """The ``CustomOpDef`` of an ``OpOverload`` returned by :func:`custom_op`."""
    name = op._schema.name if hasattr(op, "_schema") else str(op)
    return _DEFS[name]


def empty(t: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output it was asked not to compute (schemas have no
    optional outputs): an empty tensor of ``t``'s dtype on its device."""
    return t.new_empty((0,))
