"""fused_router's routings of issue 37 against float64: DeepSeek-V3 / GLM-4.5 / dots1's sigmoid grouped
top-k (score-correction bias for the choice only, groups ranked by their top-2 sum, renormalisation with
+1e-20, routed scaling), DeepSeek-V2's softmax routers (routed scaling; group-limited greedy), and the
softmax families again, each against a float64 run of transformers' own router code.

"A float64 run of HF's own module": the routers of these families cast to float32 inside their forward
(``hidden_states.type(torch.float32)``, ``softmax(dtype=torch.float)``, ``.float()``), so a module
moved to float64 still routes in float32.  ``hf_forward_f64`` executes the class's own ``forward``
source with ``torch.float32`` / ``torch.float`` / ``.float()`` read as float64 (nothing else changed),
on a float64 copy of the module and the same (already rounded) inputs.

Ties: transformers uses ``torch.topk(sorted=False)`` (exact ties broken the device's way, the k slots in
the device's order); the kernel orders the k slots by descending choice score, exact ties to the lower
index.  So the comparisons are per (token, expert) -- the weights scattered onto the experts -- and the
inputs are random with no near-ties where the routing is computed in fp32 on both sides (asserted: the
k-th and (k+1)-th choice scores, and the kept and the best dropped group, differ by more than 1e-5).
Where a family computes its logits in bf16 (the softmax families in bf16), the float64 logits differ from
the bf16 ones by bf16 rounding: tokens whose expert sets differ must be near-ties of the float64 choice,
and are left out of the weight and gradient comparisons (verify's rule).

Cases that must fail: the same comparisons against kernels broken in the ways the routing can be got
wrong (the bias ignored in the choice, the bias added to the weights, groups ranked by their best
score, the other groups not masked, the scaling dropped, the sigmoid's derivative dropped).  Kolibri1's
variant (the bias added to the logits for the choice, no epsilon in the renormalisation) is in both tables.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import patchdsl.runtime.patch as runtime_patch
from patchdsl.codegen import render
from patchdsl.model.reference import router_reference

from ..runtime.test_mutations import Edit, apply_edits
from .helpers import DEVICE, TARGET, TORCH_DTYPES, assert_close, kernel_for

OP = "fused_router"
GAP = 1e-5          # the least margin of a choice computed in fp32 on both sides (no near-ties)


# ---------------------------------------------------------------- transformers' own code in float64
class _Torch64(types.ModuleType):
    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


def hf_forward_f64(module):
    """``type(module).forward`` as transformers wrote it, with float32 read as float64."""
    cls = type(module)
    src = textwrap.dedent(inspect.getsource(cls.forward)).replace(".float()", ".double()")
    src = re.sub(r"^@.*\n", "", src, flags=re.M)
    g = dict(sys.modules[cls.__module__].__dict__)
    g["torch"] = _Torch64("torch")
    ns: dict = {}
    exec(compile(src, f"<float64 {cls.__name__}.forward>", "exec"), g, ns)
    return ns["forward"]


def _roles(out):
    """(logits, weights, indices) of a router's three outputs, whatever their order."""
    idx = next(t for t in out if not t.is_floating_point())
    w = next(t for t in out if t.is_floating_point() and t.shape == idx.shape)
    lg = next(t for t in out if t.is_floating_point() and t is not w)
    return lg, w, idx


def _dense(w, idx, E):
    return torch.zeros(idx.shape[0], E, dtype=torch.float64).scatter(1, idx.long().cpu(), w.detach().double().cpu())


def _choice64(gate, logits64, facts):
    """The float64 choice scores (the masked c of the grouped routers, the logits otherwise) and the least
    group margin (inf without a group stage)."""
    scoring = facts["scoring"]
    if scoring == "softmax_topk":
        return logits64, float("inf")
    s = logits64.sigmoid() if scoring == "sigmoid_grouped" else torch.softmax(logits64, -1)
    base = logits64 if facts.get("bias_on") == "logits" else s
    c = base + gate.e_score_correction_bias.double().cpu() if scoring == "sigmoid_grouped" else s
    ng, tg = facts["n_group"], facts["topk_group"]
    if tg >= ng:
        return c, float("inf")
    E = c.shape[-1]
    gv = torch.sort(c.view(-1, ng, E // ng), -1, descending=True)[0]
    gs = gv[..., :2].sum(-1) if scoring == "sigmoid_grouped" else gv[..., 0]
    gsorted, gix = torch.sort(gs, -1, descending=True)
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gix[:, :tg], True)
    keep = keep.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
    return c.masked_fill(~keep, float("-inf")), float((gsorted[:, tg - 1] - gsorted[:, tg]).min())


# ---------------------------------------------------------------- kernel level
def grouped_kernels(E, k, scoring, n_group, topk_group, norm, scaling, dtype="fp32", bias_on="scores"):
    facts = {"experts": E, "top_k": k, "norm_topk": norm, "hidden": 32, "scoring": scoring,
             "n_group": n_group, "topk_group": topk_group, "scaling": scaling}
    if bias_on == "logits":
        facts.update(bias_on="logits", norm_eps=0.0)
    return kernel_for(OP, "Router", facts, dtype)


# (tokens, experts, top_k, scoring, n_group, topk_group, renormalise, scaling, logits dtype, weights dtype)
CASES = [
    (37, 8, 2, "sigmoid_grouped", 4, 2, True, 2.5, "fp32", "fp32"),
    (33, 6, 3, "sigmoid_grouped", 3, 2, False, 1.0, "fp32", "fp32"),     # 6 experts in a tile of 8: masked
    (21, 256, 8, "sigmoid_grouped", 8, 4, True, 2.5, "fp32", "fp32"),    # DeepSeek-V3 / Kimi-K2's router
    (19, 160, 8, "sigmoid_grouped", 1, 1, True, 2.5, "fp32", "fp32"),    # GLM-4.5's (one group)
    (23, 128, 6, "sigmoid_grouped", 1, 1, True, 2.5, "bf16", "fp32"),    # dots1's, bf16-rounded logits
    (31, 16, 4, "softmax_grouped", 4, 2, False, 16.0, "fp32", "fp32"),   # DeepSeek-V2's group-limited greedy
    (29, 8, 2, "softmax_topk", 1, 1, False, 1.25, "fp32", "fp32"),       # DeepSeek-V2's greedy, scaled
    (27, 16, 4, "sigmoid_logits", 1, 1, True, 1.0, "fp32", "fp32"),      # Kolibri1: the bias on the logits
    (1, 8, 2, "sigmoid_grouped", 2, 1, True, 1.0, "fp32", "bf16"),
    (0, 8, 2, "sigmoid_grouped", 4, 2, True, 1.0, "fp32", "fp32"),
]


def _case_inputs(n, E, scoring, ldt, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, E, generator=g) * 2).to(TORCH_DTYPES[ldt])
    bias = (torch.randn(E, generator=g) * 0.3) if scoring.startswith("sigmoid") else None
    return logits, bias, g


def _split(scoring):
    """("sigmoid_logits" is the table's name for sigmoid_grouped with the bias on the logits) -> (scoring, bias_on)."""
    return ("sigmoid_grouped", "logits") if scoring == "sigmoid_logits" else (scoring, "scores")


def _reference(logits, bias, k, scoring, ng, tg, norm, sf):
    scoring, bias_on = _split(scoring)
    l64 = logits.detach().double().cpu().requires_grad_(True)
    w64, i64 = router_reference(l64, k, scoring, norm, bias=None if bias is None else bias.double(),
                                n_group=ng, topk_group=tg, scaling=sf, bias_on=bias_on,
                                norm_eps=0.0 if bias_on == "logits" else 1e-20)
    return l64, w64, i64


def _margins(logits, bias, k, scoring, ng, tg):
    scoring, bias_on = _split(scoring)
    facts = {"scoring": scoring, "n_group": ng, "topk_group": tg, "bias_on": bias_on}
    gate = types.SimpleNamespace(e_score_correction_bias=bias)
    c, gmargin = _choice64(gate, logits.double().cpu(), facts)
    top = torch.sort(c, -1, descending=True)[0]
    emargin = float((top[:, k - 1] - top[:, k]).min()) if c.shape[-1] > k else float("inf")
    return min(gmargin, emargin)


def _compare(w, idx, w64, i64, wdt, E):
    """Same experts per token, same weights per (token, expert)."""
    assert torch.equal(torch.sort(idx.cpu(), -1)[0], torch.sort(i64, -1)[0]), "top-k experts differ"
    assert_close(_dense(w, idx, E), _dense(w64, i64, E), wdt, "top-k weights")


@pytest.mark.parametrize("n,E,k,scoring,ng,tg,norm,sf,ldt,wdt", CASES,
                         ids=[f"t{c[0]}-e{c[1]}-k{c[2]}-{c[3]}-g{c[4]}of{c[5]}-{'norm' if c[6] else 'raw'}-s{c[7]}-"
                              f"{c[8]}-w{c[9]}" for c in CASES])
def test_grouped_values_and_gradient_match_float64(n, E, k, scoring, ng, tg, norm, sf, ldt, wdt):
    mod = grouped_kernels(E, k, *_split(scoring)[:1], ng, tg, norm, sf, ldt, bias_on=_split(scoring)[1])
    logits, bias, g = _case_inputs(n, E, scoring, ldt, seed=n * 131 + E)
    if n:
        assert _margins(logits, bias, k, scoring, ng, tg) > GAP, "near-tie in the test inputs: pick another seed"
    logits = logits.to(DEVICE).requires_grad_(True)
    w, idx = mod.router(logits, TORCH_DTYPES[wdt], None if bias is None else bias.to(DEVICE))
    assert w.dtype == TORCH_DTYPES[wdt] and idx.dtype == torch.int64 and w.shape == idx.shape == (n, k)
    l64, w64, i64 = _reference(logits, bias, k, scoring, ng, tg, norm, sf)
    assert torch.equal(idx.cpu(), i64)          # also the order: by descending choice score
    if n == 0:
        return
    assert_close(w, w64, wdt, "top-k weights")
    if norm:
        assert torch.allclose(w.double().sum(-1).cpu(), torch.full((n,), sf, dtype=torch.float64), rtol=1e-2)
    up = torch.randn(n, k, generator=g, dtype=torch.float64)
    w.backward(up.to(w.dtype).to(DEVICE))
    w64.backward(up.to(w.dtype).double())
    assert logits.grad.dtype == logits.dtype
    assert_close(logits.grad, l64.grad, ldt, "d logits")
    free = torch.ones(n, E, dtype=torch.bool).scatter_(1, i64, False)
    if scoring.startswith("sigmoid"):           # the experts not selected get no gradient
        assert (logits.grad.cpu()[free] == 0).all()


def test_the_grouped_cases_exercise_the_bias_and_the_groups():
    """The inputs are such that the bias and the group stage change the choice (else a kernel that
    ignored them would pass the table above)."""
    n, E, k, scoring, ng, tg, norm, sf = CASES[0][:8]
    logits, bias, _ = _case_inputs(n, E, scoring, "fp32", seed=n * 131 + E)
    _, _, i64 = _reference(logits, bias, k, scoring, ng, tg, norm, sf)
    _, _, no_bias = _reference(logits, bias * 0, k, scoring, ng, tg, norm, sf)
    _, _, no_groups = _reference(logits, bias, k, scoring, ng, ng, norm, sf)
    srt = lambda t: torch.sort(t, -1)[0]        # noqa: E731
    assert (srt(i64) != srt(no_bias)).any(-1).sum() >= 3
    assert (srt(i64) != srt(no_groups)).any(-1).sum() >= 3


def _mutant(mod_or_key, edits):
    """The kernel module of ``key`` rendered, edited (each edit must match exactly once) and imported."""
    text = apply_edits(render(mod_or_key), edits)
    path = Path(_TMP[0]) / f"{mod_or_key.name}__{next(_N)}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"patchdsl_router_mutants.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


_N = itertools.count()
_TMP: list = []

# kernel-source breakages of the grouped routing (regexes on the rendered grouped_fwd_kernel / _bwd_kernel)
FWD, BWD = r"^def grouped_fwd_kernel\(", r"^def grouped_bwd_kernel\("
BROKEN = {
    "bias ignored in the choice": (Edit(r"c = (s|x) \+ tl\.load\(B \+ cols", r"c = \1 + 0.0 * tl.load(B + cols", FWD),),
    "bias added to the weights": (Edit(r"s, 0\.0\), 1\)        # its un-biased score", "c, 0.0), 1)", FWD),),
    "groups ranked by their best": (Edit(r"\(m1 \+ m2\)\[:, None\]", "m1[:, None]", FWD),),
    "other groups not masked": (Edit(r"c = tl\.where\(keep != 0, c, float\(\"-inf\"\)\)", "c = c", FWD),),
    "scaling dropped": (Edit(r"w = w \* SCALE_", "w = w", FWD),),
    "sigmoid derivative dropped": (Edit(r"c = ds \* ssel \* \(1\.0 - ssel\)", "c = ds * ssel", BWD),),
    "renormalisation gradient dropped": (Edit(r"ds = g / d\[:, None\] - \(tl\.sum\(g \* ssel, 1\) / \(d \* d\)\)\[:, None\]",
                                              "ds = g / d[:, None]", BWD),),
}


@pytest.fixture
def mutants(tmp_path):
    _TMP[:] = [tmp_path]
    yield
    _TMP.clear()


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_kernel_broken_in_the_routing_fails_the_comparison(broken, mutants):
    from patchdsl.codegen.keys import KernelKey
    from patchdsl.ops.base import ModuleInfo
    from patchdsl.ops.registry import get_op

    n, E, k, scoring, ng, tg, norm, sf, ldt, wdt = CASES[0]
    op = get_op(OP)
    facts = {"experts": E, "top_k": k, "norm_topk": norm, "hidden": 32, "scoring": scoring, "n_group": ng,
             "topk_group": tg, "scaling": sf}
    params = op.key_params(ModuleInfo("test", "Test", (), {"Router": facts}, dtype=ldt), op.default_flags(), ldt,
                           TARGET)
    mod = _mutant(KernelKey.for_op(op, params), BROKEN[broken])
    logits, bias, g = _case_inputs(n, E, scoring, ldt, seed=n * 131 + E)
    logits = logits.to(DEVICE).requires_grad_(True)
    w, idx = mod.router(logits, TORCH_DTYPES[wdt], bias.to(DEVICE))
    l64, w64, i64 = _reference(logits, bias, k, scoring, ng, tg, norm, sf)
    with pytest.raises(AssertionError, match="top-k experts differ|relative error"):
        _compare(w, idx, w64, i64, wdt, E)
        up = torch.randn(n, k, generator=g, dtype=torch.float64)
        w.backward(up.float().to(DEVICE))
        w64.backward(up)
        assert_close(logits.grad, l64.grad, ldt, "d logits")


# ---------------------------------------------------------------- the op on the families' routers
# family -> the router's selector; the first layer's router is compared
FAMILIES = {"deepseek_v3": "*.mlp.gate", "glm4_moe": "*.mlp.gate", "dots1": "*.mlp.gate",
            "deepseek_v2": "*.mlp.gate", "deepseek_v2_grouped": "*.mlp.gate", "kolibri1": "*.mlp.gate",
            "qwen3_moe": "*.mlp.gate", "mixtral": "*.mlp.gate", "olmoe": "*.mlp.gate", "gpt_oss": "*.mlp.router",
            "granitemoe": "*.block_sparse_moe.router", "qwen3_5_moe": "*.mlp.gate"}
# DeepSeek-V3's tiny family has 4 experts in 2 groups: give its router more, so the groups choose
OVERRIDES = {"deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)}


def _family_router(family, dtype, seed=0):
    from ..moe_families import tiny_moe_model

    model = tiny_moe_model(family, dtype=dtype, **OVERRIDES.get(family, {})).to(DEVICE)
    path = [p for p, _ in model.named_modules() if p.endswith(FAMILIES[family][2:])][0]
    gate = model.get_submodule(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                       # routers initialise to small or zero weights and a zero bias
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 2 / gate.weight.shape[1] ** 0.5)
        if isinstance(getattr(gate, "bias", None), torch.Tensor):
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=g) * 0.3)
        if isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor):
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.3)
    return model, gate, g


def check_family_router(family, dtype, seed=0):
    """Patch the family's routers, then compare the first one's forward (experts per token, weights per
    (token, expert)) and the gradients of its input and parameters (through the weights and the logits)
    against a float64 run of transformers' own forward code on the same inputs and parameters."""
    from patchdsl import apply, plan
    from patchdsl.model.kinds.moe import router as recognise

    dt = TORCH_DTYPES[dtype]
    model, gate, g = _family_router(family, dt, seed)
    facts = recognise(gate)
    ref = copy.deepcopy(gate).double()
    fwd64 = hf_forward_f64(ref)
    h = apply(plan(f"{FAMILIES[family]}: Router -> fused_router\n", model, target=TARGET), model, target=TARGET)
    assert not h.refused, h.refused
    assert "forward" in gate.__dict__
    E, H = int(gate.weight.shape[0]), int(gate.weight.shape[1])
    shape = (2, 11, H) if facts["flattens"] else (22, H)    # what the family's block hands its router
    x = torch.randn(shape, generator=g).to(dt).to(DEVICE).requires_grad_(True)
    x64 = x.detach().double().cpu().requires_grad_(True)
    lg, w, idx = _roles(gate(x))
    lg64, w64, i64 = _roles(fwd64(ref, x64))
    k = idx.shape[-1]
    same = (torch.sort(idx.cpu(), -1)[0] == torch.sort(i64, -1)[0]).all(-1)
    c64, gmargin = _choice64(ref, lg64.detach(), facts)
    top = torch.sort(c64, -1, descending=True)[0]
    margin = torch.minimum(top[:, k - 1] - top[:, k], torch.full_like(top[:, 0], gmargin))
    if facts["linear"] == "float32" or dtype == "fp32":     # fp32 on both sides: no near-ties allowed
        assert float(margin.min()) > GAP, "near-tie in the test inputs: pick another seed"
        assert same.all(), f"top-k experts differ on tokens {(~same).nonzero().flatten().tolist()}"
    else:                                                     # bf16 logits: differing tokens must be near-ties
        near = margin <= 8 * torch.finfo(dt).eps * c64.abs().amax(-1)
        assert (same | near).all(), f"top-k experts differ on tokens {(~(same | near)).nonzero().flatten().tolist()}"
        assert same.sum() >= same.numel() - 2
    keep = same.to(torch.float64)[:, None]
    assert_close(_dense(w, idx, E) * keep, _dense(w64, i64, E) * keep, dtype, "top-k weights")
    assert_close(lg, lg64, dtype, "router logits")
    up_w = torch.randn(lg.shape[0], E, generator=g, dtype=torch.float64) * keep
    up_l = torch.randn(lg.shape, generator=g, dtype=torch.float64)
    torch.autograd.backward([w, lg], [up_w.gather(1, idx.long().cpu()).to(w.dtype).to(DEVICE),
                                      up_l.to(lg.dtype).to(DEVICE)])
    torch.autograd.backward([w64, lg64], [up_w.gather(1, i64), up_l.to(lg.dtype).double()])
    assert_close(x.grad, x64.grad, dtype, "grad x", factor=2)
    for (n, p), (_, q) in zip(gate.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, dtype, f"grad {n}", factor=2)
    for n, b in ref.named_buffers():
        assert b.grad is None, f"{n} has a gradient in transformers; the kernel gives it none"
    return model, gate


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_patched_router_matches_transformers_in_float64(family, dtype):
    check_family_router(family, dtype)


# the routing broken in the kernel the op generates for the family: the same comparison must fail
FAMILY_BROKEN = [("deepseek_v3", "bias ignored in the choice"), ("deepseek_v3", "bias added to the weights"),
                 ("deepseek_v3", "groups ranked by their best"), ("glm4_moe", "other groups not masked"),
                 ("dots1", "scaling dropped"), ("glm4_moe", "sigmoid derivative dropped"),
                 ("deepseek_v3", "renormalisation gradient dropped"), ("kolibri1", "bias ignored in the choice")]


@pytest.mark.parametrize("family,broken", FAMILY_BROKEN, ids=[f"{f}-{b}" for f, b in FAMILY_BROKEN])
def test_a_family_router_with_broken_routing_fails(family, broken, mutants, monkeypatch):
    orig = runtime_patch.load_kernel
    loaded = []

    def load(key):
        if key.op != OP:
            return orig(key)
        loaded.append(key.name)
        return _mutant(key, BROKEN[broken])

    monkeypatch.setattr(runtime_patch, "load_kernel", load)
    with pytest.raises(AssertionError, match="top-k experts differ|relative error"):
        check_family_router(family, "fp32")
    assert loaded, "the broken kernel was never loaded"
