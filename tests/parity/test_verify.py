"""patchdsl verify: gradient parity of a patched model against float64 (issue 5).

Tiny Qwen3 models (random weights, a few layers) patched with the ops that exist; verify must
pass in fp32 and bf16, report the documented JSON fields, and fail -- naming the site -- when a
site is deliberately broken.  Kernel-level mutations of every op are in test_mutations.py.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import patchdsl
from patchdsl.ops.registry import get_op
from patchdsl.parity import FACTOR, FLOORS, ParityReport, errors, tolerance_for
from patchdsl.parity.compare import judge
from patchdsl.parity.reference import float64_mode
from tests.kernels.helpers import DEVICE, ON_GPU

NORMS = "*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n"
# One rule per op that exists in this checkout (ops land independently).
OP_RULES = {
    "fused_rmsnorm": NORMS,
    "fused_swiglu": "*.mlp: SwiGLU -> fused_swiglu\n",
    "fused_qk_norm_rope": "*.self_attn: Attention -> fused_qk_norm_rope\n",
    "fused_rope": "*.self_attn: Attention -> fused_rope\n",
    "fused_linear_cross_entropy": "lm_head: Linear -> fused_linear_cross_entropy\n",
}


def tiny_qwen3(layers: int = 2, hidden: int = 48, seed: int = 0, tie: bool = False):
    """A zero-argument factory of a tiny random Qwen3 (hidden 48: not a power of two)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def make():
        torch.manual_seed(seed)
        cfg = AutoConfig.for_model(
            "qwen3", hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=64,
            tie_word_embeddings=tie, attention_dropout=0.0)
        cfg._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():      # norm weights initialise to 1: make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1.0, 0.3)
        return model

    return make


def available_spec(*ops: str) -> str:
    """The rules of the listed ops that are registered (at least fused_rmsnorm)."""
    text = "".join(OP_RULES[o] for o in ops if get_op(o) is not None)
    # fused_rope and fused_qk_norm_rope compete for self_attn: keep the first available
    if OP_RULES["fused_rope"] in text and OP_RULES["fused_qk_norm_rope"] in text:
        text = text.replace(OP_RULES["fused_rope"], "")
    return text


ALL_OPS = tuple(OP_RULES)


# ---------------------------------------------------------------- passes when nothing is broken
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_passes_on_tiny_qwen3(dtype):
    spec = available_spec(*ALL_OPS)
    report = patchdsl.verify(spec, tiny_qwen3(), dtype=dtype, batch=2, seq=12, seed=1, device=DEVICE)
    assert report.passed, "\n".join(f"{r.path} {r.quantity}: {r.rel_fro_err:.3g} > {r.tolerance:.3g} {r.note}"
                                    for r in report.failures())
    assert report.failed_sites() == []
    paths = {s["path"] for s in report.sites}
    assert {"model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"} <= paths
    # every site got an output (or loss) check, an input-gradient check and a weight-gradient check
    for s in report.sites:
        qs = {r.quantity for r in report.site_rows(s["path"])}
        assert qs & {"output", "loss"}, (s, qs)
        assert "grad_input" in qs, (s, qs)
        assert any(q.startswith("grad_") and q != "grad_input" for q in qs), (s, qs)
    e2e = {r.quantity for r in report.rows if r.kind == "end-to-end"}
    assert "loss" in e2e and any(q.startswith("grad (all") for q in e2e)
    assert report.grads_compared == len(list(tiny_qwen3()().parameters()))
    assert report.verdict.startswith("PASS")
    assert report.exit_code() == 0


def test_verify_fp16_and_steps():
    report = patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="fp16", batch=1, seq=8, steps=2, device=DEVICE)
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    steps = [r for r in report.rows if r.kind == "step"]
    assert [r.quantity for r in steps] == ["loss step 1", "loss step 2"]
    assert all(math.isfinite(r.rel_fro_err) for r in steps)


def test_tied_embeddings_with_the_loss_ops():
    """Qwen3-0.6B ties lm_head to the embedding: the loss site's weight gradient is the shared one."""
    spec = available_spec("fused_rmsnorm", "fused_linear_cross_entropy")
    report = patchdsl.verify(spec, tiny_qwen3(layers=1, tie=True), dtype="fp32", batch=2, seq=8, device=DEVICE)
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    if get_op("fused_linear_cross_entropy") is not None:
        rows = report.site_rows("lm_head")
        assert {r.quantity for r in rows} == {"loss", "grad_input", "grad_weight"}
        assert "logits" not in {r.quantity for r in report.rows if r.kind == "end-to-end"}   # the fused loss has none


def test_module_argument_is_left_untouched():
    model = tiny_qwen3(layers=1)()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = patchdsl.verify(NORMS, model, dtype="bf16", batch=1, seq=8, steps=1, device=DEVICE)
    assert report.passed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32 and next(model.parameters()).grad is None


# ---------------------------------------------------------------- fails, naming the site
def test_broken_site_fails_and_is_named():
    # Layer 1's input norm gets Gemma's (1 + w) scale: a wrong flag, i.e. a broken site.
    spec = NORMS + "model.layers.1.input_layernorm: RMSNorm -> fused_rmsnorm(offset=1.0)\n"
    report = patchdsl.verify(spec, tiny_qwen3(), dtype="fp32", batch=2, seq=8, device=DEVICE)
    assert not report.passed and report.exit_code() == 1
    assert report.failed_sites() == ["model.layers.1.input_layernorm"]
    bad = {r.quantity for r in report.failures() if r.kind == "site"}
    assert {"output", "grad_input"} <= bad
    assert any(r.kind == "end-to-end" and not r.passed for r in report.rows)
    assert "model.layers.1.input_layernorm (fused_rmsnorm)" in report.verdict
    js = report.to_json()
    assert js["passed"] is False
    assert [s["path"] for s in js["sites"] if not s["passed"]] == ["model.layers.1.input_layernorm"]


def test_broken_site_named_in_bf16():
    spec = NORMS + "model.norm: RMSNorm -> fused_rmsnorm(eps=0.5)\n"
    report = patchdsl.verify(spec, tiny_qwen3(layers=1), dtype="bf16", batch=2, seq=8, device=DEVICE)
    assert not report.passed
    assert report.failed_sites() == ["model.norm"]


def test_nan_in_patched_output_fails(monkeypatch):
    """A site whose kernel returns NaN fails, and only that site is named."""
    from patchdsl.ops.rmsnorm import FusedRMSNorm

    orig = FusedRMSNorm.make_forward
    bad_path = "model.layers.0.post_attention_layernorm"

    def make_forward(self, module, kernels, flags, info):
        fwd = orig(self, module, kernels, flags, info)
        if info.path != bad_path:
            return fwd
        return lambda mod, x, *a, **k: fwd(mod, x, *a, **k) + float("nan")

    monkeypatch.setattr(FusedRMSNorm, "make_forward", make_forward)
    report = patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="fp32", batch=1, seq=8, device=DEVICE)
    assert report.failed_sites() == [bad_path]
    nan_rows = [r for r in report.failures() if "NaN/inf" in r.note]
    assert nan_rows and math.isinf(nan_rows[0].rel_fro_err)
    js = json.loads(json.dumps(report.to_json()))   # inf is serialised as a string: still valid JSON
    assert js["passed"] is False


def test_a_value_in_another_dtype_than_the_unpatched_models_fails():
    """verify judges every site output, gradient and end-to-end value by its dtype too (one place for every op):
    a patched value in float32 where the unpatched bf16 model gives bf16 fails even where it is closer."""
    from patchdsl.parity.inputs import _check

    ref = torch.randn(256, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tol = tolerance_for("bf16")
    same = _check("site", "model.norm", "fused_rmsnorm", "output", ref.bfloat16(), ref.bfloat16(), ref, tol)
    other = _check("site", "model.norm", "fused_rmsnorm", "output", ref.float(), ref.bfloat16(), ref, tol)
    assert same.passed and not other.passed
    assert "dtype float32 where the unpatched model gives bfloat16" in other.note


# ---------------------------------------------------------------- report format
def test_report_json_and_table():
    report = patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="bf16", batch=1, seq=8, steps=1, device=DEVICE)
    js = json.loads(json.dumps(report.to_json()))
    for k in ("passed", "verdict", "dtype", "device", "target", "model_class", "spec", "batch", "seq", "n_steps",
              "seed", "tolerance", "sites", "end_to_end", "steps", "grads_compared", "refused"):
        assert k in js, k
    assert js["dtype"] == "bf16" and js["model_class"] == "Qwen3ForCausalLM" and js["n_steps"] == 1
    assert js["tolerance"]["factor"] == FACTOR and js["tolerance"]["floor"] == FLOORS["bf16"]
    assert len(js["sites"]) == 3
    for s in js["sites"]:
        assert set(s) >= {"path", "op", "passed", "max_abs_err", "max_rel_err", "checks"}
        assert s["op"] == "fused_rmsnorm"
        for c in s["checks"]:
            assert set(c) >= {"kind", "path", "op", "quantity", "max_abs_err", "max_rel_err", "rel_fro_err",
                              "reference_err", "tolerance", "passed"}
            assert c["kind"] == "site" and c["path"] == s["path"]
    assert {c["quantity"] for c in js["end_to_end"]} >= {"loss", "logits"}
    assert [c["quantity"] for c in js["steps"]] == ["loss step 1"]

    from rich.console import Console

    con = Console(record=True, width=240)
    report.render_table(con)
    text = con.export_text()
    assert "model.layers.0.input_layernorm" in text and "grad_weight" in text
    assert text.strip().splitlines()[-1].startswith("PASS")


def test_report_of_nothing_fails():
    r = ParityReport("fp32", "cpu", "interpreter", "M", "s", 1, 2, 0, 0, FACTOR, FLOORS["fp32"])
    assert not r.passed and r.verdict.startswith("FAIL")


# ---------------------------------------------------------------- the tolerance rule itself
def test_errors_and_judge():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g, dtype=torch.float64)
    hf = ref.to(torch.bfloat16)
    tol = tolerance_for("bf16")
    e_hf = errors(hf, ref)
    assert 1e-3 < e_hf.rel_fro < 4e-3 and e_hf.finite
    assert judge(errors(hf, ref), e_hf, tol)[0]
    ok, ref_err, bound = judge(errors((ref * 1.05).to(torch.bfloat16), ref), e_hf, tol)   # 5% off: fails
    assert not ok and bound == pytest.approx(FACTOR * ref_err + FLOORS["bf16"])
    bad = hf.clone()
    bad[3] = float("nan")
    assert not judge(errors(bad, ref), e_hf, tol)[0]
    bad[3] = float("inf")
    e = errors(bad, ref)
    assert not e.finite and not judge(e, e_hf, tol)[0]
    assert errors(torch.zeros(5), torch.zeros(5, dtype=torch.float64)).rel_fro == 0.0
    assert errors(torch.ones(5), torch.zeros(5, dtype=torch.float64)).rel_fro == math.inf
    # elementwise relative error uses a guarded denominator (no division by ~0)
    r = torch.tensor([1.0, 1e-12], dtype=torch.float64)
    assert errors(torch.tensor([1.0, 2e-12], dtype=torch.float64), r).max_rel < 1e-8
    with pytest.raises(ValueError):
        errors(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError):
        tolerance_for("fp8")


def test_float64_mode_keeps_reference_in_float64():
    """HF's RMSNorm upcasts with .to(torch.float32); under the mode a float64 run stays float64."""
    model = tiny_qwen3(layers=1)()
    norm = copy.deepcopy(model.model.norm).double()
    x = torch.randn(4, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    with torch.no_grad():
        plain = norm(x)
        with float64_mode():
            kept = norm(x)
            assert torch.ones(2, dtype=torch.float64).float().dtype == torch.float64
            assert torch.arange(3).float().dtype == torch.float32      # non-float64 tensors unaffected
            assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
            # float64 @ float32 does not promote in torch: the mode widens the other operand
            # (transformers 5.17's RoPE: inv_freq.float() @ position_ids.float())
            assert (x @ torch.arange(48).float()).dtype == torch.float64
            t = torch.zeros(48)
            t.add_(x[0])                      # an in-place target keeps its dtype
            assert t.dtype == torch.float32
    assert (plain - exact).abs().max() > 1e-9          # HF's own path is only fp32-accurate
    assert (kept - exact).abs().max() < 1e-13


def test_verify_rejects_bad_arguments():
    with pytest.raises(ValueError):
        patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="fp8", device=DEVICE)
    with pytest.raises(TypeError):
        patchdsl.verify(NORMS, 42, device=DEVICE)
    model = tiny_qwen3(layers=1)()
    h = patchdsl.apply(NORMS, model)
    with pytest.raises(ValueError, match="already patched"):
        patchdsl.verify(NORMS, model, device=DEVICE)
    h.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_verify_real_qwen3_shapes_on_gpu():
    from patchdsl.model import load_model

    def factory():
        return load_model("Qwen/Qwen3-0.6B", weights=False, dtype="fp32", device="cuda", log=None).model

    spec = available_spec(*ALL_OPS)
    for dtype in ("bf16", "fp32"):
        report = patchdsl.verify(spec, factory, dtype=dtype, batch=2, seq=256, steps=2, device="cuda")
        assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]


# ---------------------------------------------------------------- refused sites fail verify
@pytest.mark.parametrize("optional", [False, True])
def test_verify_fails_when_a_site_the_spec_asked_for_was_refused(optional):
    """Llama has no q_norm/k_norm: fused_qk_norm_rope is refused on its attention.  A required
    rule makes verify fail (exit 1); the same rule marked optional ('?') passes."""
    from tests.families import tiny_model

    spec = "model.norm: RMSNorm -> fused_rmsnorm\n" + ("optional " if optional else "") + \
        "model.layers.0.self_attn: Attention -> fused_qk_norm_rope\n"
    report = patchdsl.verify(spec, lambda: tiny_model("llama", num_hidden_layers=1), dtype="fp32", batch=1, seq=8,
                             device=DEVICE)
    assert len(report.refused) == 1 and "no q_norm/k_norm" in report.refused[0]
    assert report.passed is optional
    if not optional:
        assert "the spec asked for were refused" in report.verdict
        assert report.to_json()["refused_required"] == report.refused
