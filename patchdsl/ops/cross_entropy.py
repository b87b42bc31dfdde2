"""fused_cross_entropy: the causal-LM loss on logits, as one Triton kernel per row.

Selected on ``lm_head`` (kind Linear); acts on the causal LM that owns it.  Only the loss
function is replaced (HF's per-instance ``_loss_function``), so the forward, the logits it
returns and Gemma's softcapping stay HF's own; see :mod:`patchdsl.ops.loss_path`.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX, INDEX_MIN, INDEX_MAX, PROGRAMS_PER_SM_MAX
from ..model.info import ModuleInfo
from .registry import register
from .common import next_pow2, row_warps

# Every loss kernel that reads class labels checks them as torch's cross_entropy does (patchdsl/kernel_support/labels.py).
LABEL_CHECK_FLAG = FlagSpec(
    "check_labels", "bool", True,
    "a label neither ignore_index nor in [0, vocab) raises IndexError (CPU) or trips a device-side assert (GPU, no "
    "host sync), as HF's unpatched loss does; false = no check (an out-of-bounds label then gives an unspecified "
    "finite loss): only for measuring the check's cost")

LOSS_FLAGS = (
    FlagSpec("ignore_index", "int", -100, "label value that contributes no loss (HF: -100)",
             min=INDEX_MIN, max=INDEX_MAX),
    FlagSpec("label_smoothing", "float", 0.0, "mix eps of the uniform distribution into the target (torch semantics)",
             min=0.0, max=1.0),
    FlagSpec("z_loss", "float", 0.0, "add z_loss * logsumexp(z)^2 per token (PaLM's z-loss); 0 = off", min=0.0),
    FlagSpec("reduction", "choice", "mean",
             "mean: HF's (sum / num_items_in_batch when given, else mean over non-ignored tokens); "
             "sum; none: one loss per token", choices=("mean", "sum", "none")),
    FlagSpec("block", "int", "auto", "row block in elements (power of two); auto = by vocab size",
             auto_ok=True, min=16, max=BLOCK_MAX),
    FlagSpec("programs_per_sm", "int", "auto",
             "0: one program per row; k > 0: a persistent grid of k programs per SM walking the rows "
             "(keeps the rows in flight in L2 between the two passes); auto = 0 (measured faster)", auto_ok=True, min=0,
             max=PROGRAMS_PER_SM_MAX),
    LABEL_CHECK_FLAG,
)

INTERP_BLOCK = 1024          # the interpreter's row block cap (as common.row_block)
CUDA_SINGLE_MAX = 16384      # rows up to this long are done in one pass on the GPU
CUDA_LOOP_BLOCK = 8192       # block of the looped variant on the GPU
CUDA_LOOP_WARPS = 16


def num_tag(v: Any) -> str:
    """A float as a file-name-safe token: 30.0 -> 30, 0.1 -> 0p1."""
    f = float(v)
    s = str(int(f)) if f == int(f) else repr(f)
    return s.replace(".", "p").replace("-", "m")


def ce_block(vocab: int, flags: Mapping[str, Any], target: str) -> tuple[int, bool, int]:
    """(BLOCK, single_pass, num_warps) for rows of ``vocab`` logits."""
    b = flags.get("block", "auto")
    if b != "auto":
        block = next_pow2(int(b))
        if target == "interpreter":
            block = min(block, INTERP_BLOCK)
        single = block >= vocab
        if single:
            block = next_pow2(vocab)
        return block, single, (CUDA_LOOP_WARPS if not single and block >= 8192 else row_warps(block))
    cap = INTERP_BLOCK if target == "interpreter" else CUDA_SINGLE_MAX
    if next_pow2(vocab) <= cap:
        block = next_pow2(vocab)
        return block, True, row_warps(block)
    if target == "interpreter":
        return INTERP_BLOCK, False, 4
    return CUDA_LOOP_BLOCK, False, CUDA_LOOP_WARPS


def loss_params(vocab: int, flags: Mapping[str, Any], dtype: str, target: str, softcap: float | None,
                logits_scaling: float | None, logit_multiplier: float | None = None) -> dict[str, Any]:
    """The kernel parameters of the loss row kernel.  z = softcap(x * logit_multiplier / logits_scaling):
    the scalings the model's forward applies between its lm_head and its loss (patchdsl.model.forward.causal_lm.head_transform)."""
    block, single, warps = ce_block(vocab, flags, target)
    rows = 1 if target == "interpreter" or vocab > 2048 else (4 if vocab <= 512 else 2)
    # auto: one program per row.  H200, bf16, 16384 x 151936, fwd+bwd: 3.66 ms, vs 4.69 ms with a
    # persistent grid of 2 programs per SM and 7.07 ms with 1.
    pps = flags.get("programs_per_sm", "auto")
    if pps == "auto":
        pps = 0
    eps = float(flags.get("label_smoothing", 0.0) or 0.0)
    z = float(flags.get("z_loss", 0.0) or 0.0)
    return {
        "dtype": dtype, "vocab": int(vocab), "BLOCK": block, "single_pass": single,
        "n_tiles": -(-vocab // block), "num_warps": warps, "rows_per_program": rows,
        "programs_per_sm": int(pps),
        "ignore_index": int(flags.get("ignore_index", -100)), "label_smoothing": eps, "z_loss": z,
        "softcap": softcap, "logits_scaling": logits_scaling, "logit_multiplier": logit_multiplier,
        "check_labels": bool(flags.get("check_labels", True)), "reduction": flags.get("reduction", "mean"),
        "target": target, "tag": f"v{vocab}",
    }


def loss_kernel_name(op: str, params: Mapping[str, Any]) -> str:
    parts = [op, params["dtype"]]
    if "hidden" in params:
        parts.append(f"h{params['hidden']}")
    parts += [f"v{params['vocab']}", params["reduction"]]
    if params.get("softcap"):
        parts.append(f"softcap{num_tag(params['softcap'])}")
    if params.get("logit_multiplier"):
        parts.append(f"mul{num_tag(params['logit_multiplier'])}")
    if params.get("logits_scaling"):
        parts.append(f"scale{num_tag(params['logits_scaling'])}")
    if params.get("label_smoothing"):
        parts.append(f"ls{num_tag(params['label_smoothing'])}")
    if params.get("z_loss"):
        parts.append(f"z{num_tag(params['z_loss'])}")
    if params.get("ignore_index", -100) != -100:
        parts.append(f"ign{num_tag(params['ignore_index'])}")
    if not params.get("check_labels", True):
        parts.append("nocheck")
    parts.append(params.get("target", "cuda"))
    return "_".join(str(p) for p in parts)


class FusedCrossEntropy(Op):
    # the loss-path forward calls an instance-level forward it finds (accelerate's mixed-precision
    # convert_outputs_to_fp32, TRL's head) for every call it does not compute itself
    wraps_instance_forward = True
    name = "fused_cross_entropy"
    loss_role = "fused_cross_entropy"      # what loss_path checks the host for (shared with liger.* loss ops)
    kinds = ("Linear",)
    placements = ()          # logits sharded over the vocabulary: use fused_linear_cross_entropy
    template = "fused_cross_entropy.py.j2"
    doc = ("The causal-LM loss on logits in one Triton kernel per row (online logsumexp for long rows); "
           "the gradient is computed in the forward, the backward scales it without a host sync.")
    flags = LOSS_FLAGS[:3] + (
        FlagSpec("softcap", "float", "auto",
                 "apply cap*tanh(logits/cap) in the kernel; auto = none here, because the model's forward "
                 "already softcaps the logits it passes to the loss", auto_ok=True, none_ok=True, min=0.0),
    ) + LOSS_FLAGS[3:]

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        from .loss_path import lm_head_misfit
        return lm_head_misfit(self.name, info, index)

    def host(self, info: ModuleInfo, index: Any) -> str:
        from .loss_path import causal_lm_host
        return causal_lm_host(info, index)

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        from .loss_path import vocab_of
        cap = flags.get("softcap", "auto")
        softcap = None if cap in ("auto", None) or float(cap) == 0 else float(cap)
        return loss_params(vocab_of(info), flags, dtype, target, softcap, None)

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return loss_kernel_name(self.name, params)

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        from ..model.forward.causal_lm import host_reason, looks_causal_lm
        f = info.facts("CausalLM")
        if not f:
            return "no enclosing causal LM (a module with model, lm_head and config) was found"
        cap = flags.get("softcap", "auto")
        if cap not in ("auto", None) and float(cap) != 0 and f.get("softcap"):
            return (f"the model's forward already applies final_logit_softcapping={f['softcap']}; "
                    f"softcap={cap} would apply it twice")
        if looks_causal_lm(module):
            return host_reason(module, info, flags, self.loss_role)
        import torch
        if not isinstance(module, torch.nn.Linear):
            return f"{type(module).__name__} is not a plain nn.Linear"
        if info.path.rsplit(".", 1)[-1] != "lm_head" or module.out_features != f["vocab"]:
            return "this Linear is not the causal LM's lm_head (the loss is computed from lm_head's logits)"
        return None

    def make_forward(self, module, kernels, flags, info):
        from .loss_path import make_forward
        return make_forward(module, kernels, flags, "logits")

    def install(self, host, kernels, flags, info):
        from ..model.forward.causal_lm import loss_function_settable, require_host
        from .loss_path import install_forward, make_loss_function, vocab_of
        require_host(host, info, flags, self.loss_role)
        if loss_function_settable(type(host)):
            original = type(host).loss_function.fget(host)
            return [(host, "_loss_function", make_loss_function(kernels, flags, original, vocab_of(info)))]
        return install_forward(host, kernels, flags, "logits")


register(FusedCrossEntropy())
