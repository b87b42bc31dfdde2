"""fused_add_rmsnorm: a pre-norm decoder layer's second residual add fused with its RMSNorm.

Applied to a decoder layer (kind ``DecoderLayer``) whose forward is the pre-norm pattern of
Llama / Qwen2 / Qwen3 / Mistral::

    residual = h; h = input_layernorm(h); h = self_attn(hidden_states=h, ...)[0]
    h = residual + h; residual = h; h = post_attention_layernorm(h); h = mlp(h); h = residual + h

The replacement forward calls ``input_layernorm``, ``self_attn`` and ``mlp`` as modules (they may
be patched themselves, or wrapped by PEFT) and computes ``residual + attn_out`` together with
``post_attention_layernorm`` of it in one kernel, reading ``post_attention_layernorm.weight`` at
call time.  Every argument the layer receives is passed to ``self_attn`` exactly as the original
forward does (bound against the original signature, defaults applied).

``check`` refuses other layouts (Gemma 3's sandwich norms) and any layer whose forward does
something else: it runs the class's own forward and the replacement on a tiny CPU stand-in
(stand-in norm / attention / MLP modules, the real RMSNorm class with a random weight) and
compares the outputs and what reached ``self_attn``.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import Any, Callable, Mapping

from ..model.info import ModuleInfo
from .base import Op
from .common import signature_binder
from .registry import register
from .rmsnorm import RMS_FLAGS, rms_kernel_name, rms_key_params
from .loss_path import unsharded_reason

# post_attention_layernorm's weight is read in the decoder layer's forward, not its own
NOT_GATHERED_HINT = ("it is read in the decoder layer's forward, where ZeRO-3 does not gather it; keep it "
                     "persistent (stage3_param_persistence_threshold above its size: the default, 100000, is) "
                     "or leave fused_add_rmsnorm out")

CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def reference_add_rmsnorm(x, residual, w, eps: float, offset: float, casting: str):
    """Plain-torch (normed, new_residual) with the given cast order (used by the probe)."""
    import torch

    s = x + residual
    sf = s.float()
    n = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        y = (n * (offset + w.float())).to(s.dtype)
    else:
        y = (offset + w) * n.to(s.dtype) if offset else w * n.to(s.dtype)
    return y, s


# ---- how the original forward is called ------------------------------------------------------
def _wrapper_chain(fn: Any) -> list:
    chain, seen = [], 0
    while fn is not None and seen < 16:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return chain


def _closure_vars(fn: Any) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            pass
    return out


def kwarg_renames(fn: Any) -> list[tuple[str, str]]:
    """(old, new) keyword renames applied by transformers' ``deprecate_kwarg`` wrappers on ``fn``."""
    out = []
    for f in _wrapper_chain(fn):
        v = _closure_vars(f)
        if isinstance(v.get("old_name"), str) and isinstance(v.get("new_name"), str):
            out.append((v["old_name"], v["new_name"]))
    return out


def checkpoints_in_forward(fn: Any) -> bool:
    """True when the class forward is transformers' gradient-checkpointing wrapper (5.2x+).

    Older versions checkpoint in ``GradientCheckpointingLayer.__call__``, which still wraps an
    instance-level forward; newer ones wrap the class ``forward``, which a replacement bypasses,
    so the replacement has to checkpoint itself.
    """
    return any(getattr(getattr(f, "__code__", None), "co_name", "") == "forward_with_checkpointing"
               for f in _wrapper_chain(fn))


def build_forward(cls: type, fused: Callable) -> Callable:
    """The replacement ``forward(self, *args, **kwargs)`` for a pre-norm layer of class ``cls``.

    ``fused(attn_out, residual, weight) -> (normed, new_residual)``.
    """
    import torch

    orig = cls.forward
    sig = inspect.signature(orig)
    params = list(sig.parameters.values())
    self_name, hs_name = params[0].name, params[1].name
    varkw = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    renames = kwarg_renames(orig)
    ckpt = checkpoints_in_forward(orig)
    bind = signature_binder(sig)      # traceable by Dynamo, unlike sig.bind

    def body(self, *args, **kwargs):
        for old, new in renames:
            if old in kwargs:
                if new in kwargs:
                    kwargs.pop(old)
                else:
                    kwargs[new] = kwargs.pop(old)
        a = bind(self, *args, **kwargs)
        a.pop(self_name)
        hidden_states = a.pop(hs_name)
        extra = a.pop(varkw, None) if varkw else None
        if extra:
            a.update(extra)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_out = self.self_attn(hidden_states=hidden_states, **a)[0]
        w = self.post_attention_layernorm.weight
        if (why := unsharded_reason(w, "post_attention_layernorm.weight", NOT_GATHERED_HINT)):
            raise RuntimeError(f"fused_add_rmsnorm: {why}")     # never launch a kernel on a partition
        normed, residual = fused(attn_out, residual, w)
        return residual + self.mlp(normed)

    def forward(self, *args, **kwargs):
        if ckpt and getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
            # What transformers' forward_with_checkpointing does, for the replacement forward.
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if not getattr(self, "_can_checkpoint_with_cache", False):
                for n in ("cache", "past_key_values", "layer_past"):
                    if kwargs.get(n) is not None:
                        kwargs[n] = None
            return self._gradient_checkpointing_func(functools.partial(body, self, **kwargs), *args)
        return body(self, *args, **kwargs)

    forward.__doc__ = f"fused_add_rmsnorm replacement of {cls.__name__}.forward"
    return forward


# ---- the structural probe ----------------------------------------------------------------------
class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<probe {self.name}>"

    def __bool__(self) -> bool:  # ``if use_cache:`` and the like must not take a branch
        return False


@functools.lru_cache(maxsize=1)
def _stand_in_classes():
    import torch

    class NormStandIn(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) + 0.25 * x

    class AttnStandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = []

        def forward(self, *args, **kwargs):
            self.calls.append((args, kwargs))
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return h.flip(-1) * 0.75 + torch.sin(h), None

    class MLPStandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return torch.sigmoid(x) * x.roll(1, -1) * 1.5

    class CallTrap(torch.nn.Module):
        """Stands in for any other child module: records that the forward used it."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x, *args, **kwargs):
            self.calls += 1
            return x

    return NormStandIn, AttnStandIn, MLPStandIn, CallTrap


def _stand_in_layer(module: Any, hidden: int):
    import torch

    from ..model.kinds.probe import stand_in

    Norm, Attn, MLP, Trap = _stand_in_classes()
    g = torch.Generator().manual_seed(3)
    mods = OrderedDict((k, Trap()) for k in module.__dict__["_modules"])
    pln = module.post_attention_layernorm
    mods["input_layernorm"] = Norm()
    mods["self_attn"] = Attn()
    mods["post_attention_layernorm"] = stand_in(pln, weight=torch.randn(hidden, generator=g) * 0.5 + 0.2)
    mods["mlp"] = MLP()
    return stand_in(module, modules=mods, training=False)


def probe_structure(module: Any, facts: Mapping[str, Any]) -> str | None:
    """Run the class forward and the replacement on a CPU stand-in; a reason if they differ."""
    import torch

    cls = type(module)
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return f"{cls.__name__}.forward has no readable signature"
    params = list(sig.parameters.values())
    if len(params) < 2 or any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
                              for p in params[1:]):
        return f"{cls.__name__}.forward{sig} is not (self, hidden_states, named arguments..., **kwargs)"
    hidden = int(facts["hidden"])
    eps, offset = float(facts["eps"]), float(facts["offset"])
    casting = facts["casting"] if facts["casting"] in ("llama", "gemma") else "llama"
    named = {p.name: _Sentinel(p.name) for p in params[2:]
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        named["patchdsl_probe_extra"] = _Sentinel("patchdsl_probe_extra")
    replacement = build_forward(cls, lambda a, r, w: reference_add_rmsnorm(a, r, w, eps, offset, casting))
    # every argument given (each a distinct sentinel), then none (the defaults must pass through too)
    for seed, call_kwargs, must_run in ((4, named, True), (5, {}, False)):
        reason = _compare(module, cls, replacement, hidden, call_kwargs, seed, must_run)
        if reason:
            return reason
    return None


def _compare(module, cls, replacement, hidden, named, seed, must_run) -> str | None:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, hidden, generator=g)
    runs = []
    for fn in (cls.forward, replacement):
        layer = _stand_in_layer(module, hidden)
        try:
            with torch.no_grad():
                out = fn(layer, x.clone(), **named)
        except Exception as e:  # the forward needs something the stand-in does not have
            if not must_run and fn is cls.forward:
                return None     # the original needs these arguments too: nothing to compare
            msg = str(e).splitlines()[0] if str(e) else ""
            return f"its forward could not be checked on a stand-in ({type(e).__name__}: {msg[:120]})"
        used = [k for k, v in layer._modules.items() if k not in CHILDREN and getattr(v, "calls", 0)]
        if used:
            return (f"its forward also calls self.{used[0]} (dropout or an extra norm?), "
                    "which the fused pre-norm forward would skip")
        runs.append((out, layer.self_attn.calls, layer.mlp.calls))
    (o_ref, calls_ref, mlp_ref), (o_new, calls_new, mlp_new) = runs
    if not isinstance(o_ref, torch.Tensor):
        return f"its forward returns {type(o_ref).__name__}, not a tensor (expected the transformers 5.x layer API)"
    if len(calls_ref) != 1 or mlp_ref != 1:
        return (f"its forward calls self_attn {len(calls_ref)} time(s) and mlp {mlp_ref} time(s); "
                "the pre-norm layout calls each once")
    (args_r, kw_r), (args_n, kw_n) = calls_ref[0], calls_new[0]
    if len(args_r) != len(args_n) or set(kw_r) != set(kw_n) or any(
            not (kw_r[k] is kw_n[k] or (isinstance(kw_r[k], torch.Tensor) and isinstance(kw_n[k], torch.Tensor)
                                         and kw_r[k].shape == kw_n[k].shape and torch.allclose(kw_r[k], kw_n[k])))
            for k in kw_r):
        return ("its forward passes different arguments to self_attn than the pre-norm pattern "
                f"(original: {sorted(kw_r)}, {len(args_r)} positional)")
    if not isinstance(o_new, torch.Tensor) or o_new.shape != o_ref.shape or not torch.allclose(
            o_new, o_ref, rtol=1e-5, atol=1e-5):
        return ("its forward does not compute the pre-norm pattern residual + mlp(post_attention_layernorm("
                "residual + self_attn(input_layernorm(h))))")
    return None


class FusedAddRMSNorm(Op):
    name = "fused_add_rmsnorm"
    kinds = ("DecoderLayer",)
    placements = ()          # the residual add spans the layer: its sequence-parallel form is not written
    template = "fused_add_rmsnorm.py.j2"
    covers = ("post_attention_layernorm",)
    doc = ("A pre-norm decoder layer's `residual + attn_out` and `post_attention_layernorm` in one kernel "
           "(returns both); backward takes both gradients.")
    flags = RMS_FLAGS

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        return rms_key_params(info.facts("DecoderLayer"), flags, dtype, info.dtype, target)

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return rms_kernel_name(self.name, params)

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        f = info.facts("DecoderLayer")
        if not f:
            return ("not a decoder layer (needs input_layernorm, self_attn, post_attention_layernorm "
                    "(an RMSNorm) and mlp)")
        if f["layout"] != "prenorm":
            return (f"layout is {f['layout']} (extra norms around attention/MLP, e.g. Gemma 3); "
                    "fused_add_rmsnorm needs the pre-norm layout (Llama/Qwen/Mistral)")
        if f["casting"] == "unknown" and flags.get("casting", "auto") == "auto":
            return "post_attention_layernorm matches neither the Llama nor the Gemma cast order; set casting= explicitly"
        w = getattr(getattr(module, "post_attention_layernorm", None), "weight", None)
        if w is None or tuple(w.shape) != (int(f["hidden"]),):
            return "post_attention_layernorm has no weight of shape (hidden,)"
        return probe_structure(module, f)

    def make_forward(self, module, kernels, flags, info):
        def fused(x, residual, w):
            if x.dtype != residual.dtype:
                import torch

                dt = torch.promote_types(x.dtype, residual.dtype)
                x, residual = x.to(dt), residual.to(dt)
            return kernels(x.dtype).add_rmsnorm(x, residual, w)

        return build_forward(type(module), fused)


register(FusedAddRMSNorm())
