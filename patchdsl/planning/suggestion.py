"""``patchdsl suggest``: the spec that patches everything patchdsl can on a model, written as a
person would write it.

Nothing here decides what an op accepts: every candidate rule is *planned* with the planner's own
selection, misfit and check logic (:func:`patchdsl.planning.plan.plan_index` with
:func:`patchdsl.planning.site_check.model_checker`), and only the sites that plan without a refusal are kept.
The candidates, per concern, in order of preference (the first op that plans on a module wins):

    attention  fused_qk_norm_rope (fuses q_norm/k_norm), then fused_rope
    norms      fused_rmsnorm, fused_layernorm (modules fused into an attention op are left out)
    mlp        fused_swiglu, fused_geglu, fused_mlp (plain, non-gated), fused_experts (routed experts),
               fused_router (MoE routers)
    loss       fused_linear_cross_entropy on the causal LM's lm_head

The spec has one rule per op, its selectors folded as a person writes them (``*.mlp`` when every
module of that kind named ``mlp`` is meant, ``model.layers.{0..3}.mlp`` for a subset, full paths for
single modules), a comment per rule saying what it fuses, and a comment for every module it cannot
patch with the reason (the refusal of each op tried, or why no structural kind fits it).  The
result is planned once more as a whole; a suggestion that does not plan cleanly is a bug
(:class:`SuggestError`).  Reads the model, never mutates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..model.index import ModelIndex, build_index
from ..model.inspection import fold_paths
from ..syntax.errors import SpecError


@dataclass(frozen=True)
class Candidate:
    concern: str          # norms / attention / mlp / loss (the census's columns)
    kind: str
    op: str
    flags: str            # flags as written in the rule ("" for none)
    what: str             # the rule's comment: what it fuses


# Decision order: attention first (fused_qk_norm_rope takes q_norm/k_norm away from the norm rule).
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("attention", "Attention", "fused_qk_norm_rope", "",
              "per-head q_norm, k_norm and RoPE of q and k in one kernel"),
    Candidate("attention", "Attention", "fused_rope", "", "RoPE of q and k in one launch"),
    Candidate("norms", "RMSNorm", "fused_rmsnorm", "", "RMSNorm, one kernel forward and one backward"),
    Candidate("norms", "LayerNorm", "fused_layernorm", "", "LayerNorm, one kernel forward and one backward"),
    Candidate("norms", "GatedRMSNorm", "fused_rmsnorm_gated", "",
              "gated RMSNorm of linear-attention layers (norm * w * act(gate)), one kernel forward and one backward"),
    Candidate("mlp", "SwiGLU", "fused_swiglu", "", "silu(gate) * up in one kernel (projections stay GEMMs)"),
    Candidate("mlp", "GeGLU", "fused_geglu", "", "gelu(gate) * up in one kernel (projections stay GEMMs)"),
    Candidate("mlp", "MLP", "fused_mlp", "",
              "plain MLP: the activation in one kernel, act(up(x)) recomputed in backward (projections stay GEMMs)"),
    Candidate("mlp", "Experts", "fused_experts", "",
              "routed experts: grouped GEMMs with the activation and the routing weights in their epilogues"),
    Candidate("mlp", "Router", "fused_router", "",
              "MoE router: its scoring (softmax, or DeepSeek-V3's sigmoid with the correction bias), grouped or "
              "plain top-k, renormalisation and scaling in one kernel (its linear stays a GEMM)"),
    Candidate("loss", "Linear", "fused_linear_cross_entropy", "ignore_index=-100, chunk=auto",
              "lm_head matmul + cross entropy in chunks: the logits never exist whole"),
)
CONCERNS = ("norms", "attention", "mlp", "loss")
# the order rules are written in (as the shipped specs: norms, attention, MLP, loss)
_WRITE_ORDER = {c: i for i, c in enumerate(CONCERNS)}
_INT = re.compile(r"^\d+$")
# cross-attention blocks (and their norms) run only with encoder / vision states: left alone
_CROSS = re.compile(r"(^|\.)(encoder_attn\w*|cross_attn\w*|crossattention\w*)(\.|$)")
CROSS_REASON = "part of a cross-attention block (runs only on encoder or vision states): left alone"


class SuggestError(RuntimeError):
    """The suggested spec did not plan cleanly (a bug in suggest; the message says what)."""


@dataclass
class Suggestion:
    """What :func:`suggest` found: the spec text, and per module what happened."""

    text: str
    model_class: str
    model_type: str | None
    patched: dict[str, str] = field(default_factory=dict)          # path -> op
    covered: dict[str, str] = field(default_factory=dict)          # child path -> the site fusing it
    unpatched: dict[str, str] = field(default_factory=dict)        # path -> reason
    concern_of: dict[str, str] = field(default_factory=dict)       # path -> norms/attention/mlp/loss
    rules: list[tuple[Candidate, list[str]]] = field(default_factory=list)

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per concern: (modules patched, modules present)."""
        out = {c: [0, 0] for c in CONCERNS}
        for p, c in self.concern_of.items():
            out[c][1] += 1
            if p in self.patched or p in self.covered:
                out[c][0] += 1
        return {c: (a, b) for c, (a, b) in out.items()}


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _concern(info) -> str | None:
    """Which column of the census a module counts in (None: not a module a spec is written for)."""
    ks = info.kinds
    if "MoEBlock" in ks:
        return None          # a sparse MoE block: its experts module (and shared-expert MLPs) are the sites
    if "Experts" in ks or "Router" in ks:
        return "mlp"
    if "Attention" in ks:
        return "attention"
    if "RMSNorm" in ks or "LayerNorm" in ks or "GatedRMSNorm" in ks:
        return "norms"
    if "SwiGLU" in ks or "GeGLU" in ks or "MLP" in ks:
        return "mlp"
    if info.path and _leaf(info.path) == "lm_head":
        return "loss"
    cls = info.cls
    leaf = _leaf(info.path) if info.path else ""
    if cls in ("ModuleList", "ModuleDict"):
        return None          # a container named like a norm (XLM's layer_norm1 list): its items are the sites
    if not info.path or "Linear" in ks or info.dtype is None:
        return None          # the root, a projection, or a module with no parameters (nn.Identity): nothing to fuse
    if re.search(r"(Norm|Norm1P|RMSNorm)$", cls) or re.search(r"(^|_)(norm|ln|layernorm)(_|$|\d)", leaf):
        return "norms"
    if re.search(r"(MLP|Mlp|FeedForward)$", cls) or leaf in ("mlp", "ffn", "feed_forward"):
        return "mlp"
    if re.search(r"(Attention|Attn)$", cls) or leaf in ("self_attn", "attention", "attn"):
        return "attention"
    return None


def _no_kind_reason(module: Any, info, concern: str) -> str:
    """Why no structural kind fits a module a spec author would want patched (one line)."""
    import torch

    cls = info.cls
    named = dict(module.named_children()) if module is not None else {}
    if concern == "mlp":
        if "experts" in named or "router" in named or "gate" in named and not hasattr(module, "gate_proj"):
            return _moe_reason(named)
        lin = [n for n, c in named.items() if isinstance(c, torch.nn.Linear)]
        if module is not None and "gate_proj" not in named and "gate_up_proj" not in named:
            from ..model.kinds.mlp import mlp_probe
            _, why = mlp_probe(module)
            if "projection pair" not in why:
                return f"an MLP fused_mlp does not take: {why}"
        if hasattr(module, "up_proj") and not hasattr(module, "gate_proj") or len(lin) == 2 and "gate_up_proj" not in named:
            return (f"a non-gated MLP ({' -> '.join(lin)} with an activation between) whose projections are not a "
                    f"pair fused_mlp knows (up_proj/down_proj, fc1/fc2, c_fc/c_proj, dense_h_to_4h/dense_4h_to_h, ...)")
        if any(isinstance(c, torch.nn.Dropout) for c in module.modules()):
            return f"holds dropout, which no MLP op reproduces"
        # (issue 25, norms2) a norm inside a gated MLP (BitNet's ffn_sub_norm on act(gate) * up, before down_proj)
        sub_norms = [n for n, c in named.items() if re.search(r"norm", n, re.I) or re.search(r"Norm$", type(c).__name__)]
        if sub_norms and (hasattr(module, "gate_proj") or hasattr(module, "w1")):
            act = _act_name(getattr(module, "act_fn", None) or getattr(module, "activation_fn", None))
            return (f"a gated MLP with a norm inside ({', '.join(sub_norms)}, applied to act(gate) * up before the down "
                    f"projection), which no gated-MLP op calls" + (f"; its activation is {act}" if act else "")
                    + f" (the norm itself is patched by the norm rule)")
        return f"not down(act(gate(x)) * up(x)) with silu or gelu (children: {', '.join(named) or 'none'})"
    if concern == "norms":
        w = getattr(module, "weight", None)
        if w is None and named:
            # (issue 25, norms2) AXK2's GatedRMSNorm: an inner norm gated by its own MLP; the inner norm is a site
            return (f"a norm built from child modules ({', '.join(named)}) with no weight of its own; no op for the "
                    f"whole (a child that is a norm is patched by the norm rule)")
        if w is None:
            return f"a norm without a weight; no op for it"
        if "1P" in cls:
            return f"LayerNorm with a (1 + w) scale (LayerNorm1P); no op for it yet"
        if named:
            return f"a norm with child modules ({', '.join(named)}); no op for it"
        return f"computes neither RMSNorm nor LayerNorm as patchdsl's probes know them"
    if concern == "attention":
        from ..model.kinds.misses import mla_misfit

        if mla_misfit(named):
            return mla_misfit(named)
        if "o_proj" not in named:
            outs = [n for n in named if n in ("dense", "out_proj", "c_proj", "o")]
            return (f"its projections are not q/k/v_proj (or qkv_proj) + o_proj "
                    f"(children: {', '.join(named) or 'none'})" + (f"; output through {outs[0]}" if outs else ""))
        cfg = getattr(module, "config", None)
        if cfg is None:
            return f"holds no config (head counts and rotary sizes are read from it)"
        return f"no rotary attention patchdsl recognises (q/k/v/o projections, head_dim and heads)"
    return f"fits no structural kind patchdsl knows"


def _act_name(act: Any) -> str | None:
    """The name of an MLP activation module/function, as :data:`model.kinds.mlp.MLP_ACTIVATIONS` knows it (None else)."""
    from ..model.kinds.mlp import MLP_ACTIVATIONS
    from ..model.reference import mlp_activation_reference

    if act is None or not callable(act):
        return None
    import torch

    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x.clone())
    except Exception:  # noqa: BLE001
        return None
    return next((n for n in MLP_ACTIVATIONS if isinstance(y, torch.Tensor) and y.shape == x.shape
                 and torch.allclose(y.double(), mlp_activation_reference(n)(x), rtol=1e-6, atol=1e-7)), None)


def _moe_reason(named: dict) -> str:
    """Why a mixture-of-experts block is not a MoEBlock: its experts' structural misfit, else its router's."""
    from ..model.kinds.experts import experts_misfit

    ex = named.get("experts")
    if ex is not None:
        why = experts_misfit(ex)
        if why:
            return f"MoE experts fit no Experts kind: {why}"
        return ("a MoE block whose router (gate / router) has no weight covering the experts, or whose top-k "
                "is not known")
    import torch

    held = [n for n, c in named.items()
            if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 3]
    if held:     # JetMoE: ParallelExperts input_linear / output_linear, fed tokens the block sorts by expert
        return (f"MoE experts as {' / '.join(held)} ({type(named[held[0]]).__name__}, 3-D weight) fed tokens the "
                "block sorts, not one Experts module")
    return ("a mixture-of-experts block without an experts child (3-D gate_up_proj / down_proj with "
            f"forward(hidden, top_k_index, top_k_weights)); children: {', '.join(named)}")


def _reasons(tried: list[str]) -> str:
    """The refusals of the ops tried on one module, as one line: a refusal that only points to an
    op tried after it ("... (use fused_rope)") is left out, that op's own refusal says more."""
    later = [t.split(":", 1)[0] for t in tried]
    keep = [t for n, t in enumerate(tried) if not any(f"use {o}" in t for o in later[n + 1:])] or tried
    by_reason: dict[str, list[str]] = {}          # the same reason from several ops is said once
    for t in keep:
        op, _, why = t.partition(": ")
        if not why:
            op, why = "", t
        by_reason.setdefault(why, [])
        if op and op not in by_reason[why]:
            by_reason[why].append(op)
    return "; ".join(f"{', '.join(ops)}: {why}" if ops else why for why, ops in by_reason.items())


def _rule_selectors(wanted: list[str], kind: str, index: ModelIndex) -> list[str]:
    """Selectors for a rule ``sel: kind -> op`` that select exactly ``wanted`` among the modules of
    ``kind``: ``*.leaf`` when every module of that kind named ``leaf`` is wanted (and there are
    several), else the paths folded over layer numbers."""
    pool = [i.path for i in index if i.path and kind in i.kinds]
    want = set(wanted)
    out: list[str] = []
    by_leaf: dict[str, list[str]] = {}
    for p in wanted:
        by_leaf.setdefault(_leaf(p), []).append(p)
    for leaf, paths in by_leaf.items():
        group = [q for q in pool if _leaf(q) == leaf]
        if len(paths) > 1 and all(q in want for q in group) and all("." in q for q in group):
            out.append(f"*.{leaf}")
        else:
            out.extend(fold_paths(paths))
    return out


def _plan_text(text: str, index: ModelIndex, check, target: str, dtypes: tuple[str, ...]):
    from .check import check_spec
    from .plan import plan_index
    from ..syntax import parse_spec

    return plan_index(check_spec(parse_spec(text, "<suggest>")), index, target=target, dtypes=dtypes, check=check)


def _fmt_rule(c: Candidate, sels: list[str]) -> str:
    return f"{', '.join(sels)}: {c.kind} -> {c.op}" + (f"({c.flags})" if c.flags else "")


def suggest(model: Any, *, dtypes: tuple[str, ...] = ("bf16", "fp32"), target: str | None = None,
            name: str | None = None, skip: Mapping[str, str] | None = None,
            images: bool | str | None = None) -> Suggestion:
    """The suggested spec for ``model`` (a module; the meta device is fine).  See the module doc.
    ``skip``: module paths to leave out, with the reason listed for them (the census passes the modules
    that did not run in a forward of the model: :func:`modules_not_run`).  ``images`` (vision-language
    models): True includes the vision tower and projector (verify feeds them an image batch:
    :mod:`patchdsl.parity.images`); None leaves them out with :data:`VISION_REASON`; a string leaves
    them out with it as the reason no image batch can be built."""
    vision = {} if images is True else vision_modules(model, images if isinstance(images, str) else None)
    skip = {**dict(skip or {}), **vision}      # the vision tower's reason (no images) before "did not run"
    from ..ops.registry import get_op
    from .site_check import model_checker

    if target is None:
        from ..codegen.env import target as _target
        target = _target()
    index = build_index(model)
    check = model_checker(model)
    modules = dict(model.named_modules())
    taken: dict[str, Candidate] = {}
    covered: dict[str, str] = {}
    tried: dict[str, list[str]] = {}      # path -> "op: reason" of each op that refused it
    dts = tuple(dtypes)
    dline = f"dtype {', '.join(dts)}\n"
    for c in CANDIDATES:
        op = get_op(c.op)
        fit = []
        for i in index:
            if not i.path or c.kind not in i.kinds or i.path in taken or i.path in covered:
                continue
            if _CROSS.search(i.path):
                tried.setdefault(i.path, []).append(CROSS_REASON)
                continue
            if i.path in skip:
                tried.setdefault(i.path, []).append(skip[i.path])
                continue
            why = op.misfit(i, index)
            if why:
                if c.kind != "Linear" or _leaf(i.path) == "lm_head":
                    tried.setdefault(i.path, []).append(f"{c.op}: {why}")
                continue
            fit.append(i.path)
        if not fit:
            continue
        text = dline + _fmt_rule(c, fold_paths(fit)) + "\n"
        try:
            p = _plan_text(text, index, check, target, dts)
        except SpecError as e:
            msg = str(e).splitlines()[0]
            for path in fit:
                tried.setdefault(path, []).append(f"{c.op}: {msg}")
            continue
        for s in p.sites:
            if s.refused:
                tried.setdefault(s.path, []).append(f"{c.op}: {s.refused}")
            elif not any(cp in taken for cp in s.covers):
                taken[s.path] = c
                for cp in s.covers:
                    covered[cp] = s.path

    # one rule per op, in write order; the whole spec must plan with no refusal and select exactly
    # what was decided (else fall back to plain folded paths for that rule)
    per_op: dict[str, list[str]] = {}
    for path, c in taken.items():
        per_op.setdefault(c.op, []).append(path)
    by_name = {c.op: c for c in CANDIDATES}
    ordered = sorted(per_op, key=lambda o: (_WRITE_ORDER[by_name[o].concern], [c.op for c in CANDIDATES].index(o)))
    rules: list[tuple[Candidate, list[str]]] = []
    for o in ordered:
        c = by_name[o]
        paths = [i.path for i in index if i.path in set(per_op[o])]       # model order
        sels = _rule_selectors(paths, c.kind, index)
        rules.append((c, sels))
    body = dline + "".join(_fmt_rule(c, s) + "\n" for c, s in rules)
    try:
        plan = _plan_text(body, index, check, target, dts) if rules else None
    except SpecError as e:
        raise SuggestError(f"the suggested spec does not plan: {e}") from None
    if plan is not None:
        got = {s.path: s.op for s in plan.sites}
        bad = [s for s in plan.sites if s.refused]
        if bad or got != {p: c.op for p, c in taken.items()}:
            # compact selectors reached further than meant: write every rule with exact paths
            rules = [(c, fold_paths([i.path for i in index if i.path in set(per_op[c.op])])) for c, _ in rules]
            body = dline + "".join(_fmt_rule(c, s) + "\n" for c, s in rules)
            plan = _plan_text(body, index, check, target, dts)
            got = {s.path: s.op for s in plan.sites}
            if any(s.refused for s in plan.sites) or got != {p: c.op for p, c in taken.items()}:
                raise SuggestError("the suggested spec does not select what was planned: "
                                   + ", ".join(sorted(set(got) ^ set(taken)))[:300])

    # what is left unpatched, and why
    concern_of: dict[str, str] = {}
    unpatched: dict[str, str] = {}
    for i in index:
        con = _concern(i)
        if con is None:
            continue
        concern_of[i.path] = con
        if i.path in taken or i.path in covered:
            continue
        if i.path in tried:
            unpatched[i.path] = _reasons(tried[i.path])
        elif con == "loss":
            from ..ops.loss_path import head_module_reason
            parent = modules.get(i.path.rsplit(".", 1)[0] if "." in i.path else "")
            unpatched[i.path] = head_module_reason(modules.get(i.path), parent)
        else:
            unpatched[i.path] = _no_kind_reason(modules.get(i.path), i, con)

    # the text
    from .._version import __version__

    who = name or index.model_class
    head = [f"# {who} ({index.model_type or 'no model_type'}): suggested by patchdsl {__version__} from the "
            f"model's structure", "# (patchdsl suggest; plan, apply and verify it before relying on it)"]
    lines = head + [dline.rstrip(), ""]
    for c, sels in rules:
        n = len(per_op[c.op])
        facts = _rule_facts(c, [index.infos[p] for p in per_op[c.op]])
        lines.append(f"# {c.what}: {n} module{'s' if n != 1 else ''}{facts}")
        lines.append(_fmt_rule(c, sels))
    if unpatched:
        lines.append("")
        lines.append("# not patched:")
        groups: dict[tuple[str, str], list[str]] = {}
        for p, why in unpatched.items():
            groups.setdefault((index.infos[p].cls, why), []).append(p)
        for (cls, why), paths in groups.items():
            lines.append(f"#   {', '.join(fold_paths(paths))} ({cls}): {why}")
    text = "\n".join(lines) + "\n"
    return Suggestion(text, index.model_class, index.model_type, {p: c.op for p, c in taken.items()}, covered,
                      unpatched, concern_of, rules)


def _rule_facts(c: Candidate, infos: list) -> str:
    """A few facts of the selected modules for the rule's comment (", hidden 1024, eps 1e-06")."""
    vals: dict[str, set] = {}
    keys = {"RMSNorm": ("hidden", "eps", "offset"), "LayerNorm": ("hidden", "eps"),
            "GatedRMSNorm": ("hidden", "eps", "activation"),
            "SwiGLU": ("hidden", "intermediate"), "GeGLU": ("hidden", "intermediate", "activation"),
            "MLP": ("hidden", "intermediate", "activation"),
            "Attention": ("head_dim", "rotary_dim"), "Linear": ("in_features", "out_features")}.get(c.kind, ())
    for i in infos:
        f = i.kinds.get(c.kind, {})
        for k in keys:
            vals.setdefault(k, set()).add(f.get(k))
    parts = []
    for k in keys:
        v = vals.get(k, set())
        if len(v) == 1:
            x = next(iter(v))
            if x is None:
                continue
            parts.append(f"{k} {x:g}" if isinstance(x, float) else f"{k} {x}")
    return (" (" + ", ".join(parts) + ")") if parts else ""


VISION_REASON = ("outside the language tower of a vision-language model: it runs only on batches with images "
                 "(suggest --images includes it; verify then feeds an image batch, docs/verify.md): left alone")


def vision_modules(model: Any, why: str | None = None) -> dict[str, str]:
    """A vision-language model's modules outside its language tower and LM head (the vision tower, the
    projector), each with :data:`VISION_REASON` (or, given ``why`` no image batch can be built, a reason
    saying so); {} for a model without a ``vision_config``."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vision_config", None) is None:
        return {}
    from ..model.modules import decoder_layers

    found = decoder_layers(model)
    if found is None:
        return {}
    tower = found[0].rsplit(".", 1)[0] if "." in found[0] else ""     # model.language_model(.layers)
    if not tower:
        return {}
    keep = (tower, "lm_head")
    reason = VISION_REASON if why is None else (
        f"vision tower / projector, runs only on images; no image batch runs on this model: {why}: left alone")
    return {n: reason for n, _ in model.named_modules()
            if n and not any(n == k or n.startswith(k + ".") or k.startswith(n + ".") for k in keep)}


NOT_RUN_REASON = "did not run in a forward of this model (a path its configuration does not take): left alone"


def modules_not_run(model: Any, *, seq: int = 8, inputs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Module paths of ``model`` (real weights, CPU) that one forward with labels does not call, each with
    :data:`NOT_RUN_REASON`.  Patching them is harmless but verify cannot judge a site that never runs.
    ``inputs``: the batch to run (a vision-language model's image batch, as verify feeds it); default
    ``seq`` random token ids."""
    import torch

    ran: set[str] = set()
    hooks = []
    names = {id(m): n for n, m in model.named_modules()}
    for n, m in model.named_modules():
        hooks.append(m.register_forward_pre_hook(lambda mod, _a, _n=n: ran.add(_n)))
    try:
        if inputs is not None:
            with torch.no_grad():
                model(**inputs)
        else:
            vocab = int(model.config.get_text_config().vocab_size)
            ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                model(input_ids=ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    del names
    return {n: NOT_RUN_REASON for n, _ in model.named_modules() if n and n not in ran}
