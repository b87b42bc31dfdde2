"""The forward of ``fused_linear_logprobs``: per-token log-probabilities (and TRL's fused-LM-head
fields) from the hidden states and lm_head in token chunks, logits never whole."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..common import signature_binder
from ...model.modules import unwrap
from .labels_loss import _body_fields, _run_body, add_router_loss, original_forward, resolve_router_flag, slice_hidden
from ...model.forward.causal_lm import forward_shape

# --------------------------------------------------------------------------- per-token log-probs
_FUSED_OUTPUT: list = []

FUSED_FIELDS = ("loss", "log_probs", "entropy", "lse", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
                "aux_loss", "logits", "past_key_values", "hidden_states", "attentions", "router_logits")


def fused_output_cls() -> type:
    """The output of ``model(..., labels=..., fused_lm_head=True)`` on a model patched with
    ``fused_linear_logprobs``: TRL's ``FusedCausalLMOutput`` fields plus ``lse`` and the usual
    ``logits`` (None), ``past_key_values``, ``hidden_states``, ``attentions``.

    Every per-token field has the shape of the shifted labels ((batch, seq - 1), or (batch, seq)
    with ``shift_labels``) and is 0 where the label is ignored:
    ``log_probs`` log p(label), ``entropy`` H(p), ``lse`` logsumexp of the temperature-scaled
    logits (these three carry gradients); ``log_sum_sq_probs`` log sum p^2, ``mean_logits`` the
    mean temperature-scaled logit, ``is_top1`` whether the label is the argmax, ``label_mask``
    label != ignore_index (no gradient).  ``loss`` = -sum(log_probs) / num_items_in_batch (the
    number of labels that are not ignored when not given; NaN when all are ignored, as HF's loss).
    Mixture of experts: when ``output_router_logits`` is on (the call's value, else the config's,
    as the model's forward resolves it) ``aux_loss`` is the router's load-balancing loss the model's
    forward computes, ``router_logits`` the body's, and ``loss`` includes
    ``router_aux_loss_coef * aux_loss`` (TRL's FusedCausalLMOutput does the same).
    """
    if not _FUSED_OUTPUT:
        import dataclasses
        from typing import Optional

        import torch
        from transformers.utils import ModelOutput

        cls = dataclasses.make_dataclass(
            "FusedLogprobsOutput", [(f, Optional[Any], dataclasses.field(default=None)) for f in FUSED_FIELDS],
            bases=(ModelOutput,), namespace={"__module__": __name__, "__doc__": fused_output_cls.__doc__})
        del torch
        _FUSED_OUTPUT.append(cls)
    return _FUSED_OUTPUT[0]


def make_logprobs_forward(host: Any, kernels: Callable, flags: Mapping[str, Any]) -> Callable:
    """The replacement forward of ``fused_linear_logprobs`` (see its module docstring).

    ``fused_lm_head=True`` (train or eval, grad or not): run ``self.model`` with every other
    argument, slice by ``logits_to_keep`` as HF does, shift the labels (or take ``shift_labels``
    as given), and return :func:`fused_output_cls` from the generated kernels at the flag's
    temperature.  Training with labels and grad, without ``fused_lm_head``: the HF loss from the
    same kernels (temperature 1), the host's own output class with ``logits=None``.  Otherwise the
    original forward (an instance forward installed before, e.g. TRL's, is wrapped).
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)     # traceable by Dynamo, unlike sig.bind
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    temperature = float(flags.get("temperature", 1.0))
    supported = {torch.float32, torch.bfloat16, torch.float16}
    output_cls = fused_output_cls()        # made now: a class created while Dynamo traces would break the graph

    def forward(self, *args, **kwargs):
        fused = bool(kwargs.get("fused_lm_head", False))
        if not fused and not (self.training and torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        kw = dict(kwargs)
        kw.pop("fused_lm_head", None)
        try:
            a = bind(self, *args, **kw)
        except TypeError:
            return original(self, *args, **kwargs)
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.get("labels")
        shift = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        lm = unwrap(self.lm_head)
        if (labels is None and shift is None) or extra.get("ignore_index", ignore) != ignore \
                or lm.weight.dtype not in supported:
            if fused:
                raise ValueError("fused_lm_head=True needs labels (or shift_labels), ignore_index="
                                 f"{ignore} and a float32/bfloat16/float16 lm_head (patchdsl fused_linear_logprobs)")
            return original(self, *args, **kwargs)
        extra.pop("ignore_index", None)
        a.pop("labels", None)
        if fused:
            if "use_cache" in a:
                a["use_cache"] = False
            else:
                extra["use_cache"] = False
        held = resolve_router_flag(self, shape, a, extra)
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra, labels)
        hidden = slice_hidden(hidden, logits_to_keep)
        if shift is None:
            hidden, targets = hidden[:, :-1], labels[..., 1:]
        else:
            targets = shift
        targets = targets.to(hidden.device)
        w, b = lm.weight, lm.bias
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):          # lm_head(...) would run in the autocast dtype
            dt = torch.get_autocast_dtype(dev)
            w = w.to(dt)
            b = b.to(dt) if b is not None else None
        mod = kernels(w.dtype)
        t = temperature if fused else 1.0
        lp, ent, lse, mean, lssq, top1 = mod.linear_logprobs(hidden, w, b, targets, t)
        mask = targets != ignore
        denom = mask.sum() if num_items is None else num_items     # all ignored: NaN (0 / 0), as HF
        loss = -lp.sum() / denom
        rest = _body_fields(outputs, shape)
        loss = add_router_loss(self, shape, outputs, {**a, **held}, extra, loss, rest)     # MoE, as the forward adds it
        if fused:
            out = output_cls(loss=loss, log_probs=lp, entropy=ent, lse=lse, log_sum_sq_probs=lssq,
                             mean_logits=mean, is_top1=top1, label_mask=mask,
                             **{k: v for k, v in rest.items() if k in FUSED_FIELDS})
        else:
            out = shape.output_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with fused per-token log-probs (patchdsl "
                       "fused_linear_logprobs): fused_lm_head=True returns them; a training call with labels "
                       "gets the loss from them.")
    return forward
