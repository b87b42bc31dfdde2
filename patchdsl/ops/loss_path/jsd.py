"""The forward of ``fused_linear_jsd``: the distillation loss from the student's and the teacher's
hidden states and heads, in token chunks."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..common import signature_binder
from ...model.modules import unwrap
from .labels_loss import _body_fields, _run_body, add_router_loss, original_forward, resolve_router_flag, slice_hidden
from ...model.forward.causal_lm import forward_shape

# --------------------------------------------------------------------------- distillation (JSD)
JSD_KWARGS = ("teacher_hidden_states", "teacher_head", "distill_temperature")


def _teacher_weights(head: Any, where: str) -> tuple[Any, Any]:
    """(weight, bias) of the teacher head given at the call: an nn.Linear (PEFT's wrapper unwrapped)
    or a (vocab, hidden) weight tensor."""
    import torch

    if isinstance(head, torch.Tensor):
        return head, None
    lm = unwrap(head)
    if isinstance(lm, torch.nn.Linear):
        return lm.weight, lm.bias
    raise TypeError(f"{where}: teacher_head must be the teacher's lm_head (an nn.Linear) or its weight tensor, "
                    f"got {type(head).__name__}")


def reference_jsd(hidden: Any, w: Any, b: Any, h_t: Any, w_t: Any, b_t: Any, targets: Any, num_items: Any,
                  temperature: float, beta: float, ignore: int) -> Any:
    """The distillation loss from materialised logits in plain PyTorch (TRL's generalized_jsd_loss
    formula, fp32 math or wider): what verify's unpatched copies compute (``make_jsd_forward(host, None, ...)``)."""
    import math

    import torch
    import torch.nn.functional as F

    zs = F.linear(hidden, w, b)
    with torch.no_grad():
        zt = F.linear(h_t.to(w_t.dtype), w_t, b_t)
    wide = torch.promote_types(zs.dtype, torch.float32)
    s = (zs.to(wide) / temperature).log_softmax(-1)
    t = (zt.to(wide) / temperature).log_softmax(-1)
    if beta == 0:
        jsd = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        jsd = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        jsd = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    if targets is None:
        mask = torch.ones(jsd.shape, dtype=torch.bool, device=jsd.device)
    else:
        mask = targets != ignore
    total = torch.where(mask, jsd, torch.zeros_like(jsd)).sum()
    den = mask.sum().clamp(min=1) if num_items is None else num_items
    return total / den


def make_jsd_forward(host: Any, kernels: Callable | None, flags: Mapping[str, Any], site: str = "lm_head") -> Callable:
    """The replacement forward of ``fused_linear_jsd`` (see :mod:`patchdsl.ops.linear_jsd`).

    A call with ``teacher_hidden_states`` (the teacher's last hidden state, after its final norm,
    (batch, seq, H_t)) and ``teacher_head`` (the teacher's lm_head or its weight): run
    ``self.model`` with every other argument, slice both hidden states by ``logits_to_keep`` as HF
    does, pair position t with ``labels[:, t + 1]`` (HF's shift; ``shift_labels`` is used as given;
    without labels every position counts) and return the host's output class with ``loss`` = the
    generalised JSD from the generated kernels and ``logits=None``, in training and in eval, with or
    without grad.  ``distill_temperature=`` overrides the flag's temperature for that call.  Any
    other call: the original forward.  Shape errors name the site and say what was expected.
    ``kernels=None``: the same call answered by :func:`reference_jsd` (verify's unpatched copies).
    Mixture of experts: with ``output_router_logits`` on (the call's, else the config's) the loss is
    the JSD plus ``router_aux_loss_coef * aux_loss`` and ``aux_loss`` is set, as the model's forward
    adds its router loss to whatever loss it computes.
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    temperature = float(flags.get("temperature", 1.0))
    teacher_hidden = flags.get("teacher_hidden", "auto")
    beta = float(flags.get("beta", 0.5))
    supported = {torch.float32, torch.bfloat16, torch.float16}
    where = f"fused_linear_jsd on {site or '<model>'} ({type(host).__name__})"

    def forward(self, *args, **kwargs):
        if kwargs.get("teacher_hidden_states") is None and kwargs.get("teacher_head") is None:
            if "distill_temperature" in kwargs:
                raise ValueError(f"{where}: distill_temperature given without teacher_hidden_states and teacher_head")
            for k in JSD_KWARGS:
                kwargs.pop(k, None)
            return original(self, *args, **kwargs)
        kw = dict(kwargs)
        h_t = kw.pop("teacher_hidden_states", None)
        head = kw.pop("teacher_head", None)
        t = float(kw.pop("distill_temperature", temperature))
        if h_t is None or head is None:
            raise ValueError(f"{where}: give both teacher_hidden_states and teacher_head (got only "
                             f"{'teacher_head' if h_t is None else 'teacher_hidden_states'})")
        if not t > 0:
            raise ValueError(f"{where}: distill_temperature must be > 0, got {t}")
        a = bind(self, *args, **kw)
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.pop("labels", None)
        shift = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        if extra.get("ignore_index", ignore) != ignore:
            raise ValueError(f"{where}: the kernels are specialised for ignore_index={ignore}, the call asks for "
                             f"{extra['ignore_index']}")
        extra.pop("ignore_index", None)
        lm = unwrap(self.lm_head)
        if kernels is not None and lm.weight.dtype not in supported:
            raise ValueError(f"{where}: the student lm_head weight is {lm.weight.dtype}; the kernels support "
                             "float32, bfloat16, float16")
        w_t, b_t = _teacher_weights(head, where)
        if w_t.dim() != 2 or w_t.shape[0] != lm.weight.shape[0]:
            raise ValueError(f"{where}: vocab mismatch: the teacher head has {tuple(w_t.shape)[0] if w_t.dim() else '?'} "
                             f"outputs, the student's lm_head {lm.weight.shape[0]}; teacher and student must share "
                             "one vocabulary (and its padded size)")
        if teacher_hidden != "auto" and w_t.shape[1] != int(teacher_hidden):
            raise ValueError(f"{where}: the teacher head takes hidden size {w_t.shape[1]}, but the spec says "
                             f"teacher_hidden={teacher_hidden}")
        if h_t.shape[-1] != w_t.shape[1]:
            raise ValueError(f"{where}: teacher_hidden_states have size {h_t.shape[-1]} in their last dimension, "
                             f"the teacher head expects {w_t.shape[1]} (pass the teacher's last hidden state, "
                             "after its final norm: teacher.model(...).last_hidden_state)")
        held = resolve_router_flag(self, shape, a, extra)
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra, labels)
        if h_t.dim() != hidden.dim() or h_t.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(f"{where}: teacher_hidden_states are {tuple(h_t.shape)} but the student's hidden states "
                             f"are {tuple(hidden.shape)}: run the teacher on the same input_ids")
        hidden = slice_hidden(hidden, logits_to_keep)
        h_t = slice_hidden(h_t, logits_to_keep)
        if shift is not None:
            targets = shift
        elif labels is not None:
            hidden, h_t, targets = hidden[:, :-1], h_t[:, :-1], labels[..., 1:]
        else:
            targets = None
        if targets is not None:
            targets = targets.to(hidden.device)
            if targets.shape != hidden.shape[:-1]:
                raise ValueError(f"{where}: labels give {tuple(targets.shape)} targets for hidden states "
                                 f"{tuple(hidden.shape)}")
        w, b = lm.weight, lm.bias
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):          # lm_head(...) would run in the autocast dtype
            dt = torch.get_autocast_dtype(dev)
            w, w_t = w.to(dt), w_t.to(dt)
            b = b.to(dt) if b is not None else None
            b_t = b_t.to(dt) if b_t is not None else None
        h_t = h_t.to(hidden.device)
        if kernels is None:
            loss = reference_jsd(hidden, w, b, h_t, w_t, b_t, targets, num_items, t, beta, ignore)
        else:
            loss = kernels(w.dtype).linear_jsd(hidden, w, b, h_t, w_t, b_t, targets, num_items, t)
        rest = _body_fields(outputs, shape)
        loss = add_router_loss(self, shape, outputs, {**a, **held}, extra, loss, rest)     # MoE, as the forward adds it
        out = shape.output_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with the fused distillation loss (patchdsl fused_linear_jsd): "
                       "teacher_hidden_states= and teacher_head= return loss = generalised JSD, logits=None.")
    forward._patchdsl_jsd = {"beta": float(flags.get("beta", 0.5)), "temperature": temperature, "ignore_index": ignore}
    return forward
