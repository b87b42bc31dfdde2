"""fused_experts: a mixture-of-experts layer's expert MLPs as grouped GEMMs (``templates/fused_experts.py.j2``).

Replaces the ``forward(hidden, top_k_index, top_k_weights)`` of one ``Experts`` module instance
(transformers 5.x's ``*Experts`` classes: 3-D ``gate_up_proj`` / ``down_proj``, see the kind in
:mod:`patchdsl.ops.kinds`).  The routing stays the model's own (its router module is untouched);
the op computes, for the routing it is given, ``sum_k w * (act(x W_gu[e] + b) W_d[e] + b_d)``:

* routing metadata on the device without a host sync (sort by expert, segment bounds, a static
  grid of row blocks mapped to experts through a device table);
* a grouped GEMM for gate and up with the activation (SiLU / GELU / gpt-oss's clamped SwiGLU) in
  its epilogue, a grouped GEMM for down with the routing weight in its epilogue, the top-k slots
  summed in a fixed order;
* a backward that recomputes the gate/up pre-activations instead of saving the intermediate, and
  returns the gradients of the hidden states, the routing weights (so the router trains), both
  weights and both biases.  Every reduction has a fixed order: deterministic.

Per instance and reversible: the module's ``forward`` is bound on the instance; transformers'
process-wide ``ALL_EXPERTS_FUNCTIONS`` and the config's ``_experts_implementation`` are untouched
(other models, and other modules of this one, keep theirs).  Weights are read from the module at
call time (FSDP2, PEFT's ``target_parameters`` parametrizations see their own values).  A dtype
without a kernel (float64) or mixed dtypes run the module's eager forward.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op
from ..model.info import ModuleInfo
from .registry import register

# BM: the routing's row block (rows of one expert per program of the row-block GEMMs); the other
# tiles are per kernel, in the template's TILES table (bench/moe_bench.py sweeps them per kernel).
CUDA_BM = 64
INTERP_BM = 32


class FusedExperts(Op):
    name = "fused_experts"
    kinds = ("Experts",)
    template = "fused_experts.py.j2"
    doc = ("the expert MLPs of a mixture-of-experts layer as grouped GEMMs: device-side routing metadata (no "
           "host sync), gate/up GEMM with the activation fused, down GEMM with the routing weight fused, "
           "backward recomputes the intermediate; deterministic; per instance (transformers' experts "
           "registry untouched).")
    flags = (
        FlagSpec("block_m", "int", "auto", "rows (token slots of one expert) per tile, rounded up to a power "
                 "of two; auto = 64 on the GPU, 32 in the interpreter", auto_ok=True, min=16, max=256),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Experts")
        if not f:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not an Experts module")
        bm = flags.get("block_m", "auto")
        bm = (INTERP_BM if target == "interpreter" else CUDA_BM) if bm == "auto" else 1 << max(4, (int(bm) - 1).bit_length())
        return {"dtype": dtype, "experts": int(f["experts"]), "top_k": int(f.get("top_k") or 0),
                "hidden": int(f["hidden"]), "intermediate": int(f["intermediate"]),
                "transposed": bool(f["transposed"]), "layout": str(f["layout"]), "bias": bool(f["bias"]),
                "activation": str(f["activation"]),
                "alpha": float(f["alpha"]) if f.get("alpha") is not None else None,
                "limit": float(f["limit"]) if f.get("limit") is not None else None,
                "target": target, "BM": bm}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        parts = [self.name, params["activation"], params["dtype"], f"e{params['experts']}", f"k{params['top_k']}",
                 f"h{params['hidden']}", f"i{params['intermediate']}", params["layout"]]
        if params["transposed"]:
            parts.append("t")
        if params["bias"]:
            parts.append("bias")
        parts.append(params["target"])
        return "_".join(str(p) for p in parts)

    def host(self, info: ModuleInfo, index: Any) -> str:
        """The experts module itself; under PEFT's ParamWrappers (LoRA on the expert parameters), the
        wrapped module: the wrappers' forwards stay and parametrize its weights (W + BA) around its
        call, which the fused forward reads at call time."""
        depth = int(info.facts("Experts").get("peft_depth") or 0)
        return info.path + ".base_layer" * depth

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        if not info.facts("Experts").get("top_k"):
            return (f"{info.path} ({info.cls}): its top-k is not known (neither the module's top_k nor its "
                    "config's num_experts_per_tok); not patched")
        return None

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        import torch

        from ..model.kinds.experts import peft_param_base

        where = f"{info.path or '<module>'} ({info.cls})"
        module, _ = peft_param_base(module)
        f = info.facts("Experts")
        if not f:
            return (f"{where} is not an Experts module (needs 3-D gate_up_proj / down_proj parameters and a "
                    "forward(hidden, top_k_index, top_k_weights) computing a gated MLP per expert)")
        if module.__dict__.get("_is_expert_parallel"):
            return f"{where} is sharded over experts (expert parallelism); the fused experts need every expert"
        if getattr(module, "has_post_expert_norm", False):
            return f"{where} normalises each expert's output (post_expert_norm); not fused"
        from ..model.kinds.experts import experts as recognise

        live = recognise(module)
        if live is None:
            return f"{where}: its forward no longer computes the experts it was indexed as; not patched"
        if getattr(module, "parametrizations", None):
            return f"{where}: its parameters carry a parametrization outside a PEFT wrapper's call; not patched"
        for k in ("transposed", "layout", "bias", "activation"):
            if live[k] != f[k]:
                return f"{where}: its {k} is {live[k]}, the plan says {f[k]}; plan again"
        for n in ("gate_up_proj", "down_proj"):
            if not isinstance(getattr(module, n, None), torch.Tensor):
                return f"{where} has no {n} tensor"
        return None

    def make_forward(self, module, kernels, flags, info):
        import torch

        from ..model.kinds.experts import expert_forward as _expert_forward

        eager = _expert_forward(module)
        f = info.facts("Experts")
        has_bias = bool(f["bias"])
        top_k = int(f.get("top_k") or 0)
        supported = (torch.float32, torch.bfloat16, torch.float16)

        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            gu, dn = self.gate_up_proj, self.down_proj
            dt = hidden_states.dtype
            if (args or kwargs or dt not in supported or gu.dtype != dt or dn.dtype != dt or hidden_states.dim() != 2
                    or top_k_index.dim() != 2 or top_k_index.shape[-1] != top_k):
                # another top-k than the kernel's (a per-layer moe_topk the config's first value did not
                # name, a caller's own routing): the module's own forward, exactly
                return eager(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            gub = self.gate_up_proj_bias if has_bias else None
            db = self.down_proj_bias if has_bias else None
            return kernels(dt).experts(hidden_states, top_k_index, top_k_weights, gu, dn, gub, db)

        return forward


register(FusedExperts())
