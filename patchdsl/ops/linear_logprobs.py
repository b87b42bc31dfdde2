"""fused_linear_logprobs: per-token log-probabilities (and entropy, logsumexp) from the LM head
without materialising the logits; the base of the post-training losses (:mod:`patchdsl.posttrain`).

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

from .base import FlagSpec, ModuleInfo, Op
from .cross_entropy import ce_block, num_tag
from .linear_cross_entropy import CHUNK_FLAGS, chunk_params, head_sizes
from .registry import register


class FusedLinearLogprobs(Op):
    wraps_instance_forward = True      # answers TRL's fused_lm_head calls over the forward TRL installs
    name = "fused_linear_logprobs"
    kinds = ("Linear",)
    template = "fused_linear_logprobs.py.j2"
    doc = ("Per-token log-probability of given targets, entropy and logsumexp (plus TRL's mean logit, "
           "log sum p^2 and top-1 flag) from the hidden states and lm_head, in token chunks, never holding more "
           "than one chunk of logits; the backward recomputes each chunk. The patched causal LM answers "
           "`model(..., labels=..., fused_lm_head=True)` (TRL's fused-LM-head protocol) with these fields and "
           "logits=None; see docs/post-training.md.")
    flags = (
        FlagSpec("ignore_index", "int", -100, "target value that gives 0 and no gradient (HF/TRL: -100)"),
        FlagSpec("temperature", "float", 1.0, "the logits are divided by this for `fused_lm_head=True` calls "
                 "(set it to TRL's GRPOConfig.temperature); the `labels` loss always uses 1", min=1e-6),
        *CHUNK_FLAGS,
        FlagSpec("block", "int", "auto", "row block in elements (power of two); auto = by vocab size",
                 auto_ok=True, min=16),
    )

    def host(self, info: ModuleInfo, index: Any) -> str:
        from .loss_path import causal_lm_host
        return causal_lm_host(info, index)

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        vocab, hidden, bias = head_sizes(info)
        block, _, warps = ce_block(vocab, flags, target)
        chunk, acc = chunk_params(vocab, hidden, flags, dtype, target)
        return {"dtype": dtype, "w_dtype": dtype, "vocab": int(vocab), "hidden": int(hidden), "bias": bias,
                "BLOCK": block, "n_tiles": -(-vocab // block), "num_warps": warps, "chunk": chunk,
                "accumulate": acc, "ignore_index": int(flags.get("ignore_index", -100)),
                "target": target, "tag": f"v{vocab}"}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        parts = [self.name, params["dtype"], f"h{params['hidden']}", f"v{params['vocab']}", f"c{params['chunk']}"]
        if params["bias"]:
            parts.append("bias")
        parts.append(f"acc{params['accumulate']}")
        if params["ignore_index"] != -100:
            parts.append(f"ign{num_tag(params['ignore_index'])}")
        if params["n_tiles"] > 1:
            parts.append(f"b{params['BLOCK']}")
        parts.append(params.get("target", "cuda"))
        return "_".join(str(p) for p in parts)

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        from .loss_path import host_reason
        f = info.facts("CausalLM")
        if not f:
            return "no enclosing causal LM (a module with model, lm_head and config) was found"
        if f.get("softcap") or f.get("logits_scaling") not in (None, 1, 1.0):
            return ("the model transforms its logits (final_logit_softcapping / logits_scaling), which "
                    "fused_linear_logprobs does not reproduce")
        if hasattr(module, "lm_head") and hasattr(module, "model"):
            return host_reason(module, info, flags, self.name)
        import torch
        if not isinstance(module, torch.nn.Linear):
            return f"{type(module).__name__} is not a plain nn.Linear (a LoRA delta would be missed)"
        if (info.path.rsplit(".", 1)[-1] != "lm_head" or module.out_features != f["vocab"]
                or module.in_features != f["hidden"]):
            return "this Linear is not the causal LM's lm_head"
        return None

    def make_forward(self, module, kernels, flags, info):
        from .loss_path import make_logprobs_forward
        return make_logprobs_forward(module, kernels, flags)

    def install(self, host, kernels, flags, info):
        import types

        from .loss_path import make_logprobs_forward, require_host
        require_host(host, info, flags, self.name)
        return [(host, "forward", types.MethodType(make_logprobs_forward(host, kernels, flags), host))]


register(FusedLinearLogprobs())
