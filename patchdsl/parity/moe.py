"""Mixture-of-experts models in verify: keep the float64 reference off ``grouped_mm``.

transformers 5.x experts modules (``@use_experts_implementation``) dispatch their forward through
the process-wide ``ALL_EXPERTS_FUNCTIONS`` by ``config._experts_implementation``; the default,
``grouped_mm``, refuses float64 ("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got
Double").  :func:`eager_experts` binds, on each experts *instance* of the given model only, the
class's own undecorated forward (the eager loop over experts, which is plain PyTorch and runs in
float64).  Nothing process-wide changes: the config and the registry stay as they are, the other
copies of the model keep their implementation, and the returned handle undoes the binding.

The routing is held fixed in the per-site checks by construction: each experts site is re-run on
the ``(hidden, top_k_index, top_k_weights)`` captured once (:mod:`.hooks`), so the three copies
see the same expert choice and near-ties cannot flip it between them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def dispatching_experts(m: Any) -> Callable | None:
    """The undecorated class forward of ``m`` when ``m`` is an experts module whose forward is
    chosen by ``config._experts_implementation`` (transformers' ``use_experts_implementation``),
    else None."""
    fwd = getattr(type(m), "forward", None)
    inner = getattr(fwd, "__wrapped__", None)
    code = getattr(fwd, "__code__", None)
    # the decorator's forward reads self.config._experts_implementation (every transformers 5.x
    # version: 5.17's decorator sets fewer attributes on the instance than 5.24's, so test the code)
    if inner is None or code is None or "_experts_implementation" not in code.co_names:
        return None
    return inner


class EagerExperts:
    """What :func:`eager_experts` changed; ``undo()`` restores it."""

    def __init__(self) -> None:
        self.done: list[tuple[Any, bool, Any]] = []   # (module, had an instance forward, its value)

    def undo(self) -> None:
        for m, had, old in reversed(self.done):
            if had:
                m.__dict__["forward"] = old
            else:
                m.__dict__.pop("forward", None)
        self.done.clear()

    def __len__(self) -> int:
        return len(self.done)


def eager_experts(model: Any) -> EagerExperts:
    """Bind the eager experts forward on every dispatching experts instance of ``model`` that has
    no instance forward of its own (a patched site keeps its patch).  Per instance, reversible."""
    h = EagerExperts()
    for m in model.modules():
        inner = dispatching_experts(m)
        if inner is None or "forward" in m.__dict__:
            continue
        h.done.append((m, False, None))
        m.__dict__["forward"] = _EagerForward(inner, m)
    return h


class _EagerForward:
    """``inner`` bound to a module through a weak reference: a bound method stored on the module
    itself would make a reference cycle, and a float64 copy freed with ``del`` (the streamed
    reference frees one decoder layer after another) would then wait for the garbage collector.
    A deep copy of the module rebinds to the copy."""

    __slots__ = ("fn", "ref")

    def __init__(self, fn: Callable, m: Any) -> None:
        self.fn, self.ref = fn, weakref.ref(m)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.ref(), *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "_EagerForward":
        import copy

        return _EagerForward(self.fn, copy.deepcopy(self.ref(), memo))


def is_routed_call(captured: Any) -> bool:
    """True when a captured call looks like an experts call: ``(hidden, top_k_index, top_k_weights)``
    with an integer index and floating weights of the same shape."""
    import torch

    args = getattr(captured, "args", ())
    return (len(args) >= 3 and all(isinstance(a, torch.Tensor) for a in args[:3])
            and args[0].is_floating_point() and not args[1].is_floating_point()
            and args[2].is_floating_point() and args[1].shape == args[2].shape)


def routing_grads(model: Any, site_path: str, captured: Any, dtype: Any, device: Any,
                  upstream: Callable[[Any], Any], context: Any = None) -> dict[str, Any]:
    """For an experts site: the gradient of its output w.r.t. the routing weights it was given
    (``grad_top_k_weights``: what trains the router), with the same routing (the captured
    ``top_k_index``) in every copy.  ``{}`` for any other site."""
    import contextlib

    import torch

    from .hooks import cast_to

    if not is_routed_call(captured):
        return {}
    m = model.get_submodule(site_path) if site_path else model
    args = list(cast_to(captured.args, dtype, device))
    kwargs = cast_to(captured.kwargs, dtype, device)
    args[0] = args[0].requires_grad_(True)
    w = args[2].requires_grad_(True)
    with torch.enable_grad(), (context or contextlib.nullcontext()):
        out = m(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return {"grad_top_k_weights": None}
    (g,) = torch.autograd.grad(out, [w], upstream(out), allow_unused=True)
    return {"grad_top_k_weights": g}
