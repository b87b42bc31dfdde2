"""fused_linear_jsd: distillation (generalised JSD between a teacher's and the student's next-token
distributions) from both models' hidden states and LM heads, without materialising either logits.

Selected on the student's ``lm_head`` (kind Linear); specialised for the student's vocab and hidden
size, beta and ignore_index (the temperature is a runtime argument, the flag's value by default).
Replaces the forward of the causal LM that owns it (see :func:`patchdsl.ops.loss_path.
make_jsd_forward`):

* ``student(input_ids, labels=labels, teacher_hidden_states=h_t, teacher_head=teacher.lm_head)``
  returns the model's own output class with ``loss`` = the distillation loss and ``logits=None``
  (training or eval, with or without grad);
* any call without ``teacher_hidden_states``: the original forward (generation, HF's loss).

``patchdsl.training.posttrain.distill_loss(student, teacher, input_ids, labels)`` runs the teacher's body
and makes that call.  Convention (beta = 0 forward KL(teacher || student), beta = 1 reverse KL):
TRL's ``GKDTrainer.generalized_jsd_loss`` and Liger-Kernel's ``LigerFusedLinearJSD``; see
docs/post-training.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, BLOCK_MAX, INDEX_MIN, INDEX_MAX, TEACHER_HIDDEN_MAX
from ..model.info import ModuleInfo
from .cross_entropy import num_tag
from .linear_cross_entropy import CHUNK_FLAGS, ChunkedHeadOp
from .registry import register


class FusedLinearJSD(ChunkedHeadOp):
    # wraps_instance_forward: calls without a teacher go to the forward found on the instance
    name = "fused_linear_jsd"
    template = "fused_linear_jsd.py.j2"
    doc = ("Distillation loss: generalised Jensen-Shannon divergence (beta = 0 forward KL(teacher||student), "
           "1 reverse KL; TRL GKD's convention) between the teacher's and the student's next-token distributions, "
           "from both hidden states and LM heads in token chunks (one chunk of student and teacher logits at a "
           "time); gradients to the student's hidden states and head only. The patched causal LM answers "
           "`model(..., labels=..., teacher_hidden_states=h_t, teacher_head=teacher.lm_head)` with that loss and "
           "logits=None; see docs/post-training.md.")
    flags = (
        FlagSpec("beta", "float", 0.5, "interpolation of the generalised JSD: 0 = forward KL(teacher || student), "
                 "1 = reverse KL(student || teacher), between: beta KL(t || m) + (1 - beta) KL(s || m) with "
                 "m = beta t + (1 - beta) s", min=0.0, max=1.0),
        FlagSpec("temperature", "float", 1.0, "both models' logits are divided by this (default of the call's "
                 "`distill_temperature`); no temperature^2 factor, as TRL and Liger", min=1e-6),
        FlagSpec("ignore_index", "int", -100, "label value whose token is left out of the loss (HF/TRL: -100)",
                 min=INDEX_MIN, max=INDEX_MAX),
        FlagSpec("teacher_hidden", "int", "auto", "the teacher's hidden size, checked at every call; auto = "
                 "whatever the teacher head given at the call has", auto_ok=True, min=1, max=TEACHER_HIDDEN_MAX),
        *CHUNK_FLAGS,
        FlagSpec("block", "int", "auto", "row block in elements (power of two); auto = by vocab size",
                 auto_ok=True, min=16, max=BLOCK_MAX),
    )

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        from .loss_path import lm_head_misfit
        return lm_head_misfit(self.name, info, index)

    def extra_params(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        import math

        beta = float(flags.get("beta", 0.5))
        p = {"beta": beta}
        if 0.0 < beta < 1.0:
            p["log_beta"] = math.log(beta)
            p["log_one_minus_beta"] = math.log1p(-beta)
        return p

    def name_tags(self, params: Mapping[str, Any]) -> list[str]:
        return [f"beta{num_tag(params['beta'])}"]

    def make_forward(self, module, kernels, flags, info):
        from .loss_path import make_jsd_forward
        return make_jsd_forward(module, kernels, flags, info.path)

    def install(self, host, kernels, flags, info):
        import types

        from ..model.forward.causal_lm import require_host
        from .loss_path import make_jsd_forward
        require_host(host, info, flags, self.name)
        return [(host, "forward", types.MethodType(make_jsd_forward(host, kernels, flags, info.path), host))]


    # verify: a synthetic teacher (seeded hidden states and head), the unpatched copies computing the
    # same loss from materialised logits in plain PyTorch (TRL's generalized_jsd_loss formula)
    def parity_reference(self, host, flags):
        import types

        from .loss_path import make_jsd_forward
        return [(host, "forward", types.MethodType(make_jsd_forward(host, None, flags, "lm_head"), host))]

    def parity_kwargs(self, host, flags, batch, seq, gen):
        import torch

        from ..model.modules import unwrap
        w = unwrap(host.lm_head).weight
        vocab = w.shape[0]
        t_hidden = flags.get("teacher_hidden", "auto")
        t_hidden = w.shape[1] + 16 if t_hidden == "auto" else int(t_hidden)     # unlike the student's
        h_t = torch.randn(batch, seq, t_hidden, generator=gen, dtype=torch.float64)
        w_t = torch.randn(vocab, t_hidden, generator=gen, dtype=torch.float64) * (2.0 / t_hidden ** 0.5)
        return {"teacher_hidden_states": h_t, "teacher_head": w_t}


register(FusedLinearJSD())
