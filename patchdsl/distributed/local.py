"""What a layout needs around an op's forward: local tensors in, the input's placements out, and the
gradient all-reduces of weights that each rank uses on its own part of the data.

Added at apply time, only to sites whose parameters are DTensors (:func:`wrap_installs`); a site
without them keeps the op's forward as it is.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterable


def _grad_all_reduce():
    import torch

    class AllReduceGrad(torch.autograd.Function):
        """Identity forward; backward sums the gradient over ``group`` (a weight every rank uses on its own
        heads / its own sequence positions: each rank's gradient is a partial sum)."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            import torch.distributed as dist

            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    return AllReduceGrad


_AR = None


def all_reduce_grad(x: Any, group: Any) -> Any:
    global _AR
    if _AR is None:
        _AR = _grad_all_reduce()
    return _AR.apply(x, group)


def _is_dtensor(t: Any) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


@contextlib.contextmanager
def local_params(targets: Iterable[tuple[Any, str]], group: Any):
    """For the call: each ``(module, name)`` parameter as a local tensor (a DTensor's ``to_local()``),
    its gradient summed over ``group`` when ``group`` is given; the parameters put back after."""
    swapped = []
    try:
        for m, name in targets:
            p = m._parameters.get(name)
            if p is None:
                continue
            local = p.to_local() if _is_dtensor(p) else p
            if group is not None and local.requires_grad:
                local = all_reduce_grad(local, group)
            m._parameters[name] = local
            swapped.append((m, name, p))
        yield
    finally:
        for m, name, p in reversed(swapped):
            m._parameters[name] = p


def _replicated(fn: Callable) -> Callable:
    """A norm-like forward on Replicate parameters: the kernel sees the local input and local weights, the
    output gets the input's placements (Shard(1) under sequence parallelism); never a full_tensor()."""
    def forward(self, x, *args, **kwargs):
        if not _is_dtensor(x):
            with local_params([(self, n) for n in list(self._parameters)], None):
                return fn(self, x, *args, **kwargs)
        from torch.distributed.tensor import DTensor

        mesh, placements = x.device_mesh, x.placements
        sharded = any(type(p).__name__ in ("Shard", "_StridedShard") for p in placements)
        group = mesh.get_group() if sharded else None
        with local_params([(self, n) for n in list(self._parameters)], group):
            y = fn(self, x.to_local(), *args, **kwargs)
        return DTensor.from_local(y, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())

    return forward


def _heads(fn: Callable, covers: tuple[str, ...]) -> Callable:
    """An attention forward on local heads that reads the weights of ``covers`` (q_norm, k_norm) itself:
    each rank uses them on its own heads, so their gradients are summed over the tensor-parallel group
    (what transformers' replicated_with_grad_allreduce does around the norms' own forwards)."""
    def forward(self, *args, **kwargs):
        group = self.q_proj.weight.device_mesh.get_group()
        targets = [(getattr(self, c), n) for c in covers for n in list(getattr(self, c)._parameters)]
        with local_params(targets, group):
            return fn(self, *args, **kwargs)

    return forward


def covered_hooks(module: Any, covers: tuple[str, ...]) -> str | None:
    """Why the covered weights cannot get their gradients reduced here: a gradient hook already on one
    (transformers' replicated_with_grad_allreduce hooks a norm's weight at its first forward) would sum
    them a second time."""
    for c in covers:
        child = getattr(module, c, None)
        for n, p in getattr(child, "_parameters", {}).items():
            if p is not None and getattr(p, "_post_accumulate_grad_hooks", None):
                return (f"{c}.{n} already has a gradient hook (transformers' replicated_with_grad_allreduce adds one "
                        "at the norm's first forward): apply patchdsl before running the parallelised model")
    return None


def ep_implementations(host: Any) -> tuple[list[Any], str | None]:
    """The objects through which transformers' expert-parallel dispatch calls the experts (their
    ``experts_forward``): the EP implementation the instance-level forward closes over and the ones it
    delegates to; or why there are none."""
    fwd = host.__dict__.get("forward")
    if fwd is None:
        return [], ("its experts are sharded over the ranks but nothing dispatches tokens to them (transformers' "
                    "expert parallelism replaces the module's forward with its dispatch: apply patchdsl after it)")
    cells = dict(zip(getattr(getattr(fwd, "__code__", None), "co_freevars", ()),
                     (c.cell_contents for c in (getattr(fwd, "__closure__", None) or ()))))
    impl = cells.get("implementation")
    if impl is None or "experts_forward" not in vars(impl):
        name = getattr(fwd, "__qualname__", type(fwd).__name__)
        return [], (f"its forward was replaced on the instance by {name}, not transformers' expert-parallel "
                    "dispatch (an EPImplementation calling experts_forward)")
    if getattr(impl, "megamoe", None) is not None:
        return [], "its experts run through DeepGEMM Mega MoE, whose kernel does the dispatch itself"
    # AutoEP delegates to an AllToAllEP / AllReduceEP of its own, each holding experts_forward
    subs = [v for v in vars(impl).values() if isinstance(getattr(v, "__dict__", None), dict)
            and "experts_forward" in v.__dict__ and v is not impl]
    return [impl, *subs], None


def wrap_installs(layout_name: str, covers: tuple[str, ...], host: Any,
                  installs: list[tuple[Any, str, Any]]) -> tuple[list[tuple[Any, str, Any]], str | None]:
    """The op's assignments with the layout's wrapper around the forward it binds on ``host`` (or, under
    expert parallelism, in place of what the dispatch calls), and why the layout cannot be served (or None)."""
    if layout_name == "experts":
        impls, why = ep_implementations(host)
        if why:
            return installs, why
        fwd = next((v for o, a, v in installs if o is host and a == "forward"), None)
        rest = [(o, a, v) for o, a, v in installs if not (o is host and a == "forward")]
        return rest + [(impl, "experts_forward", fwd) for impl in impls], None
    if layout_name == "replicated":
        wrap = _replicated
    elif layout_name == "heads" and any(getattr(getattr(host, c, None), "_parameters", None) for c in covers):
        def wrap(fn):
            return _heads(fn, covers)
    else:
        return installs, None
    out = []
    for obj, attr, value in installs:
        if obj is host and attr == "forward" and isinstance(value, types.MethodType):
            value = types.MethodType(wrap(value.__func__), host)
        out.append((obj, attr, value))
    return out, None
