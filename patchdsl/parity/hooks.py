"""Per-site capture: record what each patched site's module received in the float64 run, and
re-run that module alone (reference, unpatched-in-dtype, patched-in-dtype) on those inputs.

Why re-run instead of comparing the three whole-model runs module by module: in a whole-model
run, a site downstream of a broken kernel receives already-wrong inputs and would fail too, so
the report could not say which site is guilty.  Running each site on the *same* inputs (the
float64 reference's, cast to the run dtype) isolates its own error.

Capture uses ``register_forward_pre_hook(..., with_kwargs=True)`` on the reference model's host
module (the module whose ``forward`` the op replaces).  Hooks fire for patched modules too:
``Module.__call__`` runs the hooks and then ``self.forward``, which for a patched module is the
instance attribute the runtime bound.  Sites hosted by the causal LM itself
(``fused_linear_cross_entropy`` on ``lm_head``) capture the base model's last hidden state and
are re-run with the base model replaced by a stub that returns it, so the check covers exactly
the LM head and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

_FLOAT_KW = ("hidden_states", "x", "input", "inputs", "hidden")


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in nested tuples / lists / dicts; leave everything else."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(tree_map(fn, o) for o in obj)
    if isinstance(obj, list):
        return [tree_map(fn, o) for o in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return obj


def cast_to(obj: Any, dtype: Any, device: Any) -> Any:
    """Floating tensors -> ``dtype`` (clamped into its finite range first, so a float64 mask's
    ``finfo.min`` stays a large negative number rather than turning into -inf); every tensor ->
    ``device``.  Returns fresh tensors that do not require grad."""
    import torch

    fi = torch.finfo(dtype)

    def f(t):
        t = t.detach()
        if t.is_floating_point():
            if t.dtype != dtype and torch.finfo(t.dtype).max > fi.max:
                t = t.clamp(fi.min, fi.max)
            return t.to(device=device, dtype=dtype).clone()
        return t.to(device=device).clone()

    return tree_map(f, obj)


@dataclass
class Captured:
    """The inputs of one call of a site's host module in the float64 run."""

    args: tuple
    kwargs: dict
    base_hidden: Any = None     # causal-LM hosts: the base model's last hidden state


class Capture:
    """Forward pre-hooks on the given host paths of ``model`` recording their first call."""

    def __init__(self, model: Any, hosts: dict[str, bool]):
        """``hosts``: host path -> True when it is a causal LM (capture the base model's output too)."""
        self.calls: dict[str, Captured] = {}
        self._handles = []
        for path, is_lm in hosts.items():
            mod = model.get_submodule(path) if path else model
            self._handles.append(mod.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            if is_lm:
                base = base_model_of(mod)
                if base is not None:
                    self._handles.append(base.register_forward_hook(self._post_base(path)))

    def _pre(self, path: str):
        def hook(module, args, kwargs):
            if path not in self.calls:
                snap = lambda t: t.detach().clone()  # noqa: E731
                self.calls[path] = Captured(tree_map(snap, args), tree_map(snap, dict(kwargs)))
            return None

        return hook

    def _post_base(self, path: str):
        def hook(module, args, output):
            c = self.calls.get(path)
            if c is not None and c.base_hidden is None:
                c.base_hidden = first_tensor(output).detach().clone()
            return None

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def base_model_of(lm: Any) -> Any:
    """The base (decoder) model a causal LM calls before its head: ``lm.model`` usually."""
    import torch

    prefix = getattr(lm, "base_model_prefix", None) or "model"
    for name in (prefix, "model", "transformer"):
        m = lm._modules.get(name) if hasattr(lm, "_modules") else None
        if isinstance(m, torch.nn.Module):
            return m
    return None


def base_model_name(lm: Any) -> str | None:
    base = base_model_of(lm)
    if base is None:
        return None
    return next(n for n, m in lm._modules.items() if m is base)


def first_tensor(out: Any) -> Any:
    """The main tensor of a module's output: itself, or the first tensor of a tuple / ModelOutput."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):      # ModelOutput is an OrderedDict of the non-None fields
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(out, (tuple, list)):
        for v in out:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def primary_input(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    """Where the module's main floating input is: ("arg", index) or ("kw", name)."""
    import torch

    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    for k in _FLOAT_KW:
        v = kwargs.get(k)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", k)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", k)
    return None


def base_stub(hidden: Any, like: Any = None) -> Any:
    """A module standing in for a causal LM's base model: returns ``hidden`` as the last hidden state.
    It carries the plain number/flag attributes of ``like`` (the base model it replaces): a causal LM's
    forward may read them (Falcon-H1: ``self.model.lm_head_multiplier``)."""
    import torch

    try:     # a superset of BaseModelOutputWithPast: MoE causal LMs also read .router_logits (None here)
        from transformers.modeling_outputs import MoeModelOutputWithPast as BaseModelOutputWithPast
    except ImportError:  # pragma: no cover - older transformers
        from transformers.modeling_outputs import BaseModelOutputWithPast

    class BaseModelStub(torch.nn.Module):
        def __init__(self, h):
            super().__init__()
            self.h = h

        def forward(self, *args, **kwargs):
            return _StubOutput(last_hidden_state=self.h)

    class _StubOutput(BaseModelOutputWithPast):
        # a causal LM's forward may read more of its base model's output (MoE models: router_logits,
        # used only when the config asks for them): what the stub does not compute reads as None
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    stub = BaseModelStub(hidden)
    for k, v in (vars(like).items() if like is not None else ()):
        if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str)):
            setattr(stub, k, v)
    return stub


def _takes(module: Any, name: str) -> bool:
    """Whether ``module.forward`` has a parameter ``name``."""
    import inspect

    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def run_site(model: Any, host_path: str, site_path: str, captured: Captured, dtype: Any, device: Any,
             upstream: Callable[[Any], Any], is_lm: bool, context: Any = None) -> dict[str, Any]:
    """Run ``model``'s host module once on ``captured`` inputs cast to ``dtype``; backpropagate
    ``upstream(main_output)`` and return {"output" | "loss", "grad_input", "grad_<param>": tensor}.

    Parameter gradients are taken with ``torch.autograd.grad`` so ``.grad`` is never touched.
    ``context``: entered around the forward (the reference's float64 mode).
    """
    host = model.get_submodule(host_path) if host_path else model
    module = model.get_submodule(site_path) if site_path else model
    return run_host(host, module, host_path, captured, dtype, device, upstream, is_lm, context)


def run_host(host: Any, module: Any, host_path: str, captured: Captured, dtype: Any, device: Any,
             upstream: Callable[[Any], Any], is_lm: bool, context: Any = None) -> dict[str, Any]:
    """:func:`run_site` on a host module given directly (a float64 copy of one site's host in the
    streamed reference, see :mod:`.stream`); ``module`` is the site's module inside ``host``."""
    import contextlib

    import torch

    args = cast_to(captured.args, dtype, device)
    kwargs = cast_to(captured.kwargs, dtype, device)
    restore = None
    if is_lm and captured.base_hidden is not None:
        x = cast_to(captured.base_hidden, dtype, device).requires_grad_(True)
        name = base_model_name(host)
        restore = (name, host._modules[name])
        host._modules[name] = base_stub(x, host._modules[name])
        if _takes(host, "output_router_logits"):
            # MoE: the stub records no router logits, so the head's site check runs without the
            # router's aux loss (HF's forward would crash on None); the aux loss is checked end to end
            kwargs["output_router_logits"] = False
    else:
        loc = primary_input(args, kwargs)
        x = None
        if loc is not None:
            kind, k = loc
            if kind == "arg":
                x = args[k].requires_grad_(True)
            else:
                x = kwargs[k].requires_grad_(True)
    # other positional float inputs of the primary input's shape (a gated norm's gate): their
    # gradients are compared too, so an op that drops or breaks one is named at its site
    others: list[tuple[int, Any]] = []
    if x is not None and not is_lm:
        for i, a in enumerate(args):
            if a is not x and isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == x.shape:
                others.append((i, a.requires_grad_(True)))
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    try:
        with torch.enable_grad(), (context or contextlib.nullcontext()):
            out = host(*args, **kwargs)
    finally:
        if restore is not None:
            host._modules[restore[0]] = restore[1]
    if is_lm:
        main = getattr(out, "loss", None)
        if main is None and isinstance(out, (tuple, list)):
            main = out[0]
        qname = "loss"
    else:
        main = first_tensor(out)
        qname = "output"
    if main is None:
        raise RuntimeError(f"{host_path or '<model>'} returned no tensor to compare")
    res: dict[str, Any] = {qname: main.detach()}
    inputs = ([x] if x is not None else []) + [a for _, a in others] + [p for _, p in params]
    if main.requires_grad and inputs:
        grads = torch.autograd.grad(main, inputs, upstream(main), allow_unused=True)
    else:
        grads = [None] * len(inputs)
    if x is not None:
        res["grad_input"] = grads[0]
        grads = grads[1:]
    for (i, _), g in zip(others, grads):
        res[f"grad_input{i}"] = g
    grads = grads[len(others):]
    for (n, _), g in zip(params, grads):
        res[f"grad_{n}"] = g
    return res
