"""fused_router: a mixture-of-experts router's scoring, top-k and normalisation in one kernel
(``templates/fused_router.py.j2``).

Replaces the ``forward(hidden)`` of one ``Router`` module instance (transformers 5.x's
``*TopKRouter`` classes of Qwen2/3-MoE, Qwen3.5-MoE, Mixtral, OLMoE, gpt-oss, GraniteMoE, DeepSeek-V2/V3,
GLM-4.5, dots1 and the families copied from them; see the kind in :mod:`patchdsl.model.kinds.moe`).  The
router logits stay the module's own linear (a torch matmul, in the dtype the module computes it); the
kernel takes them and returns the top-k weights and indices; the forward returns the three in the
module's order and dtypes, as probed (5.17's GraniteMoE router returns ``(index, weights, logits)``,
5.24's ``(logits, weights, index)``; Mixtral keeps its weights in float32, Qwen3-MoE casts them to the
logits' dtype).  A [batch, seq, hidden] input is routed as its rows when the module's own forward
flattens it (``view(-1, hidden_dim)``: DeepSeek-V3's block passes the 3-D states).

Scorings computed (the kernel is specialised for one):
  * ``softmax_topk``: softmax over the experts, top-k, renormalised or not, times the routed scaling
    factor when the router has one (DeepSeek-V2's greedy);
  * ``softmax_grouped``: DeepSeek-V2's group_limited_greedy (groups ranked by their best score, the
    ``topk_group`` best kept, top-k of the rest), scaled;
  * ``sigmoid_grouped``: DeepSeek-V3 / GLM-4.5 / dots1 / Kimi-K2 (transformers' ``DeepseekV3TopkRouter``
    and its copies): sigmoid scores, ``e_score_correction_bias`` added for the choice only (read from the
    module at every call: it is trained outside autograd), groups ranked by the sum of their top-2 biased
    scores, top-k within the kept groups, the weights the un-biased scores of the chosen experts,
    renormalised with HF's ``+ 1e-20`` under ``norm_topk_prob``, times ``routed_scaling_factor``;
    Kolibri1's variant adds the bias to the logits instead (``bias_on="logits"``) and renormalises
    without an epsilon.

Top-k is taken with exact ties to the lower expert (or group) index, the k slots ordered by descending
choice score.  ``torch.topk`` breaks exact ties its own way (its CPU and GPU kernels differ from each
other) and, with ``sorted=False``, orders the k slots the device's way: the experts sum over the k, so
the order does not matter, and tied experts have equal weights, so only which of them is chosen can
differ; ``patchdsl verify`` compares the router with the routing held fixed (tokens whose expert sets
differ between the copies are left out).  The backward gives the logits the gradient of the selected
weights through the scores (the indices and the correction bias get none, as in transformers) and
autograd adds the router-logits output's own gradient (the auxiliary loss).

Refused at plan time (the router stays the model's own, the reason is the plan's, naming the module, what
it holds and what the op computes): a router of scoring ``unknown`` (a Router by structure whose weights
no probed formula gives), a grouped top-k asking for more experts than the kept groups hold.  At apply
time: a router whose facts changed since planning, a correction bias that is not [experts].

Not fused: the load-balancing statistics.  They are the causal LM's auxiliary loss
(``load_balancing_loss_func`` over every layer's returned logits, replayed by the loss ops when
``output_router_logits`` is on), weighted by the attention mask, which a router never sees; in
transformers 5.17 and 5.24 that function already accumulates a per-expert histogram and probability
sum layer by layer (no one-hot tensor, O(tokens x experts) memory).  What fusing them could save is
its own softmax and top-k per layer: ``bench/moe_router_bench.py`` times it (the ``aux loss`` row).
DeepSeek-V3's routers have no auxiliary loss (the correction bias replaces it).
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op
from ..model.info import ModuleInfo
from .common import next_pow2
from .registry import register

# the router facts the replacement forward relies on: the live module must still have them
ROUTER_FACTS = ("experts", "top_k", "bias", "order", "scoring", "norm_topk", "linear", "logits_dtype",
                "weights_dtype", "flattens", "n_group", "topk_group", "scaling", "bias_on", "norm_eps")
# the scorings fused_router computes (patchdsl.model.kinds.moe.ROUTER_SCORINGS has the rest: refused)
COMPUTED = {"softmax_topk": "softmax over the experts then top-k (renormalised or not)",
            "sigmoid_grouped": ("DeepSeek-V3 / GLM-4.5 / dots1's sigmoid scores with the score-correction bias "
                                "for the choice, top-k within the best groups by their top-2 sum"),
            "softmax_grouped": "DeepSeek-V2's group-limited softmax top-k (groups by their best score)"}
WHAT_IT_COMPUTES = ("fused_router computes softmax top-k (renormalised or not, any routed scaling factor), "
                    "DeepSeek-V2's group-limited softmax top-k and DeepSeek-V3 / GLM-4.5 / dots1's sigmoid "
                    "grouped top-k with a score-correction bias")
NORM_EPS = 1e-20        # transformers' DeepseekV3 / Glm4Moe / Dots1 routers: sum + 1e-20 under norm_topk_prob


def router_tiles(experts: int, top_k: int, target: str, rows: Any = "auto", n_group: int = 1) -> dict[str, int]:
    """Launch shape: tokens per program so that a [rows, experts] tile is about 2048 elements (16 tokens
    at 128 experts), at most 16 on the GPU (64 in the interpreter: fewer Python-level steps)."""
    be, bk = next_pow2(experts), next_pow2(top_k)
    if rows == "auto":
        rows = max(1, min(64 if target == "interpreter" else 16, 2048 // be))
    rows = next_pow2(int(rows))
    tile = rows * be
    warps = 1 if target == "interpreter" or tile <= 512 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    return {"BLOCK_E": be, "BLOCK_K": bk, "ROWS": rows, "num_warps": warps, "BLOCK_G": next_pow2(max(1, n_group))}


def routing_misfit(f: Mapping[str, Any]) -> str | None:
    """Why fused_router does not compute the routing of a router with facts ``f`` (one phrase), or None."""
    scoring = f.get("scoring")
    if scoring not in COMPUTED:
        what = ("its routing is top-k of the logits then a softmax over the k"
                if scoring == "topk_softmax" else
                f"its top-k weights are none of the routings probed (it holds {f.get('routing') or 'nothing known'})")
        return f"{what}; {WHAT_IT_COMPUTES}"
    if scoring == "softmax_topk":
        return None
    E, k = int(f["experts"]), int(f["top_k"])
    ng, tg = f.get("n_group"), f.get("topk_group")
    if not isinstance(ng, int) or not isinstance(tg, int) or ng < 1 or not 1 <= tg <= ng or E % ng:
        return (f"its {E} experts in n_group={ng} groups with topk_group={tg} are not equal groups of which "
                "some are kept; fused_router computes grouped top-k over n_group equal groups, 1 <= topk_group "
                "<= n_group")
    if scoring == "sigmoid_grouped" and E // ng < 2:
        return (f"its groups of {E // ng} expert rank by a top-2 sum (transformers' topk(2) needs 2 per group); "
                "fused_router computes groups of 2 or more")
    if tg < ng and k > tg * (E // ng):
        return (f"its top_k={k} is more than the {tg * (E // ng)} experts of the topk_group={tg} kept groups "
                "(the rest of its choice is among masked experts, whose order is the device's); fused_router "
                "computes top_k <= topk_group x experts per group")
    return None


class FusedRouter(Op):
    name = "fused_router"
    kinds = ("Router",)
    placements = ()
    template = "fused_router.py.j2"
    doc = ("a mixture-of-experts router's scoring, top-k (exact ties to the lower index) and normalisation in "
           "one kernel, with a backward to the logits through the selected weights: softmax top-k (renormalised "
           "or not), DeepSeek-V2's group-limited softmax top-k, and DeepSeek-V3 / GLM-4.5 / dots1's sigmoid "
           "scores with the score-correction bias for the choice only, grouped top-k (groups by their top-2 "
           "sum), renormalisation (+1e-20) and the routed scaling factor; the router's linear stays a torch "
           "matmul; returns what the module returns (order and dtypes probed); per instance. Any other "
           "routing is refused at plan time with what the router holds.")
    flags = (
        FlagSpec("rows", "int", "auto", "tokens per program (a power of two); auto = a tile of about 2048 "
                 "logits, at most 16 tokens", auto_ok=True, min=1, max=64),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Router")
        if not f:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not a Router module")
        why = routing_misfit(f)
        if why:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}): {why}")
        E, k = int(f["experts"]), int(f["top_k"])
        scoring = str(f.get("scoring") or "softmax_topk")
        grouped = scoring != "softmax_topk"
        ng = int(f.get("n_group") or 1) if grouped else 1
        params = {"dtype": dtype, "experts": E, "top_k": k, "norm_topk": bool(f.get("norm_topk")),
                  "target": target, "scoring": scoring, "scaling": float(f.get("scaling") or 1.0),
                  **router_tiles(E, k, target, flags.get("rows", "auto"), ng)}
        if grouped:
            eps = f.get("norm_eps")
            params.update(n_group=ng, topk_group=int(f.get("topk_group") or ng),
                          norm_eps=float(eps) if eps is not None else NORM_EPS,
                          group_score="top2" if scoring == "sigmoid_grouped" else "max",
                          has_bias=scoring == "sigmoid_grouped", bias_on=str(f.get("bias_on") or "scores"))
        return params

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        scoring = params.get("scoring", "softmax_topk")
        parts = [self.name, scoring, params["dtype"], f"e{params['experts']}", f"k{params['top_k']}"]
        if scoring != "softmax_topk":
            parts += [f"g{params['n_group']}", f"tg{params['topk_group']}"]
            if params.get("bias_on") == "logits":
                parts.append("logitbias")
        if params["norm_topk"]:
            parts.append("norm")
        if params.get("scaling", 1.0) != 1.0:
            parts.append("scaled")
        parts.append(params["target"])
        return "_".join(str(p) for p in parts)

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        f = info.facts("Router")
        why = routing_misfit(f)
        if why:
            return f"{info.path} ({info.cls}): {why}; not patched (the router stays the model's own)"
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
        if f.get("scoring") == "sigmoid_grouped":
            corr = getattr(module, "e_score_correction_bias", None)
            if not isinstance(corr, torch.Tensor) or tuple(corr.shape) != (int(f["experts"]),):
                got = tuple(corr.shape) if isinstance(corr, torch.Tensor) else type(corr).__name__
                return (f"{where}: its e_score_correction_bias is {got}, fused_router's sigmoid grouped top-k "
                        f"needs a [{f['experts']}] tensor; not patched")
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
        flattens = bool(f.get("flattens"))              # forward(hidden [..., H]) routes the rows (view(-1, H))
        corrected = f.get("scoring") == "sigmoid_grouped"
        supported = (torch.float32, torch.bfloat16, torch.float16)

        def forward(self, hidden_states, *args, **kwargs):
            x = hidden_states
            w = self.weight
            if isinstance(x, torch.Tensor) and x.dim() > 2 and flattens:
                x = x.reshape(-1, x.shape[-1])
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
            corr = self.e_score_correction_bias if corrected else None     # read live: trained outside autograd
            weights, index = kernels(x.dtype).router(logits, wdt, corr)
            out = {"logits": logits, "weights": weights, "index": index}
            return tuple(out[r] for r in order)

        return forward


register(FusedRouter())
