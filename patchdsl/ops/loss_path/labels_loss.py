"""The replacement forward of the labels loss (``fused_linear_cross_entropy``, ``fused_cross_entropy``)
and the pieces the other loss forwards share: running the decoder body, slicing the hidden states,
the original forward for the calls the fused loss does not take."""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping

from ..common import signature_binder
from ...model.modules import unwrap
from .sharding import call_as_forward, head_gather, unsharded_reason
from ...model.forward.causal_lm import ForwardShape, forward_shape, host_body
from ...model.forward.router_loss import router_loss
from ...model.forward.values import read_value


# --------------------------------------------------------------------------- runtime helpers
def shift_labels_of(labels: Any, ignore_index: int) -> Any:
    """HF's shift: pad one ignore_index on the right, drop the first label."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _run_body(self: Any, a: dict, extra: dict, labels: Any = None) -> tuple[Any, Any, Any, bool]:
    """Run the causal LM's decoder body (``self.model``, or what the forward calls: :func:`host_body`) on the call's arguments once the loss path
    has taken the call: pops ``logits_to_keep`` and ``return_dict`` (the config's default unless the
    call gives one) and returns (the body's outputs, its last hidden state, logits_to_keep,
    return_dict).  What the original forward passes to its body beside its own arguments is passed
    the same way: ``labels`` (Gemma 3, PaliGemma) and constants such as ``return_dict=True``."""
    shape = forward_shape(type(self))
    logits_to_keep = a.pop("logits_to_keep", 0)
    return_dict = getattr(self.config, "return_dict", True)
    rd = a.pop("return_dict", None) if "return_dict" in a else extra.pop("return_dict", None)
    if rd is not None:
        return_dict = rd
    if shape.body_labels:
        a["labels"] = labels
    for k, v in shape.body_consts.items():
        a[k] = v
    body = host_body(self)               # self.model, self.transformer (GPT-2), self.model.decoder (OPT)
    pos = [a.pop(n) for n in shape.body_args]      # self.transformer(input_ids, ...): by position, as the original
    outputs = body(*pos, **a, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    return outputs, hidden, logits_to_keep, return_dict


def _body_fields(outputs: Any, shape: Any) -> dict[str, Any]:
    """The fields of the model's output class (past_key_values, hidden_states, ...) taken from the
    decoder body's outputs, as the loss-path forwards return them beside the loss."""
    return {f: (outputs.get(f) if hasattr(outputs, "get") else getattr(outputs, f, None)) for f in shape.output_fields}


def resolve_router_flag(self: Any, shape: ForwardShape, a: dict, extra: dict) -> dict:
    """MoE (issue 24): ``output_router_logits`` resolved as the original forward resolves it (the
    call's value, else the config's) before the body runs, so the body records the router logits
    exactly when the unpatched forward would have it record them.  Returns what the forward resolves
    but does not give its body (transformers 5.17's Doge: ``{"output_router_logits": v}``, read only
    by its aux loss), taken out of ``a``; pass it to :func:`add_router_loss` with ``a``."""
    if not shape.aux and shape.router_flag is None:
        return {}
    where = a if "output_router_logits" in a or "output_router_logits" in shape.sig.parameters else extra
    v = where.get("output_router_logits")
    if v is None:
        v = read_value(self, getattr(shape, "router_config", "self.config") + ".output_router_logits")
    for name in shape.router_flag or ():      # Doge: (...) and self.config.is_moe
        v = v and getattr(self.config, name)
    if not shape.router_flag_to_body:
        where.pop("output_router_logits", None)
        return {"output_router_logits": v}
    where["output_router_logits"] = v
    return {}


def add_router_loss(self: Any, shape: ForwardShape, outputs: Any, a: Mapping[str, Any], extra: Mapping[str, Any],
                    loss: Any, rest: dict) -> Any:
    """``loss`` plus the router's auxiliary load-balancing loss as the original forward adds it
    (``router_aux_loss_coef * aux_loss``, :func:`router_loss`) when ``output_router_logits`` is on,
    with ``rest["aux_loss"]`` set to it; ``loss`` unchanged when it is off (or the model has none)."""
    aux_loss = router_loss(self, shape, outputs, {**extra, **a})
    if aux_loss is None:
        return loss
    rest["aux_loss"] = aux_loss
    coef = read_value(self, shape.aux.get("coef", "self.router_aux_loss_coef"))
    return loss + coef * aux_loss.to(loss.device)


def slice_hidden(hidden: Any, logits_to_keep: Any) -> Any:
    """The slicing the HF forward applies before lm_head (int: last k, 0 = all; tensors)."""
    import torch

    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        if logits_to_keep == 0:
            return hidden
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


def head_logits(host: Any, hidden: Any, shape: ForwardShape) -> Any:
    """The logits as the original forward computes them from the (sliced) hidden states: its
    steps (:func:`head_transform`, :func:`_read_head`) replayed in order around ``host.lm_head``."""
    import torch

    for where, kind, source in shape.steps:
        if where == "hidden":
            v = read_value(host, source)
            hidden = hidden * v if kind == "mul" else hidden / v
    logits = host.lm_head(hidden)
    for where, kind, source in shape.steps:
        if where != "logits":
            continue
        v = read_value(host, source)
        if kind == "softcap":
            if v is not None:
                logits = torch.tanh(logits / v) * v
        else:
            logits = logits * v if kind == "mul" else logits / v
    return logits


def original_forward(host: Any) -> Callable:
    """``original(self, *args, **kwargs)``: what ``host`` ran before it was patched: an instance-level
    forward set earlier (accelerate's fp32 output wrapper, TRL's fused head) when there is one,
    else its class's forward."""
    prev = host.__dict__.get("forward")

    def original(self, *args, **kwargs):
        if prev is not None:
            return prev(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    return original


def make_forward(host: Any, kernels: Callable, flags: Mapping[str, Any], mode: str) -> Callable:
    """The replacement ``forward(self, *args, **kwargs)`` for the causal LM ``host``.

    ``mode="linear"``: fused linear cross entropy from the hidden states (logits=None).
    ``mode="logits"``: logits from ``self.lm_head`` (returned), loss by the fused cross entropy.
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)     # traceable by Dynamo, unlike sig.bind
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    supported = {torch.float32, torch.bfloat16, torch.float16}

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        try:
            a = bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)          # let the original raise its own error
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.get("labels")
        shift = extra.get("shift_labels")
        if labels is None and shift is None:
            return original(self, *args, **kwargs)
        if extra.get("ignore_index", ignore) != ignore:
            return original(self, *args, **kwargs)          # compiled for another ignore_index
        lm = unwrap(self.lm_head)
        if lm.weight.dtype not in supported:
            return original(self, *args, **kwargs)
        a.pop("labels", None)
        held = resolve_router_flag(self, shape, a, extra)
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra, labels)
        hidden = slice_hidden(hidden, logits_to_keep)
        if shift is None:
            shift = shift_labels_of(labels, ignore)
        shift = shift.to(hidden.device)
        num_items = extra.get("num_items_in_batch")
        if mode == "linear":
            logits = None
            dev = hidden.device.type
            autocast = torch.get_autocast_dtype(dev) if dev != "meta" and torch.is_autocast_enabled(dev) else None

            def fused(h, y, n):
                w, b = lm.weight, lm.bias                # read now: whole here, whoever shards them
                why = unsharded_reason(w)
                if why:
                    raise RuntimeError(f"fused_linear_cross_entropy: {why}")
                if autocast is not None:                 # lm_head(...) would run in the autocast dtype
                    w = w.to(autocast)
                    b = b.to(autocast) if b is not None else None
                return kernels(w.dtype).linear_cross_entropy(h, w, b, y, n)

            # the weight whole only inside a module's own call (an FSDP2 unit, possibly PEFT's wrapper
            # around lm_head; a ZeRO-3 partition): run the loss as that module's forward
            owner = self.lm_head if head_gather(self.lm_head) == "fsdp2" else lm
            if head_gather(owner):
                loss = call_as_forward(owner, fused, hidden, shift, num_items)
            else:
                loss = fused(hidden, shift, num_items)
        else:
            logits = head_logits(self, hidden, shape)
            loss = kernels(logits.dtype).cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                                       num_items)
        rest = _body_fields(outputs, shape)
        loss = add_router_loss(self, shape, outputs, {**a, **held}, extra, loss, rest)
        out = shape.output_cls(loss=loss, logits=logits, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with the fused {'linear ' if mode == 'linear' else ''}"
                       "cross-entropy loss when training with labels (patchdsl).")
    return forward


def make_loss_function(kernels: Callable, flags: Mapping[str, Any], original: Callable, vocab: int) -> Callable:
    """A drop-in for HF's ForCausalLMLoss computing the loss with the fused cross-entropy kernel."""
    import torch

    ignore = int(flags.get("ignore_index", -100))
    supported = {torch.float32, torch.bfloat16, torch.float16}

    def fused_causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=None,
                             shift_labels=None, **kwargs):
        if ((ignore_index is not None and ignore_index != ignore) or logits.shape[-1] != vocab
                or logits.dtype not in supported or (vocab_size is not None and vocab_size != vocab)):
            kw = dict(kwargs)
            if ignore_index is not None:
                kw["ignore_index"] = ignore_index
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            shift_labels=shift_labels, **kw)
        if shift_labels is None:
            shift_labels = shift_labels_of(labels, ignore)
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        return kernels(logits.dtype).cross_entropy(logits.reshape(-1, vocab), shift_labels, num_items_in_batch)

    return fused_causal_lm_loss


def install_forward(host: Any, kernels: Callable, flags: Mapping[str, Any], mode: str) -> list:
    return [(host, "forward", types.MethodType(make_forward(host, kernels, flags, mode), host))]
