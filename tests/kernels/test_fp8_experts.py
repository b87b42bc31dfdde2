"""fp8 experts (issue 37, item 4): fused_experts(fp8=rowwise | rowwise_with_gw_hp).

On the CPU the recipe is emulated (the same quantisation kernels, fp32 matmuls of the dequantised
values), so these tests hold its numerics: the quantisers bit-exact against the torch reference,
every gradient within the recipe's stated bound against float64, NaN never hidden, a wrong scale
caught, and the refusals where fp8 grouped GEMMs cannot run.  On a Hopper GPU the real fp8 GEMMs are
held to the emulation (gpu marker)."""

from __future__ import annotations

import importlib

import pytest
import torch

from patchdsl.codegen.cache import load_kernel
from patchdsl.codegen.keys import KernelKey
from patchdsl.kernel_support import fp8 as f8
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from ..model_families import test_mixture_of_experts as moe

OP = get_op("fused_experts")
TARGET = moe.TARGET


def _kernel(facts, dtype, recipe, emulate=True):
    params = OP.key_params(ModuleInfo("x", "X", (), {"Experts": facts}), {"fp8": recipe, "emulate": emulate},
                           dtype, TARGET)
    return load_kernel(KernelKey.for_op(OP, params))


def test_row_quantiser_matches_the_torch_reference_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 48, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0.0                                   # an all-zero row: scale from the amax floor, zeros out
    q, inv = f8.quant_rows(x)
    rq, rinv = f8.quantise(x, -1)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv.squeeze(-1))
    w = torch.randn(3, 20, 32, generator=g)      # a 3-D weight: one factor per expert and row
    q3, inv3 = f8.quant_rows(w)
    assert q3.shape == w.shape and inv3.shape == (3, 20)
    assert torch.equal(q3.view(torch.uint8), f8.quantise(w, -1)[0].view(torch.uint8))


def test_group_quantiser_scales_per_expert_and_column_and_pads_each_group():
    g = torch.Generator().manual_seed(1)
    offs = torch.tensor([5, 5, 21, 30], dtype=torch.int32)          # an empty expert, uneven groups
    x = torch.randn(33, 24, generator=g)                               # 3 sentinel rows past the end
    x[21:30] *= 100.0
    offs_p = f8.padded_offsets(offs)
    assert offs_p.tolist() == [16, 16, 32, 48]
    qt, inv = f8.quant_groups_t(x, offs, offs_p)
    starts, pstarts = [0, 5, 5, 21], [0, 16, 16, 32]
    for e in range(4):
        lo, hi, plo = starts[e], int(offs[e]), pstarts[e]
        if hi == lo:
            continue
        rq, rinv = f8.quantise(x[lo:hi].t(), -1)                       # per column over e's rows
        got = qt[:, plo:plo + hi - lo]
        assert torch.equal(got.view(torch.uint8), rq.view(torch.uint8)), e
        assert torch.equal(inv.view(4, 24)[e], rinv.squeeze(-1)), e
        pad = qt[:, plo + hi - lo:int(offs_p[e])].float()
        assert pad.numel() == 0 or bool((pad == 0).all()), e


LAYOUTS = moe.LAYOUTS[:2]        # (plain, silu) and gpt-oss's (transposed, interleaved, biases, clamp)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, c)) for c in LAYOUTS])
def test_fp8_experts_within_the_recipe_bound_of_float64(layout, recipe):
    facts = moe._facts(*layout, E=4, k=2, H=32, I=16)
    errs = moe._run(_kernel(facts, "fp32", recipe), facts, T=40, seed=3, dtype=torch.float32)
    bound = OP.parity_floor({"fp8": recipe}, "fp32")
    bad = {k: v for k, v in errs.items() if not v <= bound}
    assert not bad, (errs, bound)
    # fp8 really ran: a bf16-exact path would be ~1e-6 here; the recipe's rounding is ~1e-2
    assert errs["output"] > 1e-3, errs


def test_a_wrong_dequantisation_factor_fails_the_bound(monkeypatch):
    facts = moe._facts(*LAYOUTS[0], E=4, k=2, H=32, I=16)
    kmod = _kernel(facts, "fp32", "rowwise")
    real = f8.quant_rows

    def off_by_two(t):
        q, inv = real(t)
        return q, inv * 2.0
    monkeypatch.setattr(f8, "quant_rows", off_by_two)
    errs = moe._run(kmod, facts, T=40, seed=3, dtype=torch.float32)
    assert errs["output"] > OP.parity_floor({"fp8": "rowwise"}, "fp32"), errs


def test_nan_in_a_token_reaches_its_output_and_the_weight_gradients():
    facts = moe._facts(*LAYOUTS[0], E=4, k=2, H=32, I=16)
    kmod = _kernel(facts, "fp32", "rowwise")
    x, idx, w, gu, dn, _, _ = (t.float() if t is not None and t.is_floating_point() else t
                               for t in moe._inputs(facts, 12, 5))
    x[3, 7] = float("nan")
    gu.requires_grad_(True)
    out = kmod.experts(x, idx, w, gu, dn)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[[0, 1, 2, 4]]).all()
    out.sum().backward()
    assert torch.isnan(gu.grad).any(), "a NaN input must not vanish from the gradient"


def _plan_params(**kw):
    facts = moe._facts(*LAYOUTS[0], E=4, k=2, H=32, I=16)
    p = OP.key_params(ModuleInfo("x", "X", (), {"Experts": facts}), {"fp8": "rowwise", **kw}, "bf16",
                      "interpreter")
    return p


@pytest.mark.parametrize("params,needle", [
    (dict(), "Hopper"),                                                     # no GPU here
    (dict(dtype="fp16"), "bfloat16"),                                    # fp16 model
    (dict(hidden=24), "multiples of 16"),
], ids=["no-gpu", "fp16", "hidden-24"])
def test_fp8_experts_are_refused_where_they_cannot_run(params, needle):
    p = {**_plan_params(), **params}
    if "dtype" in params:
        p["target"] = "cuda"
    why = OP.unavailable(p)
    assert why and needle in why, why
    if "multiples" not in needle:
        assert "emulate=true" in why
    assert OP.unavailable({**p, "emulate": True}) is None if "multiples" not in needle else True
    assert OP.unavailable({**p, "fp8": "off"}) is None


def test_fp8_off_and_emulated_kernels_are_named_apart():
    names = {OP.kernel_name(_plan_params()), OP.kernel_name({**_plan_params(), "emulate": True}),
             OP.kernel_name({**_plan_params(), "fp8": "off"}),
             OP.kernel_name({**_plan_params(), "fp8": "rowwise_with_gw_hp"})}
    assert len(names) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, c)) for c in LAYOUTS])
def test_fp8_grouped_gemms_match_their_emulation_gpu(layout, recipe):
    """The real torch._scaled_grouped_mm path against the emulated one on the same inputs (Qwen3-like
    group sizes at bf16): the same quantised operands, so only accumulation order differs."""
    facts = moe._facts(*layout, E=16, k=4, H=256, I=128)
    real, emu = _kernel(facts, "bf16", recipe, False), _kernel(facts, "bf16", recipe, True)
    x, idx, w, gu, dn, gb, db = moe._inputs(facts, 700, 9)
    ins = [t.cuda().to(torch.bfloat16) if t is not None and t.is_floating_point() else
           (t.cuda() if t is not None else None) for t in (x, idx, w, gu, dn, gb, db)]
    results = []
    for k in (real, emu):
        leaves = [t.detach().clone().requires_grad_(True) if t is not None and t.is_floating_point() else t
                  for t in ins]
        out = k.experts(*leaves)
        out.backward(torch.ones_like(out))
        results.append([out] + [t.grad for t in leaves if t is not None and t.is_floating_point()])
    for a, b in zip(*results):
        assert float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) < 2e-2
