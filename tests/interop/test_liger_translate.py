"""Liger-Kernel configs translated into specs: every key, Liger's defaults, the errors."""

import inspect
import json

import pytest
from click.testing import CliRunner

from patchdsl.planning.check import check_spec
from patchdsl.cli import main
from patchdsl.model.index import build_index
from patchdsl.interop.liger import (LIGER_KEYS, LigerConfigError, liger_defaults, parse_liger_argument,
                                        translate_liger)
from patchdsl.model import load_model
from patchdsl.planning.planner import plan
from patchdsl.syntax import parse_spec

_INDEX = {}


def index(model_id):
    if model_id not in _INDEX:
        _INDEX[model_id] = build_index(load_model(model_id, meta=True, log=None).model)
    return _INDEX[model_id]


QWEN3, LLAMA, GEMMA3, PHI3 = ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "google/gemma-3-1b-pt",
                              "microsoft/Phi-3-mini-4k-instruct")
OFF = {k: False for k in LIGER_KEYS}

# (model, the one key switched on, the rule it becomes, totals of that rule on the model)
ONE_KEY = [
    (LLAMA, "rope", "*.self_attn: Attention -> fused_rope", {"self_attn": (16, 16)}),
    (QWEN3, "rope", "*.self_attn: Attention -> fused_rope", {"self_attn": (28, 28)}),
    (QWEN3, "swiglu", "*.mlp: SwiGLU -> fused_swiglu", {"mlp": (28, 28)}),
    (PHI3, "swiglu", "*.mlp: SwiGLU -> fused_swiglu", {"mlp": (32, 32)}),
    (GEMMA3, "geglu", "*.mlp: GeGLU -> fused_geglu", {"mlp": (26, 26)}),
    (LLAMA, "cross_entropy", "lm_head: Linear -> fused_cross_entropy(ignore_index=-100)", {"lm_head": (1, 1)}),
    (QWEN3, "fused_linear_cross_entropy", "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto)",
     {"lm_head": (1, 1)}),
    (LLAMA, "rms_norm", "*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm",
     {"input_layernorm": (16, 16), "norm": (1, 1)}),
    (QWEN3, "rms_norm", "*.q_norm, *.k_norm, *.input_layernorm, *.post_attention_layernorm, model.norm: "
                        "RMSNorm -> fused_rmsnorm", {"q_norm": (28, 28), "k_norm": (28, 28), "norm": (1, 1)}),
]


@pytest.mark.parametrize("model_id,key,rule,totals", ONE_KEY, ids=[f"{k}-{m.split('/')[1]}" for m, k, _, _ in ONE_KEY])
def test_each_key_alone(model_id, key, rule, totals):
    t = translate_liger({**OFF, key: True}, index(model_id))
    assert t.ok and t.rules == ((key, rule),)
    p = plan(parse_spec(t.text, "<t>"), index(model_id))
    got = {n: (a, b) for n, a, b in p.totals}
    for name, want in totals.items():
        assert got[name] == want


def test_layer_norm_key():
    """No shipped family has LayerNorms: a tiny model with one shows the key's rule; on Llama it is a misfit."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(16)
            self.ln_2 = torch.nn.LayerNorm(16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.ModuleList([Block(), Block()])
            self.ln_f = torch.nn.LayerNorm(16)

    t = translate_liger({**OFF, "layer_norm": True}, build_index(Net()))
    assert t.rules == (("layer_norm", "*.ln_1, *.ln_2, ln_f: LayerNorm -> fused_layernorm"),)
    p = plan(parse_spec(t.text, "<t>"), Net(), target="interpreter")
    assert len(p.sites) == 5
    bad = translate_liger({**OFF, "layer_norm": True}, index(LLAMA))
    assert bad.problems == ("layer_norm: LlamaForCausalLM has no LayerNorm module (its norms are RMSNorms: rms_norm)",)


def test_rope_with_rms_norm_fuses_qk_norms():
    t = translate_liger({"rope": True, "rms_norm": True, "swiglu": False, "fused_linear_cross_entropy": False},
                        index(QWEN3))
    assert dict(t.rules) == {"rms_norm": "*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> "
                                         "fused_rmsnorm",
                             "rope": "*.self_attn: Attention -> fused_qk_norm_rope"}
    totals = {n: (a, b) for n, a, b in plan(parse_spec(t.text, "<t>"), index(QWEN3)).totals}
    assert totals["q_norm"] == totals["k_norm"] == (28, 28)    # every RMSNorm is still patched, once


@pytest.mark.parametrize("model_id,shipped", [(QWEN3, "qwen3"), (LLAMA, "llama"), (GEMMA3, "gemma3"), (PHI3, "phi3")])
def test_liger_defaults_equal_the_shipped_spec(model_id, shipped):
    """use_liger_kernel with no config = Liger's defaults for the model = the shipped spec's sites."""
    from patchdsl import load_spec

    t = translate_liger(None, index(model_id))
    assert t.ok, t.problems
    mine = plan(parse_spec(t.text, "<t>"), index(model_id))
    ref = plan(load_spec(shipped), index(model_id))
    assert [(s.path, s.op) for s in mine.sites] == [(s.path, s.op) for s in ref.sites]
    assert parse_liger_argument("true") == (True, None)


def test_liger_table_matches_installed_liger():
    """The per-model defaults table is Liger's own, for every model type Liger has a function for (checked
    when Liger is installed)."""
    from patchdsl.interop.liger import liger_model_types

    mp = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    assert set(liger_model_types()) == set(mp.MODEL_TYPE_TO_APPLY_LIGER_FN)
    for model_type, fn in mp.MODEL_TYPE_TO_APPLY_LIGER_FN.items():
        want = {k: p.default for k, p in inspect.signature(fn).parameters.items() if k in LIGER_KEYS}
        assert liger_defaults(model_type) == want, model_type


def test_liger_defaults_of_a_vision_language_model_take_its_language_model_s():
    """Llava, InternVL and SmolVLM hand their language model to its own type's function (the loss stays the
    outer model's): what Liger patches there is that function's defaults too."""
    assert liger_defaults("llava") == {"cross_entropy": False, "fused_linear_cross_entropy": True}
    assert liger_defaults("llava", "llama") == {"cross_entropy": False, "fused_linear_cross_entropy": True,
                                                "rope": True, "rms_norm": True, "swiglu": True}
    assert liger_defaults("internvl", "qwen2")["swiglu"] is True
    assert liger_defaults("qwen2_vl", "qwen2_vl_text") == liger_defaults("qwen2_vl")     # not a delegating one


def test_a_default_key_with_nothing_to_patch_is_a_note_and_a_given_one_a_problem():
    """Llama 4's layer_norm (on by Liger's default) is for its vision tower: on the text model Liger patches
    nothing with it, and the translation says so in a note; asked for explicitly it is a problem."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama4_text", num_hidden_layers=2))
    idx = build_index(m)
    t = translate_liger(None, idx)
    assert not t.problems and any("layer_norm (on by Liger's default) has nothing to patch" in n for n in t.notes)
    t = translate_liger({"layer_norm": True}, idx)
    assert t.problems == ("layer_norm: Llama4ForCausalLM has no LayerNorm module (its norms are RMSNorms: rms_norm)",)


def test_swiglu_on_a_mixture_of_experts_takes_its_experts_and_relu_squared_the_relu2_mlp():
    """Liger's swiglu swaps a MoE's experts for LigerExperts (transformers 5): fused_experts; Nemotron's
    relu_squared: its relu2 MLPs, fused_mlp."""
    from ..moe_families import tiny_moe_model

    t = translate_liger(None, build_index(tiny_moe_model("qwen3_moe")))
    assert any(k == "swiglu" and r.endswith("experts: Experts -> fused_experts") for k, r in t.rules), t.rules
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    with torch.device("meta"):
        nem = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron", num_hidden_layers=2, head_dim=64,
                                                                     num_key_value_heads=8))
    t = translate_liger(None, build_index(nem))
    assert dict(t.rules)["relu_squared"] == "*.mlp: MLP -> fused_mlp", t.rules
    assert not t.problems


@pytest.mark.parametrize("config,frag", [
    ({"rms_nrom": True}, "unknown liger_kernel_config key 'rms_nrom' (Liger would drop it silently)\n"
                         "  hint: did you mean 'rms_norm'? allowed keys: rope, swiglu, geglu, cross_entropy, "
                         "fused_linear_cross_entropy, rms_norm, layer_norm, relu_squared"),
    ({"flash_attention": True}, "unknown liger_kernel_config key 'flash_attention'"),
    ({"rope": "yes"}, "key 'rope' must be true or false, got \"yes\""),
    ({"cross_entropy": True, "fused_linear_cross_entropy": True}, "both true"),
    (OFF, "every Liger key is off"),
    (["rope"], "must be a mapping"),
])
def test_config_errors(config, frag):
    with pytest.raises(LigerConfigError) as ei:
        translate_liger(config, index(LLAMA))
    assert frag in ei.value.render()


def test_cross_entropy_alone_switches_the_fused_default_off():
    t = translate_liger({"cross_entropy": True}, index(LLAMA))
    assert dict(t.keys)["fused_linear_cross_entropy"] is False
    assert [k for k, _ in t.rules] == ["rms_norm", "rope", "swiglu", "cross_entropy"]
    check_spec(parse_spec(t.text, "<t>"))


def test_misfit_key_is_reported_once_per_class_not_per_layer():
    t = translate_liger({"swiglu": True, "geglu": False}, index(GEMMA3))
    assert not t.ok
    assert t.problems == ("swiglu: 26 modules (model.layers.0.mlp, ...) (Gemma3MLP) are GeGLU MLPs (activation "
                          "gelu_tanh), not SwiGLU: use geglu",)


# ------------------------------------------------------------------ the command line
def run(*args):
    return CliRunner().invoke(main, list(args))


def test_cli_translate_prints_a_spec_that_plans():
    r = run("translate", "--liger", json.dumps({"rope": True, "swiglu": True, "cross_entropy": False,
                                                "fused_linear_cross_entropy": True, "rms_norm": True}),
            "--model", QWEN3)
    assert r.exit_code == 0, r.output
    body = [ln.split("#")[0].strip() for ln in r.output.splitlines() if ln.strip() and not ln.startswith("#")]
    assert body == ["*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm",
                    "*.self_attn: Attention -> fused_qk_norm_rope", "*.mlp: SwiGLU -> fused_swiglu",
                    "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto)"]
    assert plan(parse_spec(r.output, "<cli>"), index(QWEN3)).totals[0] == ("input_layernorm", 28, 28)


def test_cli_translate_from_a_training_yaml(tmp_path):
    f = tmp_path / "train.yaml"
    f.write_text("learning_rate: 1.0e-4\nuse_liger_kernel: true\nliger_kernel_config:\n  rope: false\n")
    r = run("translate", "--liger", f"@{f}", "--model", LLAMA)
    assert r.exit_code == 0, r.output
    assert "fused_rope" not in r.output and "fused_swiglu" in r.output


@pytest.mark.parametrize("args,frag", [
    (["--liger", '{"rms_nrom": true}', "--model", LLAMA], "did you mean 'rms_norm'?"),
    (["--liger", '{"swiglu": true}', "--model", GEMMA3], "error: swiglu: 26 modules (model.layers.0.mlp, ...) (Gemma3MLP) are GeGLU"),
    (["--liger", "{rope: true}", "--model", LLAMA], "is not valid JSON"),
    (["--liger", "true"], "needs --model"),
    (["--model", LLAMA], "--liger"),
    (["--liger", "@/nonexistent.json", "--model", LLAMA], "cannot read"),
])
def test_cli_translate_errors(args, frag):
    r = run("translate", *args)
    assert r.exit_code == 2
    assert frag in r.output
    assert "Traceback" not in r.output
