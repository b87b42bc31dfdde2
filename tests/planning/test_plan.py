"""The planner: precedence as a table, strictness, optional rules, totals, JSON round-trip."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from patchdsl import SpecError, parse_spec
from patchdsl.model.index import build_index
from patchdsl.planning.plan import PatchPlan
from patchdsl.planning.planner import plan

N_LAYERS = 4


@pytest.fixture(scope="module")
def qwen3_meta():
    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def index(qwen3_meta):
    return build_index(qwen3_meta)


# (spec, path, expected op or None, expected flags subset, expected flag sources subset)
PRECEDENCE = [
    # one rule
    ("*.input_layernorm: RMSNorm -> fused_rmsnorm",
     "model.layers.0.input_layernorm", "fused_rmsnorm", {"eps": "auto"}, {"eps": "op default"}),
    # a later rule for the same op refines flags, only those it sets
    ("*.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-5, casting=llama)\n"
     "model.layers.{0..1}.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-6)",
     "model.layers.1.input_layernorm", "fused_rmsnorm", {"eps": 1e-6, "casting": "llama"},
     {"eps": "t.kpatch:2", "casting": "t.kpatch:1"}),
    ("*.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-5, casting=llama)\n"
     "model.layers.{0..1}.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-6)",
     "model.layers.2.input_layernorm", "fused_rmsnorm", {"eps": 1e-5}, {"eps": "t.kpatch:1"}),
    # file order: the last setter wins even when the earlier rule is more specific
    ("model.layers.0.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-6)\n"
     "*.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-5)",
     "model.layers.0.input_layernorm", "fused_rmsnorm", {"eps": 1e-5}, {"eps": "t.kpatch:2"}),
    # default directive < rule flags, wherever the directive stands
    ("*.input_layernorm: RMSNorm -> fused_rmsnorm\ndefault fused_rmsnorm(eps=1e-3)",
     "model.layers.0.input_layernorm", "fused_rmsnorm", {"eps": 1e-3}, {"eps": "t.kpatch:2"}),
    ("default fused_rmsnorm(eps=1e-3)\n*.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-4)",
     "model.layers.0.input_layernorm", "fused_rmsnorm", {"eps": 1e-4}, {"eps": "t.kpatch:2"}),
    # later default directive overrides an earlier one
    ("default fused_rmsnorm(eps=1e-3)\ndefault fused_rmsnorm(eps=1e-2)\n*.input_layernorm: RMSNorm -> fused_rmsnorm",
     "model.layers.0.input_layernorm", "fused_rmsnorm", {"eps": 1e-2}, {"eps": "t.kpatch:2"}),
    # exclusion removes a module from a rule
    ("*.input_layernorm, !model.layers.3.input_layernorm: RMSNorm -> fused_rmsnorm",
     "model.layers.3.input_layernorm", None, {}, {}),
    # class patterns: exact, glob, alternatives, base classes
    ("*.q_norm: Qwen3RMSNorm -> fused_rmsnorm", "model.layers.0.self_attn.q_norm", "fused_rmsnorm", {}, {}),
    ("*.q_norm: *RMSNorm -> fused_rmsnorm", "model.layers.0.self_attn.q_norm", "fused_rmsnorm", {}, {}),
    ("*norm: LlamaRMSNorm|Qwen3RMSNorm -> fused_rmsnorm", "model.norm", "fused_rmsnorm", {}, {}),
    # kinds and class patterns mixed
    ("model.layers.0.*: RMSNorm|*MLP -> fused_rmsnorm", "model.layers.0.input_layernorm", "fused_rmsnorm", {}, {}),
    ("model.layers.0.*: RMSNorm|*MLP -> fused_rmsnorm", "model.layers.0.mlp", None, {}, {}),
    # a selector that matches more than the kind only patches what fits
    ("model.layers.0.*: RMSNorm -> fused_rmsnorm", "model.layers.0.mlp", None, {}, {}),
]


@pytest.mark.parametrize("text,path,op,flags,sources", PRECEDENCE)
def test_precedence_table(index, text, path, op, flags, sources):
    p = plan(parse_spec(text, "t.kpatch"), index, target="interpreter")
    site = p.site(path)
    if op is None:
        assert site is None
        return
    assert site is not None and site.op == op
    for k, v in flags.items():
        assert site.flag_dict[k] == v
    fs = dict(site.flag_sources)
    for k, v in sources.items():
        assert fs[k] == v


# (spec, error fragment, line of the error)
PLAN_ERRORS = [
    ("mlp: SwiGLU -> fused_swiglu", "'mlp' matched 0 modules", 1),
    ("*.mlp: GeGLU -> fused_geglu", "matched 4 module(s) (Qwen3MLP) but none is GeGLU", 1),
    ("*.q_norm: Qwen3RMSnorm -> fused_rmsnorm", "none is Qwen3RMSnorm", 1),
    ("*.self_attn: Attention -> fused_rope\nmodel.layers.1.self_attn: Attention -> fused_qk_norm_rope",
     "would get two different ops: fused_rope and fused_qk_norm_rope", 2),
    ("lm_head: Linear -> fused_cross_entropy\nlm_head: Linear -> fused_linear_cross_entropy",
     "would get two different ops", 2),
    ("*.self_attn: Attention -> fused_qk_norm_rope\n*.q_norm: RMSNorm -> fused_rmsnorm",
     "is fused into", 2),
]


@pytest.mark.parametrize("text,frag,line", PLAN_ERRORS)
def test_plan_errors(index, text, frag, line):
    with pytest.raises(SpecError) as ei:
        plan(parse_spec(text, "t.kpatch"), index, target="interpreter")
    assert frag in ei.value.message
    assert ei.value.span.line == line


def test_conflict_names_both_lines(index):
    with pytest.raises(SpecError) as ei:
        plan(parse_spec("*.self_attn: Attention -> fused_rope\n\n*.self_attn: Attention -> fused_qk_norm_rope",
                        "t.kpatch"), index, target="interpreter")
    text = ei.value.render()
    assert "t.kpatch:3:" in text and "t.kpatch:1:" in text


def test_zero_match_hint(index):
    with pytest.raises(SpecError) as ei:
        plan(parse_spec("mlp: SwiGLU -> fused_swiglu", "t.kpatch"), index, target="interpreter")
    assert f"'*.mlp' matches {N_LAYERS}" in ei.value.hint


def test_optional_rule_may_match_nothing(index):
    p = plan(parse_spec("optional *.vision_tower.*: RMSNorm -> fused_rmsnorm\nmodel.norm: RMSNorm -> fused_rmsnorm",
                        "t.kpatch"), index, target="interpreter")
    assert len(p.sites) == 1 and len(p.unmatched_optional) == 1 and "t.kpatch:1" in p.unmatched_optional[0]


def test_totals_and_json_roundtrip(index):
    p = plan(parse_spec("dtype bf16, fp32\n*.input_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n"
                        "*.mlp: SwiGLU -> fused_swiglu", "t.kpatch"), index, target="interpreter")
    totals = {n: (a, b) for n, a, b in p.totals}
    assert totals["input_layernorm"] == (N_LAYERS, N_LAYERS)
    assert totals["mlp"] == (N_LAYERS, N_LAYERS)
    assert totals["norm"] == (1, 1)
    d = json.loads(p.dumps())
    assert {"path", "class", "op", "flags", "rule"} <= set(d["sites"][0])
    q = PatchPlan.from_json(d)
    assert q.sites == p.sites and q.totals == p.totals
    # every site has one kernel key per dtype
    assert all(len(s.keys) == 2 for s in p.sites)


def test_qwen3_shipped_spec_covers_every_norm_mlp_and_head(qwen3_meta):
    from patchdsl.util.resources import shipped_spec
    from patchdsl.syntax import load_spec

    p = plan(load_spec(shipped_spec("qwen3")), qwen3_meta, target="interpreter")
    totals = {n: (a, b) for n, a, b in p.totals}
    for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "mlp", "self_attn"):
        assert totals[name] == (N_LAYERS, N_LAYERS), name
    assert totals["norm"] == (1, 1) and totals["lm_head"] == (1, 1)


def test_plan_needs_no_weights(qwen3_meta):
    assert all(p.device.type == "meta" for p in qwen3_meta.parameters())
    p = plan("*.mlp: SwiGLU -> fused_swiglu", qwen3_meta, target="interpreter")
    assert len(p.sites) == N_LAYERS


def test_cli_plan_full_qwen3_offline():
    """`patchdsl plan specs/qwen3.kpatch --model Qwen/Qwen3-0.6B` with no network and no weights:
    every RMSNorm (q_norm/k_norm fused into the attention op), every MLP and the LM head."""
    from click.testing import CliRunner

    from patchdsl.cli import main
    from patchdsl.util.resources import shipped_spec

    r = CliRunner().invoke(main, ["plan", str(shipped_spec("qwen3")), "--model", "Qwen/Qwen3-0.6B", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    totals = {t["name"]: (t["patched"], t["present"]) for t in d["totals"]}
    for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "mlp", "self_attn"):
        assert totals[name] == (28, 28), (name, totals)
    assert totals["norm"] == (1, 1) and totals["lm_head"] == (1, 1)
    assert {s["op"] for s in d["sites"]} == {"fused_rmsnorm", "fused_qk_norm_rope", "fused_swiglu",
                                             "fused_linear_cross_entropy"}
    rms = next(s for s in d["sites"] if s["op"] == "fused_rmsnorm")
    assert rms["kernels"][0]["params"]["hidden"] == 1024


def test_plan_shows_what_apply_will_refuse():
    """`patchdsl plan specs/qwen3.kpatch --model meta-llama/Llama-3.2-1B`: Llama's attention has no
    q_norm/k_norm, so the self_attn sites are refused at plan time with apply's reason, and never
    counted as patched (text and --json).  Refused sites the spec asks for are bad input, exit 2,
    as in apply and verify (issue 22); the plan is still printed."""
    from click.testing import CliRunner

    from patchdsl.cli import main

    r = CliRunner().invoke(main, ["plan", "specs/qwen3.kpatch", "--model", "meta-llama/Llama-3.2-1B", "--json"])
    assert r.exit_code == 2, r.output
    assert "error: 16 site(s) the spec asks for are refused" in r.stderr
    d = json.loads(r.stdout[r.stdout.index("{"):])
    totals = {t["name"]: (t["patched"], t["present"]) for t in d["totals"]}
    assert totals["self_attn"] == (0, 16) and totals["mlp"] == (16, 16)
    refused = [s for s in d["sites"] if s["refused"]]
    assert len(refused) == 16 and all(s["path"].endswith("self_attn") for s in refused)
    assert "no q_norm/k_norm" in refused[0]["refused"] and "use fused_rope" in refused[0]["refused"]
    assert not any(k["op"] == "fused_qk_norm_rope" for s in d["sites"] if not s["refused"] for k in s["kernels"])
    r = CliRunner().invoke(main, ["plan", "specs/qwen3.kpatch", "--model", "meta-llama/Llama-3.2-1B"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "modules patched: " in text and "0/16 self_attn" in text
    assert "refused fused_qk_norm_rope on 16 sites" in text and "no q_norm/k_norm" in text
    assert "50 site(s) to patch, 16 refused" in text


def test_plan_refusal_matches_apply():
    from tests.families import tiny_model
    from patchdsl.runtime import apply

    m = tiny_model("llama")
    p = plan("*.self_attn: Attention -> fused_qk_norm_rope\nmodel.norm: RMSNorm -> fused_rmsnorm", m)
    assert [s.path for s in p.refused_sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert dict((n, (a, b)) for n, a, b in p.totals)["self_attn"] == (0, 2)
    h = apply(p, m)
    assert h.patched == ["model.norm"]
    assert [(r.path, r.reason) for r in h.refused] == [(s.path, s.refused) for s in p.refused_sites]
    h.undo()
