"""verify's streamed float64 reference (one decoder layer at a time) and ``verify --layers N``.

The streamed path must give the same numbers, hence the same verdicts, as the whole-model path
(same float64 computation, only materialised layer by layer), catch the same broken kernels
(the mutation machinery of test_mutations.py), and keep at most the skeleton (everything outside
the decoder layers) plus one decoder layer in float64 at a time: counted by
``report.reference["float64_params_peak"]`` (weakref finalizers on every float64 parameter the
reference creates), not by wall time or the allocator.
"""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

import patchdsl
from patchdsl.parity import stream as stream_mod
from patchdsl.parity.stream import VerifyError, VerifyOutOfMemory
from tests.kernels.helpers import DEVICE
from tests.runtime.test_mutations import ALL_MUTATIONS, MODELS, SPECS, _template_of, mutate  # noqa: F401  (fixture)
from tests.parity.test_verify import ALL_OPS, NORMS, available_spec, tiny_qwen3


def _rows(report):
    return {(r.kind, r.path, r.quantity): r for r in report.rows}


def _same(a, b):
    """Same checks, same verdicts, the same numbers up to float64 roundoff."""
    ra, rb = _rows(a), _rows(b)
    assert ra.keys() == rb.keys()
    for k in ra:
        x, y = ra[k], rb[k]
        assert x.passed == y.passed, k
        for f in ("rel_fro_err", "reference_err"):
            u, v = getattr(x, f), getattr(y, f)
            assert (math.isnan(u) and math.isnan(v)) or u == pytest.approx(v, rel=1e-9, abs=1e-300), (k, f, u, v)
    assert a.passed == b.passed and a.failed_sites() == b.failed_sites()
    assert a.grads_compared == b.grads_compared


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_equals_whole(dtype):
    spec = available_spec(*ALL_OPS) if dtype == "fp32" else NORMS
    kw = dict(dtype=dtype, batch=2, seq=8, seed=1, device=DEVICE, steps=1, worst=10_000)
    whole = patchdsl.verify(spec, tiny_qwen3(layers=2), reference="whole", **kw)
    streamed = patchdsl.verify(spec, tiny_qwen3(layers=2), reference="streamed", **kw)
    assert whole.passed, [(r.path, r.quantity) for r in whole.failures()]
    _same(whole, streamed)
    assert [r.quantity for r in streamed.rows if r.kind == "step"] == ["loss step 1"]
    # what the reference held in float64 at once: the whole model, versus skeleton + one layer
    w, s = whole.reference, streamed.reference
    assert (w["mode"], s["mode"]) == ("whole", "streamed")
    assert w["float64_params_peak"] == w["params"]
    assert s["float64_params_peak"] == s["outside_layers_params"] + s["layer_params"] < w["params"]
    assert s["layer_copies"] == 2 * 3          # each layer: forward, backward, step 1's forward
    assert whole.to_json()["reference"]["mode"] == "whole" and "streamed" in streamed.to_json()["reference"]["compared"]


def tiny_qwen3_moe():
    """A tiny Qwen3-MoE (4 experts, top-2) with transformers' eager experts (grouped_mm has no float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=48, intermediate_size=80, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=160, max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[], attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen3_moe"])
def test_streamed_equals_whole_other_layer_kinds(family):
    """Gemma 3 (sliding and global layers, four norms, layer_types read through the proxy), Phi-3
    (fused qkv / gate_up projections) and a mixture-of-experts layer stream like Qwen3: the
    streamed reference does not look inside a decoder layer."""
    from tests.families import tiny_model

    spec = {"gemma3": "*.input_layernorm, *.pre_feedforward_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n"
            }.get(family, NORMS)
    make = tiny_qwen3_moe if family == "qwen3_moe" else (lambda: tiny_model(family, num_hidden_layers=2))
    kw = dict(dtype="fp32", batch=1, seq=12, seed=2, device=DEVICE, worst=10_000)
    whole = patchdsl.verify(spec, make, reference="whole", **kw)
    streamed = patchdsl.verify(spec, make, reference="streamed", **kw)
    assert whole.passed
    _same(whole, streamed)
    assert streamed.reference["float64_params_peak"] < whole.reference["float64_params_peak"]


STREAM_MUTATIONS = [m for m in ALL_MUTATIONS if _template_of(m.op) and (m.op, m.name) in {
    ("fused_rmsnorm", "dw_halved"), ("fused_swiglu", "dgate_sign"),
    ("fused_linear_cross_entropy", "grad_not_divided_by_token_count")}]


@pytest.mark.parametrize("mutation", STREAM_MUTATIONS, ids=[m.id for m in STREAM_MUTATIONS])
def test_streamed_catches_a_broken_kernel(mutation, mutate):  # noqa: F811
    broken = mutate(mutation)
    report = patchdsl.verify(SPECS[mutation.op], MODELS[mutation.model], dtype=mutation.dtype, batch=2, seq=12,
                             seed=3, device=DEVICE, reference="streamed")
    assert broken and report.reference["mode"] == "streamed"
    assert not report.passed and report.exit_code() == 1
    failed = report.failed_sites()
    assert failed and {s["op"] for s in report.sites if s["path"] in failed} == {mutation.op}
    bad_q = {r.quantity for r in report.failures() if r.kind == "site"}
    assert set(mutation.expect) <= bad_q
    assert any(r.kind == "end-to-end" and not r.passed for r in report.rows)


def test_layers_option_cuts_the_model_and_says_so():
    report = patchdsl.verify(NORMS, tiny_qwen3(layers=3), dtype="fp32", batch=1, seq=8, device=DEVICE, layers=1)
    assert report.passed
    assert {k: report.layers[k] for k in ("used", "of", "kept")} == {"used": 1, "of": 3, "kept": [0]}
    assert {s["path"] for s in report.sites} == {"model.layers.0.input_layernorm",
                                                 "model.layers.0.post_attention_layernorm", "model.norm"}
    assert report.verdict.endswith("[decoder layers 0 of 3 only]")
    js = report.to_json()
    assert js["layers"]["used"] == 1 and js["layers"]["of"] == 3
    full = patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="fp32", batch=1, seq=8, device=DEVICE, layers=5)
    assert full.layers["used"] == full.layers["of"] == 1 and "decoder layers" not in full.verdict
    with pytest.raises(ValueError):
        patchdsl.verify(NORMS, tiny_qwen3(layers=1), device=DEVICE, layers=0)


def test_auto_picks_streamed_when_the_whole_copy_does_not_fit(monkeypatch):
    monkeypatch.setattr(stream_mod, "free_memory", lambda device: 200_000)   # bytes: between the two estimates
    report = patchdsl.verify(NORMS, tiny_qwen3(layers=2), dtype="fp32", batch=1, seq=8, device=DEVICE)
    assert report.reference["mode"] == "streamed" and "needs" in report.reference["why"]
    assert report.passed
    # more than one training step needs the whole float64 model: auto tries it (an out-of-memory is then
    # a message), an explicit streamed reference is an error
    r2 = patchdsl.verify(NORMS, tiny_qwen3(layers=2), dtype="fp32", batch=1, seq=8, device=DEVICE, steps=2)
    assert r2.reference["mode"] == "whole" and "may not fit" in r2.reference["why"] and r2.passed
    with pytest.raises(VerifyError, match="--steps 0 or 1"):
        patchdsl.verify(NORMS, tiny_qwen3(layers=2), dtype="fp32", batch=1, seq=8, device=DEVICE, steps=2,
                        reference="streamed")


def _oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.mark.parametrize("where", ["stream", "whole"])
def test_out_of_memory_is_a_message(monkeypatch, where):
    import patchdsl.parity.run as run_mod

    if where == "stream":
        monkeypatch.setattr(stream_mod.StreamedReference, "backward_layer", _oom)
    else:
        monkeypatch.setattr(run_mod, "_forward_backward", _oom)
    with pytest.raises(VerifyOutOfMemory) as ei:
        patchdsl.verify(NORMS, tiny_qwen3(layers=1), dtype="fp32", batch=2, seq=8, device=DEVICE,
                        reference="streamed" if where == "stream" else "whole")
    msg = str(ei.value)
    assert "ran out of memory" in msg and "--layers N" in msg and "--batch" in msg and "--seq" in msg
    assert ("--reference streamed" in msg) == (where == "whole")
    assert "while float64 reference, streamed" in msg if where == "stream" else "while float64 reference" in msg


def test_cli_out_of_memory_exits_2_without_traceback(monkeypatch):
    from patchdsl.cli import main

    monkeypatch.setattr(stream_mod.StreamedReference, "forward_backward", _oom)
    r = CliRunner().invoke(main, ["verify", "qwen3", "--model", "Qwen/Qwen3-0.6B", "--device", "cpu", "--seq", "4",
                                  "--batch", "1", "--layers", "1", "--reference", "streamed"])
    assert r.exit_code == 2, r.output
    assert "ran out of memory" in r.output and "Traceback" not in r.output and "--layers N" in r.output
    r = CliRunner().invoke(main, ["verify", "qwen3", "--model", "Qwen/Qwen3-0.6B", "--device", "cpu", "--seq", "4",
                                  "--steps", "2", "--reference", "streamed"])
    assert r.exit_code == 2 and "--steps 0 or 1" in r.output and "Traceback" not in r.output


def test_cli_layers_and_reference(tmp_path):
    import json

    from patchdsl.cli import main

    r = CliRunner().invoke(main, ["verify", "qwen3", "--model", "Qwen/Qwen3-0.6B", "--device", "cpu", "--seq", "6",
                                  "--batch", "1", "--layers", "1", "--reference", "streamed", "--json"])
    assert r.exit_code == 0, r.output
    js = json.loads(r.output[r.output.index("{"):])
    assert js["passed"] and js["layers"]["used"] == 1 and js["layers"]["of"] == 2 and js["reference"]["mode"] == "streamed"
