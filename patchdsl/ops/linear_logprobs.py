"""fused_linear_logprobs: per-token log-probabilities (and entropy, logsumexp) from the LM head
without materialising the logits; the base of the post-training losses (:mod:`patchdsl.training.posttrain`).

Selected on ``lm_head`` (kind Linear); replaces the forward of the causal LM that owns it (see
:mod:`patchdsl.ops.loss_path`, ``make_logprobs_forward``):

* ``model(..., labels=labels, fused_lm_head=True)`` returns a :func:`~patchdsl.ops.loss_path.
  fused_output_cls` output (``log_probs``, ``entropy``, ``lse``, ``mean_logits``,
  ``log_sum_sq_probs``, ``is_top1``, ``label_mask``, ``loss``; ``logits=None``) at the flag's
  temperature, in training and in eval, with or without grad.  This is the protocol TRL's
  trainers (DPO, GRPO, RLOO, KTO, SFT) call, so they run on these kernels unchanged.
* training with ``labels`` (no ``fused_lm_head``): HF's causal-LM loss from the same kernels
  (temperature 1), ``logits=None``, as ``fused_linear_cross_entropy`` does.
* anything else: the original forward.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, BLOCK_MAX, INDEX_MIN, INDEX_MAX
from .cross_entropy import LABEL_CHECK_FLAG
from .linear_cross_entropy import CHUNK_FLAGS, ChunkedHeadOp
from .registry import register


class FusedLinearLogprobs(ChunkedHeadOp):
    # wraps_instance_forward: answers TRL's fused_lm_head calls over the forward TRL installs
    name = "fused_linear_logprobs"
    template = "fused_linear_logprobs.py.j2"
    doc = ("Per-token log-probability of given targets, entropy and logsumexp (plus TRL's mean logit, "
           "log sum p^2 and top-1 flag) from the hidden states and lm_head, in token chunks, never holding more "
           "than one chunk of logits; the backward recomputes each chunk. The patched causal LM answers "
           "`model(..., labels=..., fused_lm_head=True)` (TRL's fused-LM-head protocol) with these fields and "
           "logits=None; see docs/post-training.md.")
    flags = (
        FlagSpec("ignore_index", "int", -100, "target value that gives 0 and no gradient (HF/TRL: -100)",
                 min=INDEX_MIN, max=INDEX_MAX),
        FlagSpec("temperature", "float", 1.0, "the logits are divided by this for `fused_lm_head=True` calls "
                 "(set it to TRL's GRPOConfig.temperature); the `labels` loss always uses 1", min=1e-6),
        *CHUNK_FLAGS,
        FlagSpec("block", "int", "auto", "row block in elements (power of two); auto = by vocab size",
                 auto_ok=True, min=16, max=BLOCK_MAX),
        LABEL_CHECK_FLAG,
    )

    def extra_params(self, flags):
        return {"check_labels": bool(flags.get("check_labels", True))}

    def name_tags(self, params):
        return [] if params.get("check_labels", True) else ["nocheck"]

    def make_forward(self, module, kernels, flags, info):
        from .loss_path import make_logprobs_forward
        return make_logprobs_forward(module, kernels, flags)

    def install(self, host, kernels, flags, info):
        import types

        from ..model.forward.causal_lm import require_host
        from .loss_path import make_logprobs_forward
        require_host(host, info, flags, self.name)
        return [(host, "forward", types.MethodType(make_logprobs_forward(host, kernels, flags), host))]


register(FusedLinearLogprobs())
