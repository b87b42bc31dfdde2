"""Keep the float64 reference in float64.

Hugging Face modeling code upcasts to float32 by hand in the places where precision matters:
``hidden_states.to(torch.float32)`` in RMSNorm, ``logits.float()`` before the loss,
``softmax(..., dtype=torch.float32)`` in eager attention.  Run on a float64 model those casts
*downcast* the reference to float32, which would make the "float64" reference no better than
fp32 exactly where the fused kernels do their work (and identical to the unpatched fp32 model
there, so its error would read as 0).

:class:`Float64Mode` is a ``TorchFunctionMode`` active only while the reference model runs
forward: a cast of a float64 tensor to a narrower float type returns the float64 tensor, and a
``dtype=`` argument asking for a narrower float is widened to float64 when one of the inputs is
float64, and so are narrower float operands of such a call (``float64 @ float32`` does not
promote: transformers 5.17's RoPE computes ``inv_freq.float() @ position_ids.float()``).
Nothing else changes: integer casts, device moves, and tensors that are not float64
(e.g. ``position_ids.float()``) behave as usual.
"""

from __future__ import annotations

from typing import Any


def _narrow_floats():
    import torch

    return (torch.float32, torch.float16, torch.bfloat16)


def _has_f64(obj: Any, depth: int = 0) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.dtype == torch.float64
    if depth < 2 and isinstance(obj, (tuple, list)):
        return any(_has_f64(o, depth + 1) for o in obj)
    return False


def _widen(obj: Any, depth: int = 0) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(torch.float64) if obj.dtype in _narrow_floats() else obj
    if depth < 2 and isinstance(obj, (tuple, list)):
        return type(obj)(_widen(o, depth + 1) for o in obj)
    return obj


def float64_mode():
    """A fresh context manager keeping float64 computations in float64 (see module doc)."""
    import torch
    from torch.overrides import TorchFunctionMode

    narrow = _narrow_floats()
    f64 = torch.float64
    T = torch.Tensor
    down_methods = {T.float, T.half, T.bfloat16}
    to_methods = {T.to, T.type}

    class Float64Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in down_methods:
                if args and isinstance(args[0], torch.Tensor) and args[0].dtype == f64:
                    return args[0]
            elif func in to_methods:
                if args and isinstance(args[0], torch.Tensor) and args[0].dtype == f64:
                    new_args = [args[0]]
                    for a in args[1:]:
                        if isinstance(a, torch.dtype) and a in narrow:
                            a = f64
                        elif isinstance(a, torch.Tensor) and a.dtype in narrow:   # .to(other)
                            a = a.device
                        elif isinstance(a, str) and func is T.type and a in ("torch.FloatTensor",
                                                                              "torch.HalfTensor",
                                                                              "torch.BFloat16Tensor"):
                            a = "torch.DoubleTensor"
                        new_args.append(a)
                    args = tuple(new_args)
                    if kwargs.get("dtype") in narrow:
                        kwargs["dtype"] = f64
            elif (func is torch.full and kwargs.get("dtype") is None and len(args) > 1
                  and isinstance(args[1], float) and abs(args[1]) > torch.finfo(torch.get_default_dtype()).max):
                # torch.full((), torch.finfo(weights.dtype).min) with float64 weights (XGLM's attention
                # mask): a float64 value the default dtype cannot hold; the fill keeps float64
                kwargs["dtype"] = f64
            elif _has_f64(args) or any(_has_f64(v) for v in kwargs.values()):
                if kwargs.get("dtype") in narrow:
                    kwargs["dtype"] = f64
                # ops that do not promote (float64 @ float32 is an error) get float64 operands;
                # the target of an in-place op or of ``out=`` is left alone
                inplace = getattr(func, "__name__", "").endswith("_") or "out" in kwargs
                args = tuple(a if (i == 0 and inplace) else _widen(a) for i, a in enumerate(args))
            return func(*args, **kwargs)

    return Float64Mode()
