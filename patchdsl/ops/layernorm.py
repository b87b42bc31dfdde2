"""fused_layernorm: LayerNorm (with or without bias), output in the input dtype, computed in fp32.

With an offset (Nemotron's LayerNorm1P: ``F.layer_norm(x, ..., weight + 1, bias)``) the forward hands the
kernel ``weight + offset``, computed as the module computes it (in the weight's dtype); the kernel's
weight gradient is then the gradient of ``weight`` itself (d(w + c)/dw = 1), through autograd.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX
from ..model.info import ModuleInfo
from .registry import register
from .common import next_pow2, resolve_auto, row_block
from .rmsnorm import row_launch


class FusedLayerNorm(Op):
    name = "fused_layernorm"
    kinds = ("LayerNorm",)
    placements = ("replicated",)
    template = "fused_layernorm.py.j2"
    doc = "LayerNorm forward and backward in one kernel each (dx, dW, dB); dW/dB reduced on the device."
    flags = (
        FlagSpec("eps", "float", "auto", "epsilon added to the variance; auto = the module's own", auto_ok=True, min=0.0),
        FlagSpec("offset", "float", "auto", "scale is (offset + w); auto = probed (0 for LayerNorm, 1 for "
                 "Nemotron's LayerNorm1P)", auto_ok=True),
        FlagSpec("block", "int", "auto", "block size in elements (power of two); auto = by hidden size",
                 auto_ok=True, min=16, max=BLOCK_MAX),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("LayerNorm")
        hidden = int(f["hidden"])
        eps = float(resolve_auto(flags, "eps", f["eps"]))
        block, single = row_block(hidden, target)
        if flags.get("block", "auto") != "auto":
            block = next_pow2(int(flags["block"]))
            single = block >= hidden
        return {
            "dtype": dtype, "w_dtype": info.dtype or dtype, "hidden": hidden, "eps": eps, "bias": bool(f["bias"]),
            "BLOCK": block, "single_pass": single, "n_tiles": -(-hidden // block),
            **row_launch(hidden, block, single, target), "target": target, "tag": f"h{hidden}",
        }

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        b = "bias" if params["bias"] else "nobias"
        return f"{self.name}_{params['dtype']}_h{params['hidden']}_{b}_{params['target']}"

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        f = info.facts("LayerNorm")
        if not f:
            return ("not a LayerNorm (needs a 1-D weight, an eps attribute and a forward equal to "
                    "F.layer_norm over the last dimension)")
        w = getattr(module, "weight", None)
        if w is None or tuple(w.shape) != (int(f["hidden"]),):
            return "its weight is not of shape (hidden,)"
        b = getattr(module, "bias", None)
        if (b is not None) != bool(f["bias"]):
            return "its bias changed since the model was indexed"
        return None

    def make_forward(self, module, kernels, flags, info):
        offset = float(resolve_auto(flags, "offset", info.facts("LayerNorm").get("offset", 0.0)))
        if info.facts("LayerNorm").get("bias"):
            if offset:
                def forward(self, hidden_states, *args, **kwargs):
                    return kernels(hidden_states.dtype).layernorm(hidden_states, self.weight + offset, self.bias)
            else:
                def forward(self, hidden_states, *args, **kwargs):
                    return kernels(hidden_states.dtype).layernorm(hidden_states, self.weight, self.bias)
        elif offset:
            def forward(self, hidden_states, *args, **kwargs):
                return kernels(hidden_states.dtype).layernorm(hidden_states, self.weight + offset)
        else:
            def forward(self, hidden_states, *args, **kwargs):
                return kernels(hidden_states.dtype).layernorm(hidden_states, self.weight)
        return forward


register(FusedLayerNorm())
