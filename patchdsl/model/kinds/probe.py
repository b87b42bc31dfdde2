"""What the recognisers share: reading eps, a CPU stand-in of a module for probing its class's own
``forward`` (known weights, no hooks, the module untouched), and which activation a callable computes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from ..modules import _torch


_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


def _eps(m: Any) -> float | None:
    for a in _EPS_ATTRS:
        v = getattr(m, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def stand_in(m: Any, *, modules: Mapping[str, Any] | None = None, training: bool | None = None, **params):
    """A shallow CPU copy of ``m`` for probing its class's forward: its parameters are ``params``,
    its children ``modules``, no buffers, no hooks, no instance-level forward.  ``m`` is untouched."""
    torch = _torch()
    clone = m.__class__.__new__(m.__class__)
    d = dict(m.__dict__)
    d.pop("forward", None)
    for k in _HOOK_DICTS:
        if k in d:
            d[k] = OrderedDict()
    # parameters registered as None (e.g. nn.LayerNorm(bias=False)) stay None on the stand-in
    d["_parameters"] = OrderedDict((k, None) for k, v in m._parameters.items() if v is None)
    d["_parameters"].update((k, torch.nn.Parameter(v, requires_grad=False)) for k, v in params.items())
    d["_buffers"] = OrderedDict()
    d["_modules"] = OrderedDict(modules or {})
    if training is not None:
        d["training"] = training
    clone.__dict__.update(d)
    return clone


def _run_class_forward(m: Any, clone: Any, *args):
    torch = _torch()
    with torch.no_grad():
        return type(m).forward(clone, *args)



def _activation(act: Any) -> str | None:
    """'silu', 'gelu' (exact erf) or 'gelu_tanh', probed on a ramp; None otherwise."""
    torch = _torch()
    if act is None or not callable(act):
        return None
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x.clone())
    except Exception:
        return None
    F = torch.nn.functional
    for name, ref in (("silu", F.silu(x)), ("gelu", F.gelu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh"))):
        if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-7):
            return name
    return None

