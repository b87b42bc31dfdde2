"""fused_rmsnorm_gated: the gated RMSNorm of linear-attention layers, ``norm(x) * w * act(gate)``.

Qwen3-Next / Qwen3.5 / OLMo-hybrid (``*RMSNormGated``: normalise in fp32, cast to the input dtype, scale
by the weight in the promoted weight/input dtype, multiply by ``silu(gate)`` in fp32, cast) and Kimi
Linear / Lara (weight, normalised value and gate all in fp32, one cast; Kimi's gate through a sigmoid).
The kind :func:`patchdsl.model.kinds.norms.gated_rmsnorm` probes which of the two cast orders and activations the
module computes; the kernel computes that one.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op
from ..model.info import ModuleInfo
from .common import next_pow2, resolve_auto, row_warps
from .registry import register
from .rmsnorm import partial_sum_launch, rows_per_tile

# the one-pass kernel holds a row in one block: the gated norms run over a head's width (64-256)
GATED_BLOCK_MAX = 16384


class FusedRMSNormGated(Op):
    name = "fused_rmsnorm_gated"
    kinds = ("GatedRMSNorm",)
    placements = ()
    template = "fused_rmsnorm_gated.py.j2"
    doc = ("Gated RMSNorm (norm(x) * w * silu/sigmoid(gate), linear-attention output norms): forward and backward "
           "(dx, dgate, dW) in one kernel each; dW reduced on the device.")
    flags = (
        FlagSpec("eps", "float", "auto", "epsilon added to the mean square; auto = the module's own", auto_ok=True, min=0.0),
        FlagSpec("casting", "choice", "auto", "llama: cast the normalised value, scale in the input dtype, gate in "
                 "fp32; gemma: all in fp32, one cast; auto = probed", choices=("llama", "gemma"), auto_ok=True),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("GatedRMSNorm")
        hidden = int(f["hidden"])
        casting = resolve_auto(flags, "casting", f["casting"])
        if casting == "unknown":
            casting = "llama"
        w_dtype = info.dtype or dtype
        # the dtype of w * cast(x * rstd) (torch's promotion of the weight's and the input's dtypes)
        h_dtype = dtype if dtype == w_dtype else "fp32"
        block = next_pow2(hidden)
        rows = rows_per_tile(block, True, target)
        return {
            "dtype": dtype, "w_dtype": w_dtype, "h_dtype": h_dtype, "hidden": hidden,
            "eps": float(resolve_auto(flags, "eps", f["eps"])), "activation": f["activation"], "casting": casting,
            "BLOCK": block, "ROWS": rows, "num_warps": row_warps(rows * block), "bwd_programs_per_sm": 4,
            **partial_sum_launch(hidden, target), "target": target, "tag": f"h{hidden}",
        }

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return (f"{self.name}_{params['dtype']}_h{params['hidden']}_{params['activation']}_{params['casting']}"
                f"_{params['target']}")

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        f = info.facts("GatedRMSNorm")
        if not f:
            return ("not a gated RMSNorm (needs a 1-D weight, an eps attribute and a forward(x, gate) computing "
                    "x / rms(x) * w * silu(gate) or * sigmoid(gate))")
        if int(f["hidden"]) > GATED_BLOCK_MAX:
            return f"rows of {f['hidden']} elements are longer than the one-pass kernel's block ({GATED_BLOCK_MAX})"
        if f["casting"] == "unknown" and flags.get("casting", "auto") == "auto":
            return "its forward matches neither the llama nor the gemma cast order; set casting= explicitly"
        return None

    def make_forward(self, module, kernels, flags, info):
        def forward(self, hidden_states, gate=None, *args, **kwargs):
            if gate is None:
                raise TypeError(f"{type(self).__name__}: fused_rmsnorm_gated needs the gate (forward(hidden_states, gate))")
            return kernels(hidden_states.dtype).rmsnorm_gated(hidden_states, gate, self.weight)

        return forward


register(FusedRMSNormGated())
