"""Issue 25 (helper norms2): the gated RMSNorm of linear-attention layers (GatedRMSNorm ->
fused_rmsnorm_gated), gated MLPs under LFM2's w1 / w3 / w2 names (SwiGLU -> fused_swiglu), and the
structural refusals next to them (BitNet's MLP sub-norm), on tiny models of the families themselves.
Kernel numerics are in tests/kernels/test_rmsnorm_gated.py."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from patchdsl.model.index import build_index
from patchdsl.model.kinds.norms import gated_rmsnorm
from patchdsl.model.kinds.mlp import swiglu
from patchdsl.runtime import patch_module
from patchdsl.planning.suggestion import suggest

from ..kernels.helpers import TOL, assert_no_worse_than_module, rel_err, tiny_family


def _cls(family: str, name: str):
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ModuleNotFoundError:
        pytest.skip(f"{family} is not in this transformers")   # lara_mini: transformers >= 5.18
    return getattr(module, name)


# (family, class, activation, casting): the gated norms transformers ships
GATED = [
    ("qwen3_next", "Qwen3NextRMSNormGated", "silu", "llama"),
    ("qwen3_5", "Qwen3_5RMSNormGated", "silu", "llama"),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", "silu", "llama"),
    ("kimi_linear", "KimiLinearRMSNormGated", "sigmoid", "gemma"),
    ("lara_mini", "LaraMiniRMSNormGated", "silu", "gemma"),
]


@pytest.mark.parametrize("family,cls,activation,casting", GATED)
def test_gated_norms_are_recognised_with_their_activation_and_cast_order(family, cls, activation, casting):
    m = _cls(family, cls)(40, eps=1e-5)
    assert gated_rmsnorm(m) == {"hidden": 40, "eps": 1e-5, "activation": activation, "casting": casting}
    # the family's plain RMSNorm (forward(x)) is not gated, and the gated one is no plain RMSNorm
    assert gated_rmsnorm(_cls(family, cls.replace("Gated", ""))(40, eps=1e-5)) is None
    assert "RMSNorm" not in build_index(torch.nn.Sequential(m)).get("0").kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,cls,activation,casting", [GATED[0], GATED[3]])
def test_patched_gated_norm_matches_float64(family, cls, activation, casting, dtype):
    """The patched module against the module itself in float64 (forward, dx, dgate, dW): within the
    dtype's bar or 4x the unpatched module's own error in that dtype."""
    norm = _cls(family, cls)(64, eps=1e-6)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.3 + 1)
    x, gate, dy = (torch.randn(2, 5, 3, 64, generator=g) for _ in range(3))

    def run(mod, dt):
        mod = mod.to(dt)
        xx, gg = x.to(dt).requires_grad_(True), gate.to(dt).requires_grad_(True)
        y = mod(xx, gg)
        y.backward(dy.to(dt))
        return y.detach(), xx.grad, gg.grad, mod.weight.grad

    ref = run(copy.deepcopy(norm), torch.float64)
    hf = run(copy.deepcopy(norm), dtype)
    pn = copy.deepcopy(norm).to(dtype)
    h = patch_module(pn, "fused_rmsnorm_gated")
    assert not h.refused, h.refused
    got = run(pn, dtype)
    h.undo()
    assert_no_worse_than_module(("y", "dx", "dgate", "dw"), ref, hf, got, dtype)


def test_a_plain_rmsnorm_is_refused_by_the_gated_op():
    from patchdsl.runtime.patch import PatchError

    with pytest.raises(PatchError, match="not a gated RMSNorm"):
        patch_module(_cls("qwen3_next", "Qwen3NextRMSNorm")(64), "fused_rmsnorm_gated")


def _lfm2_mlp(swap: bool):
    """A w1 / w3 / w2 gated MLP as LFM2 writes it, or with gate and up swapped (must not be SwiGLU)."""
    class W132(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = torch.nn.Linear(16, 24), torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)

        def forward(self, x):
            a, b = (self.w3, self.w1) if swap else (self.w1, self.w3)
            return self.w2(torch.nn.functional.silu(a(x)) * b(x))

    return W132()


def test_w1_w3_w2_mlp_is_swiglu_and_gate_up_swapped_is_not():
    f = swiglu(_lfm2_mlp(False))
    assert f and f["names"] == ["w1", "w3", "w2"] and f["bias"] and f["intermediate"] == 24
    assert swiglu(_lfm2_mlp(True)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_w1_w3_w2_mlp_matches_the_module(dtype):
    m = _lfm2_mlp(False).to(dtype)
    x = torch.randn(3, 16, dtype=dtype)
    ref = m(x)
    h = patch_module(m, "fused_swiglu")
    assert not h.refused, h.refused
    xx = x.clone().requires_grad_(True)
    got = m(xx)
    got.sum().backward()
    h.undo()
    assert rel_err(got, ref) <= TOL["fp32" if dtype == torch.float32 else "bf16"]
    assert xx.grad is not None and m.w1.weight.grad is not None and m.w3.weight.grad is not None


def test_bitnet_mlp_is_refused_naming_its_sub_norm():
    s = suggest(tiny_family("bitnet"), dtypes=("fp32",))
    why = [w for p, w in s.unpatched.items() if p.endswith(".mlp")]
    assert why and all("ffn_sub_norm" in w and "relu2" in w for w in why), why


def test_xlm_norm_lists_are_not_norms():
    s = suggest(tiny_family("xlm"), dtypes=("fp32",))
    assert not any("without a weight" in w for w in s.unpatched.values()), s.unpatched
    assert s.counts()["norms"][0] == s.counts()["norms"][1]


@pytest.mark.slow
@pytest.mark.parametrize("family,rule", [
    ("qwen3_next", "GatedRMSNorm -> fused_rmsnorm_gated"),
    ("qwen3_5_text", "GatedRMSNorm -> fused_rmsnorm_gated"),
    ("lfm2", "feed_forward: SwiGLU -> fused_swiglu"),
])
def test_suggestion_verifies(family, rule):
    """The suggested spec patches every norm (gated ones included) / the w1-w3-w2 MLPs, and verifies."""
    from patchdsl.model.tiny import build, tiny_family_config
    from patchdsl.parity import verify

    s = suggest(tiny_family(family), dtypes=("fp32",))
    assert rule in s.text, s.text
    want = "norms" if "Norm" in rule else "mlp"
    assert s.counts()[want][0] == s.counts()[want][1], (s.counts(), s.unpatched)
    cfg = tiny_family_config(family)
    rep = verify(s.text, lambda: build(cfg), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [r.path for r in rep.failures()]


def tiny_qwen3_next():
    """A tiny Qwen3-Next (one linear-attention layer with its gated norm, one full-attention layer), norm
    weights drawn around 1 so that they matter (the generic suites' example of fused_rmsnorm_gated)."""
    m = tiny_family("qwen3_next")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)
            # at the default init the delta rule's output (the gated norm's input) has an RMS of ~3e-5,
            # below sqrt(eps): the norm would be eps-dominated and its dx nearly rstd * dy; scaled up, it is not
            elif n.endswith("linear_attn.conv1d.weight") or n.endswith("linear_attn.in_proj_qkvz.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "conv1d" in n else 0.1))
    return m


def test_inspect_shows_the_gated_norm_with_its_facts():
    from patchdsl.model.inspection import render

    m = _cls("kimi_linear", "KimiLinearRMSNormGated")(32, eps=1e-5)
    text = render(build_index(torch.nn.ModuleDict({"o_norm": m})))
    line = next(ln for ln in text.splitlines() if ln.startswith("o_norm "))
    assert "GatedRMSNorm" in line and "hidden=32 eps=1e-05 gate=sigmoid casting=gemma" in line, text
