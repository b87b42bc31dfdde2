"""Preference and RL losses on per-token log-probabilities from ``fused_linear_logprobs``, and the
distillation loss of ``fused_linear_jsd`` (:func:`distill_loss`).

A causal LM patched with ``lm_head: Linear -> fused_linear_logprobs`` answers
``model(input_ids=..., attention_mask=..., labels=labels, fused_lm_head=True)`` with per-token
``log_probs`` / ``entropy`` / ``lse`` (and ``logits=None``) without materialising the logits
(:func:`token_logprobs` wraps that call).  The functions here turn those into the losses TRL
computes, with TRL's formulas (trl 1.x ``DPOTrainer._compute_loss`` loss_type ``"sigmoid"``,
``GRPOTrainer._compute_loss`` loss types ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo``), so that the
numbers match TRL's within rounding; ``tests/training/test_posttrain.py`` checks them against a float64
re-implementation and against TRL's own trainers.  See docs/post-training.md.

Everything is plain tensor arithmetic (no ``.item()``, no host synchronisation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def completion_labels(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with every position outside the completion set to -100 (TRL's labels)."""
    return input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   completion_mask: torch.Tensor | None = None, **kwargs: Any):
    """Per-token outputs of a model patched with ``fused_linear_logprobs``.

    Returns the model's ``FusedLogprobsOutput``: ``log_probs``, ``entropy``, ``lse`` ... of shape
    (batch, seq - 1); position t scores ``input_ids[:, t + 1]``, and is 0 where that token is
    outside ``completion_mask`` (all tokens when it is None) or is padding.
    """
    mask = attention_mask if completion_mask is None else completion_mask
    labels = input_ids if mask is None else completion_labels(input_ids, mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, **kwargs)


def patch_trainer(trainer: Any, spec: Any, **apply_kwargs: Any) -> list:
    """Apply ``spec`` to a built TRL trainer's policy (the PEFT base model when wrapped) and its
    ``ref_model``; returns the :class:`~patchdsl.runtime.patch.PatchHandle` of each (undo them to
    restore TRL's own fused head).

    Call it after constructing the trainer (TRL installs its fused LM head in ``__init__``;
    patchdsl's forward wraps it).  Under mixed precision accelerate has already wrapped the
    reference model's forward in autocast when the trainer was built; patching replaces that
    forward, so the autocast is put back around patchdsl's (the policy is prepared later, in
    ``train()``, and keeps its own).
    """
    from ..runtime.patch import apply, set_recorded

    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    handles = [apply(spec, base, **apply_kwargs)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        h = apply(spec, ref, **apply_kwargs)
        acc = getattr(trainer, "accelerator", None)
        if acc is not None and getattr(acc, "native_amp", False) and "_original_forward" in ref.__dict__:
            fused = ref.forward

            def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
                with acc.autocast():
                    return fused(*args, **kwargs)

            set_recorded(h, None, ref, "forward", forward_under_autocast)
        handles.append(h)
    return handles


def sequence_logps(per_token_logps: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the per-token log-probs over each sequence (masked positions already give 0)."""
    if mask is not None:
        per_token_logps = per_token_logps * mask
    return per_token_logps.sum(-1)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, label_smoothing: float = 0.0):
    """DPO's sigmoid loss: ``mean(-logsigmoid(beta * delta))`` with
    ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)`` (sequence log-probs).

    ``label_smoothing = eps > 0`` gives the conservative DPO (cDPO) form
    ``-(1 - eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta)`` (TRL's ``aot``/``robust``
    neighbours use the same two terms; trl < 1.0 applied it to ``sigmoid``); eps = 0 is exactly
    trl 1.x's ``sigmoid``.  Returns ``(loss, chosen_rewards, rejected_rewards)`` with the rewards
    ``beta * logratio`` detached, as TRL logs them.
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    losses = -F.logsigmoid(beta * delta)
    if label_smoothing:
        losses = losses * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    return losses.mean(), (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()


def grpo_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor,
              old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
              beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
              loss_type: str = "dapo", num_items_in_batch: Any = None, max_completion_length: int | None = None,
              delta: float | None = None, kl_bias_correction: bool = True) -> torch.Tensor:
    """GRPO's clipped surrogate with an optional KL term, aggregated per ``loss_type`` as TRL does.

    Token-level importance sampling: ``r = exp(logp - old_logp)`` (``old`` = ``logp.detach()`` when
    not given, i.e. one iteration per generation), per-token loss
    ``-min(r A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) A)`` (``r`` first clamped to ``delta``
    when given: two-sided clipping), plus ``beta * (exp(ref - logp) - (ref - logp) - 1)`` when
    ``beta != 0``, times ``r`` when ``kl_bias_correction`` (trl 1.x's ``use_bias_correction_kl``,
    default True: the unbiased reverse-KL gradient off-policy).  Aggregation over ``completion_mask``:

    * ``grpo``: mean over sequences of each sequence's token mean;
    * ``bnpo``: sum / number of completion tokens;
    * ``dr_grpo``: sum / (batch * max_completion_length);
    * ``dapo``: sum / ``num_items_in_batch`` (the completion-token count of the whole generation
      batch; default: this batch's count).

    TRL also divides by the gradient-accumulation steps (and, for dapo, rescales
    ``num_items_in_batch`` to one accumulation window); that is the trainer's bookkeeping, not the
    loss: pass the normaliser you want.  ``advantages`` is (batch,) or (batch, tokens).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(GRPO_LOSS_TYPES)}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    coef_1 = torch.exp(per_token_logps - old)
    kl_weight = coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        d = ref_per_token_logps - per_token_logps
        kl = torch.exp(d) - d - 1
        if kl_bias_correction:
            kl = kl * kl_weight
        per_token_loss = per_token_loss + beta * kl
    mask = completion_mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    denom = mask.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denom):
        denom = denom.clamp(min=1.0)
    return masked.sum() / denom


# --------------------------------------------------------------------------- distillation
def jsd_patch_info(model: Any) -> dict | None:
    """The flags (beta, temperature, ignore_index) of the ``fused_linear_jsd`` forward ``model`` runs,
    looking through ``.module`` wrappers (DDP, DeepSpeed's engine); None when it is not patched."""
    for _ in range(4):
        info = getattr(getattr(model, "forward", None), "_patchdsl_jsd", None)
        if isinstance(info, dict):
            return info
        if not hasattr(model, "module"):
            return None
        model = model.module
    return None


def distill_loss(student: Any, teacher: Any, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temperature: float | None = None,
                 num_items_in_batch: Any = None, **kwargs: Any) -> torch.Tensor:
    """The distillation loss of ``student`` (patched with ``lm_head: Linear -> fused_linear_jsd(...)``)
    towards ``teacher`` (any causal LM with ``.model`` and ``.lm_head``, unpatched or not) on one batch.

    Runs the teacher's body under ``no_grad`` (its last hidden state, after the final norm), then the
    student with ``teacher_hidden_states`` / ``teacher_head=teacher.lm_head``: the generalised JSD of
    the spec's ``beta`` between the two next-token distributions at every position whose next label
    is not ignored (``labels[:, t + 1] != -100``; every position when ``labels`` is None), divided by
    ``num_items_in_batch`` (default: the number of such positions).  ``temperature`` overrides the
    spec's for this call.  Equals TRL's ``GKDTrainer.generalized_jsd_loss(student_logits[:, :-1],
    teacher_logits[:, :-1], labels[:, 1:], beta, temperature)`` (reduction ``batchmean``).
    Gradients reach the student only.  Extra keyword arguments go to both models.
    """
    if not jsd_patch_info(student):
        raise ValueError("distill_loss: the student is not patched with fused_linear_jsd; apply a spec with "
                         "'lm_head: Linear -> fused_linear_jsd(beta=..., temperature=...)' first "
                         "(patchdsl.apply(spec, student))")
    while not hasattr(teacher, "lm_head") and isinstance(getattr(teacher, "module", None), torch.nn.Module):
        teacher = teacher.module                          # DDP / DeepSpeed engine: the model inside
    for name in ("model", "lm_head"):
        if not hasattr(teacher, name):
            raise ValueError(f"distill_loss: the teacher ({type(teacher).__name__}) has no .{name}; pass a causal LM "
                             "such as AutoModelForCausalLM")
    with torch.no_grad():
        body = teacher.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        h_t = body.last_hidden_state if hasattr(body, "last_hidden_state") else body[0]
    extra = dict(kwargs)
    if temperature is not None:
        extra["distill_temperature"] = temperature
    if num_items_in_batch is not None:
        extra["num_items_in_batch"] = num_items_in_batch
    out = student(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False,
                  teacher_hidden_states=h_t, teacher_head=teacher.lm_head, **extra)
    return out.loss


class FusedGKDLoss:
    """Mixin for TRL's ``GKDTrainer`` (``trl.experimental.gkd``): its ``compute_loss`` through
    :func:`distill_loss`, so neither model's logits are materialised::

        class Trainer(FusedGKDLoss, GKDTrainer): ...
        trainer = Trainer(model=student, teacher_model=teacher, args=GKDConfig(beta=0.5, ...), ...)
        patchdsl.apply("lm_head: Linear -> fused_linear_jsd(beta=0.5)", trainer.model)   # the spec's beta = args.beta

    TRL's own ``compute_loss`` pairs ``logits[:, :-1]`` with ``labels[:, 1:]``, calls
    ``generalized_jsd_loss(..., beta=self.beta, num_items_in_batch=...)`` at temperature 1 (GKDConfig's
    temperature is for sampling) and returns the student's outputs with ``return_outputs``; this
    gives the same loss (tests/training/test_distill.py) and, with ``return_outputs``, the student's output
    without logits.  The patched student's beta must equal ``self.beta`` and its temperature 1
    (checked: a ValueError says which differs).
    """

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
        info = jsd_patch_info(model)
        if info:
            want = float(getattr(self, "beta", info["beta"]))
            if info["beta"] != want or info["temperature"] != 1.0:
                raise ValueError(f"FusedGKDLoss: the student is patched with fused_linear_jsd(beta={info['beta']}, "
                                 f"temperature={info['temperature']}) but the trainer's loss uses beta={want}, "
                                 "temperature=1.0; make the spec's flags match GKDConfig.beta")
        teacher = self.teacher_model
        teacher.eval()
        loss = distill_loss(model, teacher, inputs["input_ids"], inputs.get("labels"), inputs.get("attention_mask"),
                            num_items_in_batch=num_items_in_batch)
        return (loss, None) if return_outputs else loss
