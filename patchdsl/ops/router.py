"""fused_router: a mixture-of-experts router's softmax, top-k and normalisation in one kernel
(``templates/fused_router.py.j2``).

Replaces the ``forward(hidden)`` of one ``Router`` module instance (transformers 5.x's
``*TopKRouter`` classes of Qwen2/3-MoE, Qwen3.5-MoE, Mixtral, OLMoE, gpt-oss, GraniteMoE; see the
kind in :mod:`patchdsl.ops.kinds`).  The router logits stay the module's own linear (a torch
matmul, in the dtype the module computes it); the kernel takes them and returns the top-k weights
and indices; the forward returns the three in the module's order and dtypes, as probed (5.17's
GraniteMoE router returns ``(index, weights, logits)``, 5.24's ``(logits, weights, index)``;
Mixtral keeps its weights in float32, Qwen3-MoE casts them to the logits' dtype).

Top-k is taken on the logits, ties to the lower expert index.  ``torch.topk`` breaks exact ties its
own way (its CPU and GPU kernels differ from each other): tied experts have equal weights, so only
which of them is chosen can differ; ``patchdsl verify`` compares the router with the routing held
fixed (tokens whose expert sets differ between the copies are left out).  The backward gives the logits the gradient of the selected weights (the indices
get none) and autograd adds the router-logits output's own gradient (the auxiliary loss).

Refused (the router stays the model's own, the reason is the plan's): DeepSeek-V3-style routers
(sigmoid scores, ``e_score_correction_bias``, top-k within the best groups, ``torch.topk(sorted=False)``
whose order is the device's), a router with a scoring the probe does not know (not a Router), and
inputs other than 2-D (the module's own forward runs them).

Not fused: the load-balancing statistics.  They are the causal LM's auxiliary loss
(``load_balancing_loss_func`` over every layer's returned logits, replayed by the loss ops when
``output_router_logits`` is on), weighted by the attention mask, which a router never sees; in
transformers 5.17 and 5.24 that function already accumulates a per-expert histogram and probability
sum layer by layer (no one-hot tensor, O(tokens x experts) memory).  What fusing them could save is
its own softmax and top-k per layer: ``bench/moe_router_bench.py`` times it (the ``aux loss`` row).
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op
from ..model.info import ModuleInfo
from .common import next_pow2
from .registry import register

# the router facts the replacement forward relies on: the live module must still have them
ROUTER_FACTS = ("experts", "top_k", "bias", "order", "scoring", "norm_topk", "linear", "logits_dtype",
                "weights_dtype")


def router_tiles(experts: int, top_k: int, target: str, rows: Any = "auto") -> dict[str, int]:
    """Launch shape: tokens per program so that a [rows, experts] tile is about 2048 elements (16 tokens
    at 128 experts), at most 16 on the GPU (64 in the interpreter: fewer Python-level steps)."""
    be, bk = next_pow2(experts), next_pow2(top_k)
    if rows == "auto":
        rows = max(1, min(64 if target == "interpreter" else 16, 2048 // be))
    rows = next_pow2(int(rows))
    tile = rows * be
    warps = 1 if target == "interpreter" or tile <= 512 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    return {"BLOCK_E": be, "BLOCK_K": bk, "ROWS": rows, "num_warps": warps}


class FusedRouter(Op):
    name = "fused_router"
    kinds = ("Router",)
    template = "fused_router.py.j2"
    doc = ("a mixture-of-experts router's softmax, top-k (exact ties to the lower index) and "
           "optional renormalisation in one kernel, with a backward to the logits through the selected "
           "weights; the router's linear stays a torch matmul; returns what the module returns (order and "
           "dtypes probed); per instance. DeepSeek-V3's sigmoid grouped top-k is refused.")
    flags = (
        FlagSpec("rows", "int", "auto", "tokens per program (a power of two); auto = a tile of about 2048 "
                 "logits, at most 16 tokens", auto_ok=True, min=1, max=64),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Router")
        if not f:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not a Router module")
        E, k = int(f["experts"]), int(f["top_k"])
        return {"dtype": dtype, "experts": E, "top_k": k, "norm_topk": bool(f.get("norm_topk")),
                "target": target, **router_tiles(E, k, target, flags.get("rows", "auto"))}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        parts = [self.name, "softmax_topk", params["dtype"], f"e{params['experts']}", f"k{params['top_k']}"]
        if params["norm_topk"]:
            parts.append("norm")
        parts.append(params["target"])
        return "_".join(str(p) for p in parts)

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        f = info.facts("Router")
        if f.get("scoring") == "sigmoid_grouped":
            return (f"{info.path} ({info.cls}): its routing is DeepSeek-V3's sigmoid grouped top-k (sigmoid "
                    "scores plus e_score_correction_bias, top-k within the best topk_group of n_group groups, "
                    "torch.topk(sorted=False) whose order is the device's), which fused_router does not compute; "
                    "not patched (the router stays the model's own)")
        if f.get("scoring") != "softmax_topk":
            return f"{info.path} ({info.cls}): its routing ({f.get('scoring')}) is not one fused_router computes"
        return None

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        import torch

        from ..model.kinds.moe import router as recognise

        where = f"{info.path or '<module>'} ({info.cls})"
        f = info.facts("Router")
        if not f:
            return (f"{where} is not a Router (needs a 2-D [experts, hidden] weight, an int top_k and a "
                    "forward(hidden) returning router logits, top-k weights and top-k indices)")
        why = self.misfit(info, None)
        if why:
            return why
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            return f"{where} has no weight tensor"
        live = recognise(module)
        if live is None:
            return f"{where}: its forward no longer computes the router it was indexed as; not patched"
        for k in ROUTER_FACTS:
            if live.get(k) != f.get(k):
                return f"{where}: its {k} is {live.get(k)}, the plan says {f.get(k)}; plan again"
        return None

    def make_forward(self, module, kernels, flags, info):
        import torch
        import torch.nn.functional as F

        eager = type(module).forward
        f = info.facts("Router")
        has_bias = bool(f["bias"])
        E, H = int(f["experts"]), int(f["hidden"])
        linear_fp32 = f["linear"] == "float32"
        logits_fp32 = f["logits_dtype"] == "float32"
        wdt_rule = f["weights_dtype"]
        order = tuple(str(f["order"]).split("_"))      # "logits_weights_index" (5.17's GraniteMoe: index first)
        supported = (torch.float32, torch.bfloat16, torch.float16)

        def forward(self, hidden_states, *args, **kwargs):
            x = hidden_states
            w = self.weight
            if args or kwargs or x.dim() != 2 or x.shape[-1] != H or x.dtype not in supported or w.dtype not in supported:
                return eager(self, hidden_states, *args, **kwargs)
            b = self.bias if has_bias else None
            if linear_fp32:
                logits = F.linear(x.float(), w.float(), b.float() if b is not None else None)
            else:
                logits = F.linear(x, w, b)
                if logits_fp32:
                    logits = logits.float()
            if logits.dtype not in supported:
                return eager(self, hidden_states, *args, **kwargs)
            wdt = logits.dtype if wdt_rule == "logits" else torch.float32 if wdt_rule == "float32" else x.dtype
            weights, index = kernels(x.dtype).router(logits, wdt)
            out = {"logits": logits, "weights": weights, "index": index}
            return tuple(out[r] for r in order)

        return forward


register(FusedRouter())
