"""fused_router (issue 24): the router kernel against a float64 reference, and the op on the router
modules of the MoE families against the modules themselves.

The reference (:func:`patchdsl.model.reference.router_reference`) takes the same (already rounded) logits in
float64: softmax over the experts, the top-k by a stable descending sort (exact ties to the lower index,
the kernel's rule), renormalised over the k or not; its gradient is float64 autograd of that.  Cases
cover masked expert tiles (6 experts), a short last row tile, top-1, one token, no tokens, every
logits dtype and the three weight dtypes the modules ask for.
"""

import copy
import re

import pytest
import torch

from patchdsl.model.reference import router_reference

from .helpers import DEVICE, ON_GPU, TARGET, TORCH_DTYPES, assert_close, kernel_for

OP = "fused_router"


def kernels(experts, top_k, norm, dtype="bf16", **flags):
    facts = {"experts": experts, "top_k": top_k, "norm_topk": norm, "hidden": 32, "scoring": "softmax_topk"}
    return kernel_for(OP, "Router", facts, dtype, flags)


# (tokens, experts, top_k, renormalise, logits dtype, weights dtype)
CASES = [
    (37, 8, 2, False, "fp32", "fp32"),
    (37, 8, 2, True, "bf16", "bf16"),
    (33, 6, 3, True, "fp32", "fp32"),          # 6 experts in a tile of 8: masked
    (50, 128, 8, True, "bf16", "fp32"),        # Qwen3-30B-A3B's router width, Mixtral's fp32 weights
    (50, 64, 8, False, "bf16", "bf16"),        # OLMoE's
    (7, 5, 1, False, "fp16", "fp16"),
    (1, 16, 4, True, "fp32", "bf16"),
    (0, 8, 2, False, "fp32", "fp32"),
]


@pytest.mark.parametrize("n,E,k,norm,ldt,wdt", CASES, ids=[f"t{c[0]}-e{c[1]}-k{c[2]}-{'norm' if c[3] else 'raw'}-"
                                                          f"{c[4]}-w{c[5]}" for c in CASES])
def test_values_and_gradient_match_float64(n, E, k, norm, ldt, wdt):
    mod = kernels(E, k, norm, ldt)
    g = torch.Generator().manual_seed(n * 131 + E)
    logits = (torch.randn(n, E, generator=g) * 2).to(TORCH_DTYPES[ldt]).to(DEVICE).requires_grad_(True)
    w, idx = mod.router(logits, TORCH_DTYPES[wdt])
    assert w.dtype == TORCH_DTYPES[wdt] and idx.dtype == torch.int64 and w.shape == idx.shape == (n, k)
    l64 = logits.detach().double().cpu().requires_grad_(True)
    w64, i64 = router_reference(l64, k, "softmax_topk", norm)
    assert torch.equal(idx.cpu(), i64)
    if n == 0:
        return
    assert_close(w, w64, wdt, "top-k weights")
    if norm:
        assert torch.allclose(w.double().sum(-1).cpu(), torch.ones(n, dtype=torch.float64), atol=1e-2)
    up = torch.randn(n, k, generator=g, dtype=torch.float64)
    w.backward(up.to(w.dtype).to(DEVICE))
    w64.backward(up.to(w.dtype).double())
    assert logits.grad.dtype == logits.dtype
    assert_close(logits.grad, l64.grad, ldt, "d logits")
    if norm:        # w = softmax over the k selected logits: the others get no gradient
        free = torch.ones(n, E, dtype=torch.bool).scatter_(1, i64, False)
        assert (logits.grad.cpu()[free] == 0).all()


def test_without_ties_the_choice_is_torch_topks():
    """Distinct logits: the indices are torch.topk's (on the module's probabilities), in its order."""
    mod = kernels(16, 4, False, "fp32")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(29, 16, generator=g).to(DEVICE)
    _, idx = mod.router(logits, torch.float32)
    ref = torch.topk(torch.softmax(logits, -1), 4, dim=-1).indices
    assert torch.equal(idx, ref)


def test_exact_ties_go_to_the_lower_index_with_equal_weights():
    """torch.topk breaks exact ties its own way (here the CPU's picks experts 4, 7, 1 among the four
    3s); the kernel takes the lower indices.  Tied experts have the same weight, so the weights agree."""
    mod = kernels(8, 3, False, "fp32")
    logits = torch.tensor([[1.0, 3, 3, 0, 3, 2, 1, 3]] * 5, device=DEVICE)
    w, idx = mod.router(logits, torch.float32)
    assert idx.tolist() == [[1, 2, 4]] * 5
    tw, _ = torch.topk(torch.softmax(logits, -1), 3, dim=-1)
    assert torch.allclose(w, tw, rtol=1e-6, atol=0)


@pytest.mark.parametrize("what,call,message", [
    ("wrong expert count", lambda m: m.router(torch.randn(4, 7, device=DEVICE), torch.float32), r"\(tokens, 8\)"),
    ("3-D logits", lambda m: m.router(torch.randn(2, 4, 8, device=DEVICE), torch.float32), r"got \(2, 4, 8\)"),
])
def test_wrong_shapes_are_refused(what, call, message):
    mod = kernels(8, 2, False, "fp32")
    with pytest.raises(ValueError, match=message):
        call(mod)


def test_the_comparison_tells_renormalised_from_raw():
    """A kernel specialised for the other normalisation fails the same comparison (values and gradient)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 8, generator=g).to(DEVICE).requires_grad_(True)
    l64 = logits.detach().double().cpu().requires_grad_(True)
    w64, _ = router_reference(l64, 2, "softmax_topk", False)
    w, _ = kernels(8, 2, True, "fp32").router(logits, torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(w, w64, "fp32", "top-k weights")
    up = torch.randn(9, 2, generator=g, dtype=torch.float64)
    w.backward(up.float().to(DEVICE))
    w64.backward(up)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(logits.grad, l64.grad, "fp32", "d logits")


# ---------------------------------------------------------------- the op on the MoE families' routers
FAMILIES = {"qwen3_moe": "*.mlp.gate", "mixtral": "*.mlp.gate", "olmoe": "*.mlp.gate", "gpt_oss": "*.mlp.router",
            "qwen3_5_moe": "*.mlp.gate", "granitemoe": "*.block_sparse_moe.router"}


def _patched(family, dtype=torch.float32, **over):
    from patchdsl import apply, plan

    from ..moe_families import tiny_moe_model

    model = tiny_moe_model(family, dtype=dtype, **over).to(DEVICE)
    ref = copy.deepcopy(model)
    sel = FAMILIES[family]
    h = apply(plan(f"{sel}: Router -> fused_router\n", model, target=TARGET), model, target=TARGET)
    assert not h.refused, h.refused
    path = [p for p, _ in model.named_modules() if p.endswith(sel[2:])][0]      # the first layer's router
    return model.get_submodule(path), ref.get_submodule(path), h


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_patched_router_returns_what_the_module_returns(family, dtype):
    """Same order, dtypes and indices as the module's own forward; weights and the gradients of the
    input and the router's parameters (through the logits and the weights) as the module's autograd."""
    dt = TORCH_DTYPES[dtype]
    r, r0, h = _patched(family, dt)
    assert "forward" in r.__dict__
    g = torch.Generator().manual_seed(7)
    x = torch.randn(21, r.weight.shape[1], generator=g).to(dt).to(DEVICE).requires_grad_(True)
    x0 = x.detach().clone().requires_grad_(True)
    a, b = r(x), r0(x0)
    assert [t.dtype for t in a] == [t.dtype for t in b] and [t.shape for t in a] == [t.shape for t in b]
    for u, v in zip(a, b):
        if u.is_floating_point():
            assert_close(u, v, dtype, "router output")
        else:
            assert torch.equal(u, v)
    ups = [torch.randn(t.shape, generator=g).to(t.dtype).to(DEVICE) for t in b if t.is_floating_point()]
    torch.autograd.backward([t for t in a if t.is_floating_point()], ups)
    torch.autograd.backward([t for t in b if t.is_floating_point()], ups)
    assert_close(x.grad, x0.grad, dtype, "grad x", factor=2)
    for (n, p), q in zip(r.named_parameters(), r0.parameters()):
        assert_close(p.grad, q.grad, dtype, f"grad {n}", factor=2)
    h.undo()
    assert "forward" not in r.__dict__


def test_a_3d_input_is_routed_by_the_kernel_as_the_module_flattens_it():
    """A [batch, seq, hidden] input (DeepSeek-V3's block hands its router the 3-D states; Qwen3-MoE's
    router reshapes them too): the patched forward routes its rows through the kernel as the module's
    own forward does (probed: ``flattens``), not through the module's own forward."""
    r, r0, _ = _patched("qwen3_moe")
    x = torch.randn(2, 5, r.weight.shape[1], device=DEVICE, requires_grad=True)
    a, b = r(x), r0(x)
    assert [t.shape for t in a] == [t.shape for t in b] == [(10, 4), (10, 2), (10, 2)]
    assert torch.equal(a[2], b[2])
    assert_close(a[1], b[1], "fp32", "3-D top-k weights")
    assert "RouterFunction" in type(a[1].grad_fn).__name__, type(a[1].grad_fn).__name__


def test_under_autocast_the_dtypes_follow_the_module():
    """fp32 weights under bf16 autocast: the linear runs in bf16, the weights come back in the logits'
    dtype (Qwen3-MoE casts them so), as the module's own forward gives them."""
    r, r0, _ = _patched("qwen3_moe")
    x = torch.randn(11, r.weight.shape[1], device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        a, b = r(x), r0(x)
    assert [t.dtype for t in a] == [t.dtype for t in b] == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert torch.equal(a[2], b[2])


# routings fused_router does not compute: refused at plan time, naming the module, what it has and what
# the op computes: (family, config overrides, what the error must say)
PLAN_REFUSALS = {
    "top_k beyond the kept groups": (
        "deepseek_v3", dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3),
        r"model\.layers\.0\.mlp\.gate \(DeepseekV3TopkRouter\): its top_k=3 is more than the 2 experts of the "
        r"topk_group=1 kept groups .*; fused_router computes top_k <= topk_group x experts per group; not patched"),
    "a router whose forward takes the bias (MiniMax-M2)": (
        "minimax_m2", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, bos_token_id=None,
                           eos_token_id=None),
        r"matched 1 module\(s\) \(MiniMaxM2TopKRouter\) but none is Router that fused_router can replace(.|\n)*"
        r"Router needs .*forward\(hidden_states\) of the hidden states alone"),
}


@pytest.mark.parametrize("case", list(PLAN_REFUSALS))
def test_routings_it_does_not_compute_are_refused_at_plan_time(case):
    from transformers import AutoModelForCausalLM

    from patchdsl import plan
    from patchdsl.syntax.errors import SpecError

    from ..moe_families import COMMON, MOE_FAMILIES, tiny_moe_model
    from ..families import config_for

    family, over, message = PLAN_REFUSALS[case]
    if family in MOE_FAMILIES:
        model = tiny_moe_model(family, **over)
    else:
        model = AutoModelForCausalLM.from_config(config_for(family, COMMON, over))
    for rule in ("*.mlp.gate: Router -> fused_router\n", "optional *.mlp.gate: Router -> fused_router\n"):
        if rule.startswith("optional") and "none is Router" in message:
            continue                 # an optional rule fitting no module is no error
        with pytest.raises(SpecError) as e:
            plan(rule, model, target=TARGET)
        text = str(e.value) + " " + str(getattr(e.value, "hint", "") or "")
        assert re.search(message, text), text


# a router changed after planning: refused at apply (the router keeps its own forward), naming what changed
APPLY_REFUSALS = {
    "routed scaling factor": (lambda g: setattr(g, "routed_scaling_factor", 3.0), "Router scaling: plan 2.5, module 3.0"),
    "groups kept": (lambda g: setattr(g, "topk_group", 2), "Router topk_group: plan 1, module 2"),
    "renormalisation": (lambda g: setattr(g, "norm_topk_prob", False), "Router norm_topk: plan true, module false"),
    "correction bias shape": (lambda g: setattr(g, "e_score_correction_bias", torch.zeros(5)),
                              "its e_score_correction_bias is (5,), fused_router's sigmoid grouped top-k needs a [4]"),
}


@pytest.mark.parametrize("case", list(APPLY_REFUSALS))
def test_a_deepseek_router_changed_after_planning_is_refused_at_apply(case):
    from patchdsl import apply, plan

    from ..moe_families import tiny_moe_model

    model = tiny_moe_model("deepseek_v3")
    p = plan("*.mlp.gate: Router -> fused_router\n", model, target=TARGET)
    gate = model.model.layers[0].mlp.gate
    change, message = APPLY_REFUSALS[case]
    change(gate)
    h = apply(p, model, target=TARGET)
    assert h.refused and "refused fused_router on model.layers.0.mlp.gate" in str(h.refused[0]), h.refused
    assert message in str(h.refused[0]), h.refused
    assert "forward" not in gate.__dict__


def test_a_router_changed_after_planning_is_refused_at_apply():
    from patchdsl import apply, plan

    from ..moe_families import tiny_moe_model

    model = tiny_moe_model("qwen3_moe")          # norm_topk_prob off
    p = plan("*.mlp.gate: Router -> fused_router\n", model, target=TARGET)
    gate = model.model.layers[0].mlp.gate
    gate.norm_topk_prob = True
    h = apply(p, model, target=TARGET)
    assert h.refused and "norm_topk" in str(h.refused[0]) and "true" in str(h.refused[0])
    assert "forward" not in gate.__dict__


def test_a_module_that_is_not_a_router_is_not_one():
    from patchdsl.model.kinds.moe import router

    class Scores(torch.nn.Module):           # a weight and a top_k, but it returns the logits only
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    assert router(Scores()) is None
    assert router(torch.nn.Linear(8, 4)) is None


class _SigmoidOfTopLogits(torch.nn.Module):
    """A router by structure (weight, top_k, forward -> logits, weights, indices) whose weights are the
    sigmoid of the top-k logits, renormalised: a routing no probed formula gives."""

    def __init__(self):
        super().__init__()
        self.top_k = 2
        self.routed_scaling_factor = 1.0
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        lg = torch.nn.functional.linear(x, self.weight)
        v, i = torch.topk(lg, 2)
        return lg, torch.sigmoid(v), i


class _Holder(torch.nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.gate = gate


def test_a_router_of_unknown_routing_is_a_router_refused_with_what_it_holds():
    """Three outputs and a top_k, but weights of no probed formula: a Router of scoring "unknown" whose
    rule is refused at plan time naming the module, what it holds and what fused_router computes."""
    from patchdsl import plan
    from patchdsl.model.kinds.moe import router
    from patchdsl.syntax.errors import SpecError

    f = router(_SigmoidOfTopLogits())
    assert f is not None and f["scoring"] == "unknown" and "top_k=2" in f["routing"]
    with pytest.raises(SpecError, match=r"gate \(_SigmoidOfTopLogits\): its top-k weights are none of the "
                       r"routings probed \(it holds top_k=2, routed_scaling_factor=1.0\); fused_router computes "
                       r"softmax top-k"):
        plan("gate: Router -> fused_router\n", _Holder(_SigmoidOfTopLogits()), target=TARGET)


@pytest.mark.skipif(ON_GPU, reason="CPU harness test (the GPU runs bench/gpu_all.sh part moe_router)")
def test_moe_router_bench_cpu_dry_run(tmp_path, capsys):
    """bench/moe_router_bench.py (gpu_all.sh part `moe_router`) at a tiny shape on the CPU: every row
    runs, the agreement holds, the verdict is the last line (no timing is judged)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "moe_router_bench.py")
    spec = importlib.util.spec_from_file_location("moe_router_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--cpu-dry", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("moe_router: CPU DRY RUN OK") and "agreement ok" in out[-1], out[-1]
    data = json.loads((tmp_path / "moe_router.json").read_text())
    assert [r["norm_topk_prob"] for r in data["rows"]] == [True, False]
    assert {"module", "fused", "matmul", "aux loss"} <= set(data["rows"][0]["ms"])
    assert all(r["differing_sets_are_exact_ties"] and r["grad_x_rel_fro"] < 1e-2 for r in data["rows"])
    assert (tmp_path / "moe_router.txt").read_text().strip().splitlines()[-1] == out[-1]


# every branch of the plan-time refusal, on facts (the ones no transformers router reaches are defensive:
# a forward that cannot view its experts as equal groups fails the Router probe before)
BASE = {"experts": 8, "top_k": 2, "scoring": "sigmoid_grouped", "n_group": 4, "topk_group": 2}
MISFITS = [
    ({**BASE, "scoring": "unknown", "routing": "top_k=2, foo=1"},
     r"its top-k weights are none of the routings probed \(it holds top_k=2, foo=1\); fused_router computes"),
    ({**BASE, "scoring": "topk_softmax"}, r"its routing is top-k of the logits then a softmax over the k; fused_router"),
    ({**BASE, "n_group": 3}, r"its 8 experts in n_group=3 groups with topk_group=2 are not equal groups"),
    ({**BASE, "topk_group": 5}, r"are not equal groups of which some are kept"),
    ({**BASE, "n_group": 8, "topk_group": 4}, r"its groups of 1 expert rank by a top-2 sum"),
    ({**BASE, "topk_group": 1, "top_k": 3}, r"its top_k=3 is more than the 2 experts of the topk_group=1 kept groups"),
    ({**BASE, "scoring": "softmax_grouped", "n_group": 8, "topk_group": 1, "top_k": 2},
     r"its top_k=2 is more than the 1 experts of the topk_group=1 kept groups"),
]


@pytest.mark.parametrize("facts,message", MISFITS, ids=[f"{f['scoring']}-{i}" for i, (f, _) in enumerate(MISFITS)])
def test_every_routing_refusal_says_what_it_has_and_what_the_op_computes(facts, message):
    from patchdsl.ops.base import ModuleInfo
    from patchdsl.ops.registry import get_op

    op = get_op(OP)
    why = op.misfit(ModuleInfo("model.layers.0.mlp.gate", "SomeRouter", (), {"Router": facts}), None)
    assert why and why.startswith("model.layers.0.mlp.gate (SomeRouter): ") and re.search(message, why), why
    assert why.endswith("not patched (the router stays the model's own)")
    with pytest.raises(ValueError, match="fused_router: model.layers.0.mlp.gate"):     # never a kernel for it
        op.key_params(ModuleInfo("model.layers.0.mlp.gate", "SomeRouter", (), {"Router": facts}), op.default_flags(),
                      "fp32", TARGET)


def test_the_routings_it_computes_are_no_misfit():
    from patchdsl.ops.base import ModuleInfo
    from patchdsl.ops.registry import get_op

    op = get_op(OP)
    for facts in (BASE, {**BASE, "n_group": 1, "topk_group": 1}, {**BASE, "scoring": "softmax_grouped"},
                  {"experts": 8, "top_k": 2, "scoring": "softmax_topk"}):
        assert op.misfit(ModuleInfo("g", "R", (), {"Router": facts}), None) is None, facts
