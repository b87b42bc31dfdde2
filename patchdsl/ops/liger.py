"""liger.*: the ops of an installed Liger-Kernel, as external ops of the registry.

    *.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> liger.rms_norm
    *.mlp: SwiGLU -> liger.swiglu
    *.self_attn: Attention -> liger.rope
    lm_head: Linear -> liger.fused_linear_cross_entropy

Each op is the patchdsl op for the same kind with the kernel swapped: recognition, the contract
check (probes), the replacement forward (projections through the modules, weights read at call
time) and the loss path are those of ``fused_rmsnorm``, ``fused_swiglu``, ``fused_rope``, ...;
``load`` returns a small adapter exposing the generated module's entry points (``rmsnorm``,
``glu``, ``rope``, ``cross_entropy``, ``linear_cross_entropy``) on top of
``liger_kernel.transformers.functional``.  So a Liger site patches, undoes and verifies exactly
like a generated one.

Liger-Kernel's Triton kernels need a CUDA GPU: they do not run in Triton's CPU interpreter
(measured: its RMSNorm and SwiGLU kernels fail there).  A plan for the interpreter target is
therefore refused at plan time, naming the site; ``patchdsl plan --target cuda`` shows the plan
on a machine without a GPU.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec
from ..model.info import ModuleInfo
from .cross_entropy import LOSS_FLAGS, FusedCrossEntropy
from .external import ExternalOp, package_version
from .geglu import FusedGeGLU
from .layernorm import FusedLayerNorm
from .linear_cross_entropy import FusedLinearCrossEntropy
from .registry import register
from .rmsnorm import RMS_FLAGS, FusedRMSNorm
from .common import resolve_auto
from .rope import FusedRope
from .swiglu import FusedSwiGLU

DIST = "liger-kernel"


def _functional() -> Any:
    import liger_kernel.transformers.functional as F

    return F


class LigerOp(ExternalOp):
    """What makes a patchdsl op a Liger-Kernel one (loading, availability, source); mixed in before the
    generated op whose flags, kinds and forward it shares."""

    template = ""
    liger_fn: str = ""          # the function of liger_kernel.transformers.functional

    def liger_params(self, info: ModuleInfo, flags: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        return {"dtype": dtype, "fn": self.liger_fn, "target": target, **self.liger_params(info, flags)}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return f"{self.name}_{params['dtype']}"

    def source(self, params: Mapping[str, Any]) -> str:
        v = package_version(DIST)
        return f"liger-kernel {v or '(not installed)'} {self.liger_fn}"

    def unavailable(self, params: Mapping[str, Any]) -> str | None:
        try:
            fn = getattr(_functional(), self.liger_fn, None)
        except ImportError as e:
            return f"liger-kernel is not importable ({e}): pip install liger-kernel"
        if fn is None:
            return (f"the installed liger-kernel {package_version(DIST)} has no {self.liger_fn}; "
                    f"upgrade it: pip install -U liger-kernel")
        if params.get("target") != "cuda":
            return ("Liger-Kernel's Triton kernels need a CUDA GPU (they do not run in Triton's CPU interpreter); "
                    "run apply/verify on a GPU, or `patchdsl plan --target cuda` to see the plan here")
        return None

    def load(self, params: Mapping[str, Any]) -> Any:
        return _Adapter(_functional(), dict(params))


class _Adapter:
    """The entry points of a generated kernel module, computed by Liger-Kernel."""

    def __init__(self, F: Any, params: dict[str, Any]):
        self.F = F
        self.p = params

    # norms
    def rmsnorm(self, x, w):
        p = self.p
        return self.F.liger_rms_norm(x, w, p["eps"], p["offset"], p["casting"], False)

    def layernorm(self, x, w, b=None):
        import torch

        if b is None:
            b = torch.zeros_like(w)
        return self.F.liger_layer_norm(x, w, b, self.p["eps"])

    # gated MLPs: glu(gate, up) or glu(gate_up)
    def glu(self, gate, up=None, in_place=False):
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        fn = self.F.liger_swiglu if self.p["fn"] == "liger_swiglu" else self.F.liger_geglu
        return fn(gate, up)

    # RoPE: patchdsl hands q/k as (batch, seq, heads, head_dim); Liger takes (batch, heads, seq, head_dim)
    def rope(self, q, k, cos, sin):
        qo, ko = self.F.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    # losses: HF's reduction (sum / num_items_in_batch when given, else mean over non-ignored)
    def _reduce(self, num_items):
        return ("sum", num_items) if num_items is not None else ("mean", None)

    def cross_entropy(self, logits, labels, num_items=None):
        red, n = self._reduce(num_items)
        p = self.p
        loss = self.F.liger_cross_entropy(logits, labels, ignore_index=p["ignore_index"], reduction=red,
                                          label_smoothing=p["label_smoothing"], lse_square_scale=p["z_loss"])
        loss = loss[0] if isinstance(loss, tuple) else loss
        return loss / n if n is not None else loss

    def linear_cross_entropy(self, hidden, w, b, labels, num_items=None):
        red, n = self._reduce(num_items)
        p = self.p
        loss = self.F.liger_fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), w, labels.reshape(-1), b, ignore_index=p["ignore_index"],
            lse_square_scale=p["z_loss"], label_smoothing=p["label_smoothing"], reduction=red,
            softcap=p["softcap"])
        loss = loss[0] if isinstance(loss, tuple) else loss
        return loss / n if n is not None else loss


class LigerRMSNorm(LigerOp, FusedRMSNorm):
    name = "liger.rms_norm"
    liger_fn = "liger_rms_norm"
    doc = "Liger-Kernel's RMSNorm (`liger_rms_norm`, offset and cast order as the module's); needs a CUDA GPU."
    flags = RMS_FLAGS[:3]

    def liger_params(self, info, flags):
        f = info.facts("RMSNorm")
        casting = resolve_auto(flags, "casting", f["casting"])
        return {"eps": float(resolve_auto(flags, "eps", f["eps"])),
                "offset": float(resolve_auto(flags, "offset", f["offset"])),
                "casting": "llama" if casting == "unknown" else casting}


class LigerLayerNorm(LigerOp, FusedLayerNorm):
    name = "liger.layer_norm"
    liger_fn = "liger_layer_norm"
    doc = "Liger-Kernel's LayerNorm (`liger_layer_norm`); needs a CUDA GPU."
    flags = FusedLayerNorm.flags[:1]

    def liger_params(self, info, flags):
        return {"eps": float(resolve_auto(flags, "eps", info.facts("LayerNorm")["eps"]))}


class LigerSwiGLU(LigerOp, FusedSwiGLU):
    name = "liger.swiglu"
    liger_fn = "liger_swiglu"
    doc = ("Liger-Kernel's silu(gate) * up (`liger_swiglu`) between the module's own projections; "
           "needs a CUDA GPU.")
    flags = ()


class LigerGeGLU(LigerOp, FusedGeGLU):
    name = "liger.geglu"
    liger_fn = "liger_geglu"
    doc = ("Liger-Kernel's gelu_tanh(gate) * up (`liger_geglu`; tanh-approximate GELU only) between the "
           "module's own projections; needs a CUDA GPU.")
    flags = ()

    def check(self, module, info, flags):
        f = info.facts("GeGLU")
        if f and f.get("activation") != "gelu_tanh":
            return (f"Liger's GeGLU computes the tanh-approximate GELU; this MLP computes "
                    f"{f.get('activation')} (use fused_geglu)")
        return super().check(module, info, flags)


class LigerRope(LigerOp, FusedRope):
    name = "liger.rope"
    liger_fn = "liger_rope"
    doc = ("Liger-Kernel's RoPE of q and k (`liger_rope`) inside the attention forward patchdsl rebuilds "
           "(projections, q/k norms, KV cache and attention interface kept); needs a CUDA GPU.")
    flags = ()

    def check(self, module, info, flags):
        f = info.facts("Attention")
        if f and (f.get("rotary_layout", "rotate_half") != "rotate_half" or f.get("rope_input") == "rotary"):
            return ("Liger's RoPE computes rotate_half on whole heads; this attention's rotary layout is "
                    f"{f.get('rotary_layout')} (rotary input: {f.get('rope_input')}) (use fused_rope)")
        return super().check(module, info, flags)


class LigerCrossEntropy(LigerOp, FusedCrossEntropy):
    name = "liger.cross_entropy"
    liger_fn = "liger_cross_entropy"
    doc = ("Liger-Kernel's cross entropy on the logits (`liger_cross_entropy`; it writes the gradient into "
           "the logits buffer during the forward) as the causal LM's loss; needs a CUDA GPU.")
    flags = LOSS_FLAGS[:3]

    def liger_params(self, info, flags):
        return {"ignore_index": int(flags.get("ignore_index", -100)),
                "label_smoothing": float(flags.get("label_smoothing", 0.0)), "z_loss": float(flags.get("z_loss", 0.0))}


class LigerFusedLinearCrossEntropy(LigerOp, FusedLinearCrossEntropy):
    name = "liger.fused_linear_cross_entropy"
    liger_fn = "liger_fused_linear_cross_entropy"
    doc = ("Liger-Kernel's chunked lm_head + cross entropy (`liger_fused_linear_cross_entropy`), logits never "
           "materialised; needs a CUDA GPU.")
    flags = LOSS_FLAGS[:3] + (
        FlagSpec("softcap", "float", "auto", "final-logit softcapping; auto = the config's final_logit_softcapping",
                 auto_ok=True, none_ok=True, min=0.0),
    )

    def liger_params(self, info, flags):
        from ..model.forward.logits import resolve_softcap

        return {"ignore_index": int(flags.get("ignore_index", -100)),
                "label_smoothing": float(flags.get("label_smoothing", 0.0)), "z_loss": float(flags.get("z_loss", 0.0)),
                "softcap": resolve_softcap(flags, info.facts("CausalLM"))}

    def check(self, module, info, flags):
        from ..model.forward.logits import resolve_multiplier, resolve_scaling
        f = info.facts("CausalLM")
        if f and (resolve_scaling(f) or resolve_multiplier(f)):
            return "the model scales its logits (logits_scaling / a logit multiplier); Liger's fused loss does not"
        return super().check(module, info, flags)


for _op in (LigerRMSNorm(), LigerLayerNorm(), LigerSwiGLU(), LigerGeGLU(), LigerRope(), LigerCrossEntropy(),
            LigerFusedLinearCrossEntropy()):
    register(_op)
