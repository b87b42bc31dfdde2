"""Mixture of experts (issue 24): the sparse MoE block and the router module, their routing probed."""

from __future__ import annotations

from typing import Any, Mapping

from ..modules import _torch, linear_like
from .experts import _expert_params, config_top_k, experts
from .probe import stand_in
from .registry import kind


MOE_ROUTER_NAMES = ("gate", "router")
MOE_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")


def router_scaling(r: Any) -> float:
    """A router's ``routed_scaling_factor`` (1.0 when it has none)."""
    sf = r.__dict__.get("routed_scaling_factor", 1.0)
    return float(sf) if isinstance(sf, (int, float)) and not isinstance(sf, bool) and sf else 1.0


def router_groups(r: Any) -> tuple[int | None, int | None]:
    """(n_group, topk_group) a router holds (``num_group`` or ``n_group``; None when absent)."""
    ng = r.__dict__.get("num_group")
    ng = ng if ng is not None else r.__dict__.get("n_group")
    tg = r.__dict__.get("topk_group")
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0      # noqa: E731
    return (ng if ok(ng) else None), (tg if ok(tg) else None)


def grouped_route(scores: Any, choice: Any, top_k: int, n_group: int, topk_group: int, group_score: str) -> Any:
    """Top-k indices of a grouped router (DeepSeek-V2 group_limited_greedy, DeepSeek-V3 / GLM-4.5 /
    dots1 noaux_tc), written as transformers writes it: group score = the top-2 sum (``"top2"``) or the
    max (``"max"``) of ``choice`` within each of ``n_group`` equal groups; the ``topk_group`` best groups
    kept (the other experts masked); ``torch.topk(sorted=False)`` of the masked choice."""
    torch = _torch()
    E = choice.shape[-1]
    grouped = choice.view(-1, n_group, E // n_group)
    gs = grouped.topk(2, dim=-1)[0].sum(-1) if group_score == "top2" else grouped.max(dim=-1).values
    gidx = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    fill = float("-inf") if group_score == "top2" else 0.0
    return torch.topk(choice.masked_fill(~smask.bool(), fill), k=top_k, dim=-1, sorted=False)[1]


def _match_scoring(facts: dict, candidates, ow: Any, oi: Any, *, rtol: float, atol: float) -> None:
    """Set ``facts["scoring"]`` (and the formula's extra facts) to the first candidate formula that
    picks the same experts as the module (``oi``) with the same weights (``ow``), slot order aside."""
    torch = _torch()
    for name, extra, cw, ci in candidates:
        if ci.shape == oi.shape and torch.equal(torch.sort(ci, -1)[0], torch.sort(oi, -1)[0]):
            order_o, order_c = torch.argsort(oi, -1), torch.argsort(ci, -1)
            if torch.allclose(ow.double().gather(1, order_o), cw.gather(1, order_c), rtol=rtol, atol=atol):
                facts["scoring"] = name
                facts.update(extra)
                return


def _router_candidates(r: Any, x: Any, wt: Any, bias: Any, facts: Mapping[str, Any]):
    """(name, extra facts, weights, indices) of each routing formula for ``r``'s attributes."""
    torch = _torch()
    logits = torch.nn.functional.linear(x, wt, bias)
    k = facts["top_k"]
    E = logits.shape[-1]
    sf = router_scaling(r)
    scaled = {"scaling": sf} if sf != 1.0 else {}
    out = []
    probs = torch.softmax(logits, dim=-1)
    v, ix = torch.topk(probs, k, dim=-1)
    out.append(("softmax_topk", {"norm_topk": False, **scaled}, v * sf, ix))
    out.append(("softmax_topk", {"norm_topk": True, **scaled}, v / v.sum(-1, keepdim=True) * sf, ix))
    v2, ix2 = torch.topk(logits, k, dim=-1)
    out.append(("topk_softmax", {"norm_topk": True}, torch.softmax(v2, dim=-1), ix2))
    ng, tg = router_groups(r)
    corr = getattr(r, "e_score_correction_bias", None)
    if isinstance(corr, torch.Tensor):
        # DeepSeek-V3 / GLM-4.5 / dots1 (noaux_tc): sigmoid scores, the correction bias for the choice only,
        # groups by their top-2 sum (one group when the router names none)
        ng, tg = ng or 1, tg or ng or 1
        if E % ng == 0 and E // ng >= 2 and tg <= ng:
            scores = logits.sigmoid()
            ix3 = grouped_route(scores, scores + facts["_corr"], k, ng, tg, "top2")
            w3 = scores.gather(1, ix3)
            for norm in (True, False):
                ww = w3 / (w3.sum(-1, keepdim=True) + 1e-20) if norm else w3
                out.append(("sigmoid_grouped", {"norm_topk": norm, "n_group": ng, "topk_group": tg,
                                                "scaling": sf}, ww * sf, ix3))
            # Kolibri1: the bias added to the logits for the choice (sigmoid is monotone, but the bias is not
            # added after it), the weights the sigmoid of the chosen logits, renormalised without an epsilon
            ix5 = grouped_route(logits, logits + facts["_corr"], k, ng, tg, "top2")
            w5 = logits.gather(1, ix5).sigmoid()
            for norm in (True, False):
                ww = w5 / w5.sum(-1, keepdim=True) if norm else w5
                out.append(("sigmoid_grouped", {"norm_topk": norm, "n_group": ng, "topk_group": tg, "scaling": sf,
                                                "bias_on": "logits", "norm_eps": 0.0}, ww * sf, ix5))
    elif (ng is not None and tg is not None and E % ng == 0 and tg < ng
          and r.__dict__.get("topk_method") != "greedy"):
        # DeepSeek-V2 group_limited_greedy: softmax scores, groups by their max, no renormalisation; tried
        # first (an ungrouped softmax top-k can match a grouped router on the probe's tokens by chance)
        ix4 = grouped_route(probs, probs, k, ng, tg, "max")
        w4 = probs.gather(1, ix4)
        out.insert(0, ("softmax_grouped", {"norm_topk": False, "n_group": ng, "topk_group": tg, "scaling": sf},
                       w4 * sf, ix4))
    return out


def _router_roles(out: Any, k: int) -> tuple[Any, Any] | None:
    """(top-k weights, top-k indices) among a router's three outputs: the indices are the one integer
    tensor, wherever it stands (transformers 5.17's GraniteMoe router returns (index, weights, logits),
    5.24's (logits, weights, index)); the weights stand in the middle in both."""
    torch = _torch()
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    ints = [t for t in out if not t.is_floating_point()]
    w = out[1]
    if len(ints) != 1 or not w.is_floating_point() or w.dim() != 2 or w.shape[-1] != k:
        return None
    return w, ints[0]


def _int_top_k(v: Any, E: int) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= E else None


def _router_width(r: Any, E: int) -> int | None:
    """How many classes a router without an own [experts, hidden] weight scores: the narrowest output
    of its 2-D weights (own or of Linear children) that is ``E`` or more (a skip expert, shared experts
    scored alongside); None when no weight of the router covers the experts."""
    torch = _torch()
    widths = [int(p.shape[0]) for _, p in r.named_parameters() if isinstance(p, torch.Tensor) and p.dim() == 2]
    return min((w for w in widths if w >= E), default=None)


@kind("MoEBlock", "a sparse MoE block: a router (softmax or sigmoid, top-k, DeepSeek-V3 grouped top-k with "
      "score-correction bias; probed), an Experts module and optional shared experts")
def moe_block(m: Any) -> dict | None:
    torch = _torch()
    ex = m._modules.get("experts")
    if ex is None or _expert_params(ex) is None:
        return None
    fe = experts(ex)
    if not fe:
        return None
    rname = next((n for n in MOE_ROUTER_NAMES if isinstance(m._modules.get(n), torch.nn.Module)), None)
    if rname is None:
        return None
    r = m._modules[rname]
    w = r._parameters.get("weight")
    if w is None:
        lin = linear_like(r)
        w = lin.weight if lin is not None else None
    probe = isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == fe["experts"]
    if not probe:
        # a router whose scores come from elsewhere than its own [experts, hidden] weight: a Linear
        # child (AFMoE's gate, HunYuan's wg), a router MLP (ZAYA: experts + 1 classes, the last a skip
        # expert), shared experts scored with the routed ones (Inkling: [experts + shared, hidden]).
        # Its formula is not probed (scoring "unknown"); the block is still a MoE block.
        width = _router_width(r, fe["experts"])
        if width is None:
            return None
    k = _int_top_k(r.__dict__.get("top_k"), fe["experts"]) or _int_top_k(m.__dict__.get("top_k"), fe["experts"])
    cfg = getattr(m, "config", None) or getattr(r, "config", None)
    if k is None:
        k = config_top_k(cfg, fe["experts"]) or fe.get("top_k")
    if k is None:
        return None
    facts: dict[str, Any] = {"experts": fe["experts"], "top_k": int(k), "hidden": fe["hidden"], "router": rname,
                             "scoring": "unknown", "norm_topk": None}
    if not probe:
        facts["router_width"] = width
        return _moe_block_rest(m, fe, facts)
    E, h = fe["experts"], int(w.shape[1])
    rf = router(r) if not isinstance(r, torch.nn.Linear) else None
    if rf and rf["scoring"] != "unknown" and rf["experts"] == E and rf["top_k"] == int(k):
        # the router is a Router: its probed routing is the block's (one probe, so inspect's two rows agree)
        facts.update({a: rf[a] for a in ROUTER_ROUTING_FACTS if a in rf})
        return _moe_block_rest(m, fe, facts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, h, generator=g, dtype=torch.float64)
    # logits of unit scale: an unscaled [E, h] weight at h = 2048 gives logits ~45 whose softmax underflows
    # to exact 0/1 ties (Qwen3-30B-A3B's block read "scoring=unknown")
    wt = torch.randn(E, h, generator=g, dtype=torch.float64) / h ** 0.5
    params = {"weight": wt}
    b = r._parameters.get("bias")
    bt = None
    if isinstance(b, torch.Tensor):
        bt = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
        params["bias"] = bt
    corr = torch.randn(E, generator=g, dtype=torch.float64) * 0.05
    facts["_corr"] = corr
    if isinstance(r, torch.nn.Linear):
        facts["scoring"] = "linear"     # the block's own forward does the routing (not probed)
    else:
        clone = stand_in(r, **params)
        if isinstance(getattr(r, "e_score_correction_bias", None), torch.Tensor):
            clone._buffers["e_score_correction_bias"] = corr
        try:
            with torch.no_grad():
                out = type(r).forward(clone, x.clone())
        except Exception:
            out = None
        roles = _router_roles(out, int(k))
        if roles is not None:
            _match_scoring(facts, _router_candidates(r, x, wt, bt, facts), *roles, rtol=1e-6, atol=1e-9)
    facts.pop("_corr")
    return _moe_block_rest(m, fe, facts)


def _moe_block_rest(m: Any, fe: Mapping[str, Any], facts: dict) -> dict:
    torch = _torch()
    shared = next((n for n in MOE_SHARED_NAMES if isinstance(m._modules.get(n), torch.nn.Module)), None)
    facts["shared"] = shared
    facts["shared_gate"] = isinstance(m._modules.get("shared_expert_gate"), torch.nn.Module)
    facts["activation"] = fe["activation"]
    return facts


# ---- the router module (issue 24: fused_router) ---------------------------------------------------
ROUTER_SCORINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "softmax_grouped", "unknown")
# the facts that say how a router routes (shared by the Router and MoEBlock kinds)
ROUTER_ROUTING_FACTS = ("scoring", "norm_topk", "n_group", "topk_group", "scaling", "bias_on", "norm_eps")
ROUTER_ROLES = ("logits", "weights", "index")


def router_holds(m: Any) -> str:
    """What a router holds that bears on its routing, for a refusal: its routing attributes (top_k,
    norm_topk_prob, routed_scaling_factor, n_group / topk_group, topk_method, a score-correction bias,
    ...) as ``name=value``."""
    torch = _torch()
    held = []
    for a in ("top_k", "norm_topk_prob", "routed_scaling_factor", "num_group", "n_group", "topk_group",
              "topk_method", "scoring_func", "score_func", "router_jitter_noise", "jitter_noise"):
        v = m.__dict__.get(a)
        if isinstance(v, (bool, int, float, str)):
            held.append(f"{a}={v}")
    for a in ("e_score_correction_bias", "expert_bias"):
        t = getattr(m, a, None)
        if isinstance(t, torch.Tensor):
            held.append(f"{a} {list(t.shape)}")
    return ", ".join(held) or "no routing attributes"


def _router_flattens(m: Any, wt: Any, bt: Any, corr: Any, x: Any, r32: Any) -> bool:
    """Whether ``m``'s forward takes a [batch, seq, hidden] input as its [batch * seq, hidden] rows
    (``hidden_states.view(-1, hidden_dim)``: DeepSeek-V3's block hands the router the 3-D states)."""
    torch = _torch()
    params = {"weight": wt}
    if bt is not None:
        params["bias"] = bt
    clone = stand_in(m, **params)
    if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
        clone._buffers["e_score_correction_bias"] = corr.clone()
    try:
        with torch.no_grad():
            out = type(m).forward(clone, x.view(3, 3, -1))
    except Exception:
        return False
    return _same_outputs(out, r32)


def _same_outputs(out: Any, r32: Any) -> bool:
    torch = _torch()
    order = r32[3].split("_")
    ref = {"logits": r32[0], "weights": r32[1], "index": r32[2]}
    return (isinstance(out, tuple) and len(out) == 3
            and all(isinstance(t, torch.Tensor) and t.shape == ref[n].shape and torch.equal(t, ref[n])
                    for t, n in zip(out, order)))


@kind("Router", "a mixture-of-experts router: a [experts, hidden] weight (optional bias) and a top_k, "
      "forward(hidden) -> router logits, top-k weights, top-k indices (in any order); scoring (softmax then "
      "top-k with or without renormalising, top-k then softmax, DeepSeek-V3's sigmoid grouped top-k) and "
      "output dtypes probed")
def router(m: Any) -> dict | None:
    torch = _torch()
    k = m.__dict__.get("top_k")
    w = m._parameters.get("weight")
    if (not isinstance(k, int) or isinstance(k, bool) or not isinstance(w, torch.Tensor) or w.dim() != 2
            or m._modules or isinstance(m, (torch.nn.Linear, torch.nn.Embedding))):
        return None
    E, H = int(w.shape[0]), int(w.shape[1])
    if not 0 < k < E or H < 1:
        return None
    b = m._parameters.get("bias")
    if b is not None and (b.dim() != 1 or b.shape[0] != E):
        return None
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, H, generator=g)
    wt = torch.randn(E, H, generator=g) / H ** 0.5
    bt = torch.randn(E, generator=g) * 0.1 if b is not None else None
    corr = torch.randn(E, generator=g) * 0.05

    def run(dt):
        params = {"weight": wt.to(dt)}
        if bt is not None:
            params["bias"] = bt.to(dt)
        clone = stand_in(m, **params)
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
            clone._buffers["e_score_correction_bias"] = corr.clone()
        try:
            with torch.no_grad():
                out = type(m).forward(clone, x.to(dt))
        except Exception:
            return None
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
            return None
        ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
        lin = torch.nn.functional.linear
        ref = lin(x.to(dt), wt.to(dt), bt.to(dt) if bt is not None else None)      # in the input dtype
        ref32 = lin(x.to(dt).float(), wt.to(dt).float(), bt.to(dt).float() if bt is not None else None)
        lg = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape == (9, E)
              and (torch.equal(t, ref.to(t.dtype)) or torch.equal(t, ref32.to(t.dtype)))]
        if len(ints) != 1 or len(lg) != 1 or out[ints[0]].shape != (9, k):
            return None
        wi = 3 - ints[0] - lg[0]
        if wi == ints[0] or wi == lg[0] or out[wi].shape != (9, k) or not out[wi].is_floating_point():
            return None
        order = [""] * 3
        order[lg[0]], order[wi], order[ints[0]] = "logits", "weights", "index"
        linear = "input" if torch.equal(out[lg[0]], ref.to(out[lg[0]].dtype)) else "float32"
        return out[lg[0]], out[wi], out[ints[0]], "_".join(order), linear      # e.g. "logits_weights_index"

    r32, rb = run(torch.float32), run(torch.bfloat16)
    if r32 is None or rb is None or r32[3] != rb[3]:
        return None
    facts: dict[str, Any] = {"experts": E, "hidden": H, "top_k": int(k), "bias": b is not None, "order": r32[3],
                             "scoring": None, "norm_topk": None, "_corr": corr.double(),
                             "flattens": _router_flattens(m, wt, bt, corr, x, r32)}
    _match_scoring(facts, _router_candidates(m, x.double(), wt.double(), bt.double() if bt is not None else None,
                                             facts), r32[1], r32[2], rtol=1e-5, atol=1e-7)
    facts.pop("_corr")
    if facts["scoring"] is None:
        # a router by structure whose weights no formula above gives: a Router of scoring "unknown", so a
        # rule naming it is refused with what it holds (fused_router's misfit) rather than fitting no kind
        facts.update(scoring="unknown", routing=router_holds(m))
    lb, wb = rb[0], rb[1]
    # dtypes (bf16 probe): the logits in the input dtype or float32 (and computed in which), the weights
    # in the logits' dtype (Qwen3-MoE: .to(router_logits.dtype)), float32 (Mixtral) or the input's (GraniteMoe)
    facts["linear"] = rb[4]
    facts["logits_dtype"] = "float32" if lb.dtype == torch.float32 else "input"
    facts["weights_dtype"] = ("logits" if wb.dtype == lb.dtype else "float32" if wb.dtype == torch.float32
                              else "input")
    return facts
