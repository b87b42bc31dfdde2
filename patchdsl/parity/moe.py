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


# ---- the router (fused_router): its top-k weights, with the routing held fixed ---------------------
def router_roles(out: Any) -> tuple[Any, Any] | None:
    """(top-k weights, top-k indices) of a router module's output: the indices are its one integer
    tensor, the weights the floating one with the indices' shape (the third is the logits, wherever the
    version puts them: transformers 5.17's GraniteMoe router returns (index, weights, logits))."""
    import torch

    if not isinstance(out, (tuple, list)):
        return None
    ts = [t for t in out if isinstance(t, torch.Tensor)]
    ints = [t for t in ts if not t.is_floating_point()]
    if len(ints) != 1 or ints[0].dim() != 2:
        return None
    ws = [t for t in ts if t.is_floating_point() and t.shape == ints[0].shape]
    return (ws[0], ints[0]) if len(ws) == 1 else None


def _n_experts(out: Any, idx: Any) -> int:
    """The router's expert count: the last dimension of its logits (the output's other floating tensor)."""
    import torch

    for t in out:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 and t.shape != idx.shape:
            return int(t.shape[-1])
    return int(idx.max()) + 1 if idx.numel() else 1


def router_checks(copies: dict[str, tuple[Any, Any, Any]], captured: Any, device: Any, seed: int) -> dict[str, dict]:
    """For a Router site: per copy (``{name: (module, dtype, context)}``: the unpatched and patched
    routers and the float64 reference's), ``top_k_weights`` (scattered onto the experts: the order of
    the k slots does not matter) and the gradients of the input and of the router's parameters through
    those weights (``grad_input_via_weights``, ``grad_<param>_via_weights``) for one random upstream
    per (token, expert).  The routing is held fixed: tokens whose selected experts differ between the
    copies (near-ties the float64 reference breaks otherwise) are left out of the weights and their
    gradients, so an expert choice flipping at a tie cannot fail those checks, while a wrong weight or
    gradient does; ``top_k_index`` (the chosen experts as 0/1 per token and expert) checks the choice
    itself on every token that is not a near-tie of the reference's logits (its k-th and (k+1)-th
    largest closer than 8 roundings of the narrowest dtype), where every copy must choose as it does.
    Returns ``{}`` per copy when the module's output is not a router's."""
    import contextlib

    import torch

    from .hooks import cast_to

    outs: dict[str, Any] = {}
    ref_logits = None
    n_exp = 1
    for name, (m, dt, ctx) in copies.items():
        args = cast_to(captured.args, dt, device)
        kwargs = cast_to(captured.kwargs, dt, device)
        with torch.no_grad(), (ctx or contextlib.nullcontext()):
            out = m(*args, **kwargs)
        roles = router_roles(out)
        if roles is None:
            return {n: {} for n in copies}
        outs[name] = roles[1]
        n_exp = max(n_exp, _n_experts(out, roles[1]))
        if name == "ref":
            ref_logits = next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()
                               and t.dim() == 2 and t.shape[-1] == n_exp and t.shape != roles[1].shape), None)
    idx = [torch.sort(i.long(), -1)[0].cpu() for i in outs.values()]
    n, k = idx[0].shape
    keep = torch.ones(n, dtype=torch.bool)
    for i in idx[1:]:
        if i.shape != idx[0].shape:
            return {n: {} for n in copies}
        keep &= (i == idx[0]).all(-1)
    # tokens whose k-th and (k+1)-th reference logits are closer than the narrowest dtype's rounding
    # can pick either expert: a near-tie.  Everywhere else the expert choice must be the reference's.
    near = torch.zeros(n, dtype=torch.bool)
    if ref_logits is not None and k < ref_logits.shape[-1]:
        lr = ref_logits.detach().double().cpu()
        top = torch.sort(lr, -1, descending=True)[0]
        eps = max(torch.finfo(dt).eps for _, dt, _ in copies.values())
        near = (top[:, k - 1] - top[:, k]) <= 8 * eps * lr.abs().amax(-1).clamp_min(1e-30)
    g = torch.Generator().manual_seed(seed)
    up = torch.randn((n, n_exp), generator=g, dtype=torch.float64) * keep[:, None]
    res: dict[str, dict] = {}
    for name, (m, dt, ctx) in copies.items():
        args = list(cast_to(captured.args, dt, device))
        kwargs = cast_to(captured.kwargs, dt, device)
        x = args[0].requires_grad_(True) if args and isinstance(args[0], torch.Tensor) else None
        params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        with torch.enable_grad(), (ctx or contextlib.nullcontext()):
            w, ix = router_roles(m(*args, **kwargs))
        dense = torch.zeros((ix.shape[0], n_exp), dtype=torch.float64, device=ix.device)
        dense.scatter_(1, ix.long(), w.detach().double())
        chosen = torch.zeros((ix.shape[0], n_exp), dtype=torch.float64, device=ix.device)
        chosen.scatter_(1, ix.long(), 1.0)
        q = {"top_k_index": chosen * (~near)[:, None].to(chosen.device),     # 1 where chosen, near-ties left out
             "top_k_weights": dense * keep[:, None].to(dense.device)}
        inputs = ([x] if x is not None else []) + [p for _, p in params]
        gw = up.to(ix.device).gather(1, ix.long()).to(w.dtype)
        grads = (torch.autograd.grad(w, inputs, gw, allow_unused=True) if w.requires_grad and inputs
                 else [None] * len(inputs))
        if x is not None:
            q["grad_input_via_weights"] = grads[0]
            grads = grads[1:]
        for (n, _), gr in zip(params, grads):
            q[f"grad_{n}_via_weights"] = gr
        res[name] = q
    return res
