"""What graph_step can capture, decided before any capture (no CUDA needed for most of it): the
options, the optimizer and its hyperparameters, the model, the device, the batch's signature, and
the messages that say why a step is refused.  Used by :mod:`.graphs`."""

from __future__ import annotations

import os
import traceback
from typing import Any, Mapping

SHAPE_POLICIES = ("error", "recapture", "eager")
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")        # torch.cuda.graph(capture_error_mode=...)

# ops whose CUDA implementation synchronises with the host, in words people search for
_SYNC_OPS = {
    "_local_scalar_dense": "Tensor.item(), or a CUDA tensor used as a Python number or bool "
                           "(float(t), int(t), `if t:`, `if t.any():`)",
    "is_nonzero": "a CUDA tensor used as a Python bool (`if t:`)",
    "nonzero": "torch.nonzero / boolean-mask indexing t[mask] / torch.where(cond) with one argument",
    "masked_select": "boolean-mask indexing t[mask] (output size depends on the data)",
    "unique": "torch.unique (output size depends on the data)",
    "_unique2": "torch.unique (output size depends on the data)",
    "repeat_interleave": "repeat_interleave with tensor repeats (output size depends on the data)",
    "equal": "torch.equal (returns a Python bool)",
    "_to_copy": "a copy between the CPU and the GPU (.cpu(), .tolist(), .numpy(), a CPU tensor .to('cuda'), "
                "torch.tensor(..., device='cuda')); a copy from host memory would be replayed from that memory",
    "copy_": "a copy between the CPU and the GPU (a CPU tensor copied into a CUDA one, or back)",
}


class GraphStepError(RuntimeError):
    """``graph_step`` refused to capture (or to replay) the step; the message says why and what to do."""


class UnpatchedModelWarning(UserWarning):
    """The model given to ``graph_step`` carries no patchdsl patch (it is graphed as it is)."""


# ----------------------------------------------------------------------------- pure helpers (no CUDA)
def _torch():
    import torch

    return torch


def batch_signature(batch: Mapping[str, Any]) -> tuple:
    """What a captured graph depends on: keys, and per tensor its shape and dtype (per other value,
    its repr).  Two batches with the same signature can share a graph."""
    torch = _torch()
    if not isinstance(batch, Mapping):
        raise GraphStepError(f"a batch must be a mapping of model keyword arguments to tensors (e.g. "
                             f"{{'input_ids': ..., 'labels': ...}}), got {type(batch).__name__}")
    if "position_ids" in batch:
        raise GraphStepError("the batch has position_ids: transformers finds packed sequences (positions that restart "
                             "at 0) with a host check that it skips while a CUDA stream is capturing, so a captured "
                             "graph would treat a packed row as one sequence. Leave position_ids out (the model counts "
                             "positions itself), or run packed batches eagerly")
    sig = []
    for k in sorted(batch):
        v = batch[k]
        if isinstance(v, torch.Tensor):
            sig.append((k, "tensor", tuple(v.shape), str(v.dtype)))
        else:
            sig.append((k, "value", repr(v)))
    return tuple(sig)


def describe_signature_change(old: tuple, new: tuple) -> str:
    """In words: how batch signature ``new`` differs from ``old`` (the captured one)."""
    o, n = {s[0]: s for s in old}, {s[0]: s for s in new}
    parts = []
    for k in sorted(set(o) | set(n)):
        a, b = o.get(k), n.get(k)
        if a == b:
            continue
        if a is None:
            parts.append(f"new key {k!r}")
        elif b is None:
            parts.append(f"key {k!r} missing")
        elif a[1] == "tensor" and b[1] == "tensor":
            what = []
            if a[2] != b[2]:
                what.append(f"shape {list(a[2])} -> {list(b[2])}")
            if a[3] != b[3]:
                what.append(f"dtype {a[3]} -> {b[3]}")
            parts.append(f"{k}: " + ", ".join(what))
        else:
            parts.append(f"{k}: {a[-1]} -> {b[-1]}")
    return "; ".join(parts) or "no difference"


def micro_slices(rows: int, micro_batch: int | None) -> list[tuple[int, int]]:
    """The [start, stop) row ranges of the micro-batches of a batch of ``rows`` rows."""
    if micro_batch is None or micro_batch >= rows:
        return [(0, rows)]
    return [(j, min(j + micro_batch, rows)) for j in range(0, rows, micro_batch)]


def _check_options(on_shape_change: str, micro_batch: Any, warmup: Any, clip_grad_norm: Any,
                   max_graphs: Any, capture_error_mode: Any = "global") -> None:
    if capture_error_mode not in CAPTURE_ERROR_MODES:
        raise GraphStepError(f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)}, "
                             f"got {capture_error_mode!r}")
    if on_shape_change not in SHAPE_POLICIES:
        raise GraphStepError(f"on_shape_change must be one of {', '.join(SHAPE_POLICIES)}, got {on_shape_change!r}")
    if micro_batch is not None and (isinstance(micro_batch, bool) or not isinstance(micro_batch, int)
                                    or micro_batch < 1):
        raise GraphStepError(f"micro_batch must be a positive integer or None, got {micro_batch!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise GraphStepError(f"warmup must be an integer >= 1 (the warm-up creates the optimizer state, and its "
                             f"last iteration checks for host synchronisations), got {warmup!r}")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))
                                       or not clip_grad_norm > 0 or clip_grad_norm != clip_grad_norm
                                       or clip_grad_norm == float("inf")):
        raise GraphStepError(f"clip_grad_norm must be a finite number > 0 or None, got {clip_grad_norm!r}")
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise GraphStepError(f"max_graphs must be an integer >= 1, got {max_graphs!r}")


_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize",
               "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


class _TensorAt(tuple):
    """A tensor hyperparameter in a snapshot: the graph reads its memory, so only its address counts."""

    def __repr__(self) -> str:
        return f"a tensor at 0x{self[0]:x}"


def _has_tensor(v: Any) -> bool:
    return isinstance(v, _TensorAt) or (isinstance(v, tuple) and any(isinstance(x, _TensorAt) for x in v))


def _hyper_snapshot(optimizer: Any) -> tuple:
    """The optimizer's per-group hyperparameters as a captured step sees them: numbers are baked into
    the graph (any change counts), tensors are read from their memory (a tensor updated in place is
    fine, one replaced by another object is not)."""
    torch = _torch()

    def norm(x: Any) -> Any:
        return _TensorAt((x.data_ptr(),)) if isinstance(x, torch.Tensor) else x

    out = []
    for g in optimizer.param_groups:
        vals = []
        for k in _HYPER_KEYS:
            if k not in g:
                continue
            v = g[k]
            vals.append((k, tuple(norm(x) for x in v) if isinstance(v, (tuple, list)) else norm(v)))
        out.append((len(g["params"]), tuple(vals)))
    return tuple(out)


def _check_optimizer(optimizer: Any, optimizer_step: bool) -> None:
    if optimizer is None:
        if optimizer_step:
            raise GraphStepError("graph_step needs the optimizer to capture its step (or pass optimizer_step=False "
                                 "and an optimizer you step yourself)")
        return
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
        raise GraphStepError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer_step:
        bad = [i for i, g in enumerate(optimizer.param_groups) if not g.get("capturable", False)]
        if bad:
            name = type(optimizer).__name__
            raise GraphStepError(
                f"{name} was built with capturable=False (param group(s) {bad}): its step keeps the step count on "
                f"the host and cannot be captured in a CUDA graph. Build it with capturable=True, e.g. "
                f"torch.optim.{name}(model.parameters(), lr=..., fused=True, capturable=True), or pass "
                f"optimizer_step=False to capture forward and backward only and step the optimizer yourself")


def _check_model(model: Any) -> None:
    from .compile import cudagraph_conflict

    conflict = cudagraph_conflict(model)
    if conflict:
        raise GraphStepError(conflict)
    # transformers 5.x: is_gradient_checkpointing (deprecated in later 5.x for is_activation_checkpointing)
    names = ("is_activation_checkpointing", "is_gradient_checkpointing")
    name = next((n for n in names if n in getattr(model, "__dict__", {}) or hasattr(type(model), n)), None)
    if name is not None and getattr(model, name, False):
        raise GraphStepError("gradient checkpointing is on: it re-runs each layer's forward inside the backward and "
                             "saves and restores the CUDA RNG state on the host for every layer, which patchdsl does "
                             "not capture. Turn it off (model.gradient_checkpointing_disable()); a graphed step keeps "
                             "the activations in the graph's memory pool instead")


def _is_sync_error(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "synchronizing CUDA operation" in str(e)


def _user_frame(tb: Any) -> str | None:
    """The innermost frame of a traceback outside torch and graph_step's own files: the line that asked
    for the sync."""
    torch = _torch()
    here = os.path.dirname(os.path.abspath(__file__))
    own = {os.path.join(here, n) for n in ("graphs.py", "graph_checks.py", "eager_mask.py")}
    skip = os.path.dirname(torch.__file__)
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        fn = os.path.abspath(fr.filename)
        if fn.startswith(skip) or fn in own:
            continue
        return f"{fr.filename}:{fr.lineno} in {fr.name}" + (f": {fr.line.strip()}" if fr.line else "")
    return None


def _op_words(op: str) -> str:
    """``aten._local_scalar_dense.default`` -> the op with what it usually is in Python code."""
    parts = op.replace("::", ".").split(".")
    base = parts[1] if len(parts) >= 2 and parts[0] == "aten" else ""
    hint = _SYNC_OPS.get(base)
    return f"{op} ({hint})" if hint else op


def _batch_hint(static: Mapping[str, Any]) -> str:
    if "attention_mask" in static:
        return (". The batch has an attention_mask: this transformers version checks on the host whether it pads "
                "anything (`mask.all()`; versions whose is_tracing() consults CUDA stream capture skip that check in a "
                "capture, and the warm-up check then skips it too); for unpadded batches leave attention_mask out (the "
                "causal path needs none); for batches padded to a fixed length, check_syncs=False lets the capture "
                "itself refuse a real sync")
    return ""


def _hyper_change(old: tuple, new: tuple) -> str:
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if a[0] != b[0]:
            return (f"param group {i} of the optimizer changed its parameters ({a[0]} -> {b[0]}) after the capture; "
                    f"build a new step")
        da, db = dict(a[1]), dict(b[1])
        for k in da.keys() | db.keys():
            if da.get(k) != db.get(k) and (_has_tensor(da.get(k)) or _has_tensor(db.get(k))):
                return (f"the optimizer's {k} (param group {i}) was replaced by another object after the capture; the "
                        f"graph reads the tensor it was captured with. Update a tensor hyperparameter in place "
                        f"(param_group[{k!r}].fill_(value)), as torch's LR schedulers do for a tensor lr")
            if da.get(k) != db.get(k):
                fix = (" Give the optimizer a tensor learning rate, e.g. AdamW(params, lr=torch.tensor(1e-4), "
                       "fused=True, capturable=True): the graph reads it, and LR schedulers update it in place"
                       if k == "lr" else " Build a new step after changing it")
                return (f"the optimizer's {k} changed from {da.get(k)!r} to {db.get(k)!r} (param group {i}) after the "
                        f"capture: a Python number is baked into the captured step, so the graph would keep using "
                        f"{da.get(k)!r}.{fix}")
    return f"the optimizer's param groups changed after the capture ({len(old)} -> {len(new)} groups); build a new step"


def _zero_initial_state(optimizer: Any) -> bool:
    """Optimizers whose lazily created state starts at zeros (step 0, moments 0)."""
    torch = _torch()
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _unknown_state_message(optimizer: Any) -> str:
    return (f"the warm-up would create {type(optimizer).__name__}'s state, and patchdsl only knows the initial state "
            f"of Adam and AdamW (zeros), so it could not undo the warm-up steps. Take one eager optimizer step before "
            f"graph_step, or pass preserve_state=False (the warm-up steps then train the model on the example batch)")


def _cuda_device(model: Any) -> Any:
    torch = _torch()
    if not torch.cuda.is_available():
        raise GraphStepError(f"CUDA graphs need a CUDA device, and torch.cuda.is_available() is False (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); train without "
                             f"graph_step on this machine")
    devs = {}
    for n, p in model.named_parameters():
        devs.setdefault(p.device, n)
    if not devs:
        raise GraphStepError("the model has no parameters")
    if len(devs) > 1:
        raise GraphStepError("the model's parameters are on several devices ("
                             + ", ".join(f"{d} (e.g. {n})" for d, n in devs.items())
                             + "); graph_step captures a step on one CUDA device")
    (dev, name), = devs.items()
    if dev.type != "cuda":
        raise GraphStepError(f"the model is on {dev} (e.g. {name}), not on a CUDA device: CUDA graphs capture GPU "
                             f"work only. Move it first (model.to('cuda'))")
    return dev


class _SyncSpy:
    """A dispatch mode that records the first ATen op whose CUDA implementation raised the sync error."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        spy = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                try:
                    return func(*args, **(kwargs or {}))
                except RuntimeError as e:
                    if spy.op is None and _is_sync_error(e):
                        spy.op = str(func)
                    raise

        self.op: str | None = None
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
