"""inspect and suggest: a model's modules with kinds and facts; the spec that patches what plans.

The suggested spec is judged by the planner (it must plan with no refusal), by the shipped specs
(on their families it must patch exactly what they patch), by apply (nothing refused, undo
restores) and by verify (float64 parity) on a few families.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from click.testing import CliRunner

from patchdsl.cli import main
from patchdsl.model.index import build_index
from patchdsl.model.inspection import fold_paths, int_set, inspect_model, render, rows
from patchdsl.planning.planner import plan
from patchdsl.planning.suggestion import CONCERNS, suggest

from ..families import FAMILIES, SPEC_OF, tiny_model


def _family_model(model_type: str, meta: bool = True):
    """A tiny model of any installed family, built as the census builds it."""
    from patchdsl.model.tiny import build, tiny_family_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            cfg = tiny_family_config(model_type)
            if meta:
                from transformers import AutoModelForCausalLM

                with torch.device("meta"):
                    return AutoModelForCausalLM.from_config(cfg)
            return build(cfg)
        finally:
            logging.disable(logging.NOTSET)


# ------------------------------------------------------------------ folding
@pytest.mark.parametrize("paths,want", [
    (["model.norm"], ["model.norm"]),
    (["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp"], ["model.layers.{0..2}.mlp"]),
    (["model.layers.0.mlp", "model.layers.2.mlp"], ["model.layers.{0,2}.mlp"]),
    (["model.layers.3.mlp"], ["model.layers.3.mlp"]),
    (["a.0.x", "a.1.x", "b.0.x", "model.norm"], ["a.{0..1}.x", "b.0.x", "model.norm"]),
    (["m.layers.0.experts.0", "m.layers.0.experts.1", "m.layers.1.experts.0"],
     ["m.layers.0.experts.{0..1}", "m.layers.1.experts.0"]),
])
def test_fold_paths(paths, want):
    assert fold_paths(paths) == want


def test_folded_selectors_select_exactly_their_paths():
    from patchdsl.syntax.selectors import compile_selector

    paths = [f"model.layers.{i}.mlp" for i in (0, 1, 2, 5, 11)]
    others = [f"model.layers.{i}.mlp" for i in (3, 4, 6, 10, 12)] + ["model.layers.1.mlp.up"]
    for sel in fold_paths(paths):
        rx = compile_selector(sel)
        assert not any(rx.match(o) for o in others), sel
    assert all(any(compile_selector(s).match(p) for s in fold_paths(paths)) for p in paths)


@pytest.mark.parametrize("nums,want", [([3], "3"), ([0, 1, 2], "{0..2}"), ([2, 0], "{0,2}"), ([1, 1, 2], "{1..2}")])
def test_int_set(nums, want):
    assert int_set(nums) == want


# ------------------------------------------------------------------ inspect
def test_inspect_folds_layers_and_states_facts():
    m = tiny_model("qwen3", num_hidden_layers=3)
    idx = build_index(m)
    text = render(idx)
    line = next(ln for ln in text.splitlines() if ln.startswith("model.layers.{0..2}.mlp "))
    assert "SwiGLU" in line and "hidden=64 inter=96 silu" in line
    qn = next(ln for ln in text.splitlines() if ln.startswith("model.layers.{0..2}.self_attn "))
    assert "heads=4 kv=2 head_dim=16 rotary=16 layout=rotate_half qk_norm(eps=1e-06 offset=0)" in qn
    assert any(ln.startswith("lm_head ") for ln in text.splitlines())
    # no Linear projections by default; every module with --all, one row per module unfolded
    assert "q_proj" not in text
    assert "q_proj" in render(idx, everything=True)
    assert len(rows(idx, fold=False)) == len(rows(idx)) + 2 * sum(1 for r in rows(idx) if len(r.paths) == 3)


def test_inspect_json_counts_every_folded_module():
    m = tiny_model("gemma3", num_hidden_layers=2)
    d = inspect_model(m)
    assert d["model_class"] == "Gemma3ForCausalLM"
    mlp = next(r for r in d["modules"] if r["pattern"] == "model.layers.{0..1}.mlp")
    assert mlp["count"] == 2 and mlp["kinds"]["GeGLU"]["activation"] == "gelu_tanh"
    norm = next(r for r in d["modules"] if r["pattern"] == "model.norm")
    assert norm["kinds"]["RMSNorm"]["offset"] == 1.0


# (model, config overrides, the MoE block's router path, the routing both rows must state; issue 37/38):
# real router widths on the meta device (Qwen3-30B-A3B's shipped config; DeepSeek-V3's and dots1's defaults
# cut to a few layers, the first MoE one kept)
MOE_INSPECT = {
    "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B", {}, "model.layers.{0..47}.mlp",
                      dict(scoring="softmax_topk", norm_topk=True, top_k=8, experts=128)),
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=4), "model.layers.3.mlp",
                    dict(scoring="sigmoid_grouped", norm_topk=True, top_k=8, experts=256, n_group=8, topk_group=4,
                         scaling=2.5)),
    "dots1": ("dots1", dict(num_hidden_layers=2, n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=2,
                            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5),
              "model.layers.1.mlp", dict(scoring="sigmoid_grouped", norm_topk=True, top_k=6, experts=128,
                                         n_group=1, topk_group=1, scaling=2.5)),
}


@pytest.mark.parametrize("case", list(MOE_INSPECT))
def test_inspect_states_the_moe_routing_once_for_block_and_router(case):
    """The MoE block's row and its router's row state the same routing, and it is the model's (issue 38:
    Qwen3-30B-A3B's block read ``scoring=unknown norm_topk=None`` while its router read
    ``softmax_topk``/``True``: the block probed with an unscaled weight whose softmax underflowed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchdsl.model.loading import _read_config_dict, config_from_dict, shipped_config_path

    source, over, block, want = MOE_INSPECT[case]
    cfg = (config_from_dict(_read_config_dict(shipped_config_path(source))) if "/" in source
           else AutoConfig.for_model(source))
    for k, v in over.items():
        setattr(cfg, k, v)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    idx = build_index(m)
    d = inspect_model(idx, everything=True)
    by = {r["pattern"]: r for r in d["modules"]}
    b, r = by[block]["kinds"]["MoEBlock"], by[block + ".gate"]["kinds"]["Router"]
    for k, v in want.items():
        assert b[k] == v and r[k] == v, (k, v, b, r)
    text = render(idx)
    ln = next(x for x in text.splitlines() if x.startswith(block + " "))
    assert f"scoring={want['scoring']} norm_topk={want['norm_topk']}" in ln, ln


def test_inspect_names_modules_that_fit_no_kind():
    text = render(build_index(_family_model("bloom")))     # its MLP's forward takes the residual too
    ln = next(x for x in text.splitlines() if x.startswith("transformer.h.{0..1}.mlp "))
    assert "BloomMLP" in ln and "fits no kind" in ln
    text = render(build_index(_family_model("nemotron")))
    ln = next(x for x in text.splitlines() if x.startswith("model.layers.{0..1}.mlp "))
    assert "NemotronMLP" in ln and " MLP " in ln and "up_proj->down_proj relu2" in ln
    ln = next(x for x in text.splitlines() if x.startswith("model.norm "))
    assert "NemotronLayerNorm1P" in ln and "LayerNorm" in ln and "offset=1" in ln


# ------------------------------------------------------------------ suggest
def _sites(p):
    return {s.path: s.op for s in p.sites if not s.refused}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_suggestion_patches_what_the_shipped_spec_patches(family):
    m = tiny_model(family)
    s = suggest(m)
    got, want = plan(s.text, m), plan(SPEC_OF[family], m)
    assert not got.refused_sites
    assert _sites(got) == _sites(want)
    assert not s.unpatched, s.unpatched
    assert "# not patched" not in s.text


@pytest.mark.parametrize("family,unpatched", [
    ("olmo2", {}),                      # q/k norms over the whole projection: fused_rope calls them so
    ("smollm3", {}),                    # NoPE layers: the rotation only where the model rotates
    ("nemotron", {}),                   # LayerNorm1P: fused_layernorm with offset 1; relu2 MLP: fused_mlp
    ("gpt_neox", {}),                   # query_key_value, dense, partial rotary: fused_rope; MLP: fused_mlp; body gpt_neox: the loss
    ("apertus", {"mlp": "its activation XIELUActivation is none of the activations fused_mlp computes"}),
    ("glm4", {}),                       # interleaved partial rotary: fused_rope
    ("gpt_oss", {"attention": "computes none of the rotary layouts"}),
])
def test_suggestion_lists_each_unpatched_module_with_its_reason(family, unpatched):
    m = _family_model(family)
    s = suggest(m)
    p = plan(s.text, m)
    assert not p.refused_sites
    # every module a spec is written for is patched, fused into a patched site, or listed with a reason
    for path, con in s.concern_of.items():
        assert path in s.patched or path in s.covered or s.unpatched.get(path), path
    for con in CONCERNS:
        whys = [w for q, w in s.unpatched.items() if s.concern_of[q] == con]
        if con in unpatched:
            assert whys and all(unpatched[con] in w for w in whys), (con, whys)
            assert s.counts()[con][0] < s.counts()[con][1]
        else:
            assert not whys, (con, whys)
    if not s.unpatched:
        assert "# not patched" not in s.text
        return
    listed = s.text.split("# not patched:")[1]
    for path in s.unpatched:
        assert path.split(".")[-1] in listed


def test_suggestion_does_not_point_to_an_op_that_refuses_too():
    s = suggest(_family_model("gpt_oss"))
    why = next(w for q, w in s.unpatched.items() if s.concern_of[q] == "attention")
    assert "(use fused_rope)" not in why and why.startswith("fused_rope:")


def test_suggestion_applies_with_nothing_refused_and_undoes():
    from patchdsl.runtime import apply

    m = _family_model("olmo2", meta=False)
    s = suggest(m)
    before = {n: mod.forward for n, mod in m.named_modules()}
    h = apply(plan(s.text, m, dtypes=("fp32",)), m)
    assert not h.refused and len(h.patched) == len(s.patched)
    h.undo()
    assert all(mod.forward == before[n] for n, mod in m.named_modules())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmo2", "nemotron"])
def test_suggestion_verifies(family):
    from patchdsl.model.tiny import build, tiny_family_config
    from patchdsl.parity import verify

    s = suggest(_family_model(family), dtypes=("fp32",))
    cfg = tiny_family_config(family)
    rep = verify(s.text, lambda: build(cfg), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [r.path for r in rep.failures()]


# ------------------------------------------------------------------ CLI
def test_cli_inspect_and_suggest(tmp_path):
    r = CliRunner().invoke(main, ["inspect", "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 0 and "model.layers.{0..27}.mlp" in r.output and "inter=3072" in r.output
    r = CliRunner().invoke(main, ["inspect", "--model", "Qwen/Qwen3-0.6B", "--json"])
    d = json.loads(r.output)
    assert next(x for x in d["modules"] if x["pattern"] == "model.layers.{0..27}.mlp")["count"] == 28
    out = tmp_path / "s.kpatch"
    r = CliRunner().invoke(main, ["suggest", "--model", "Qwen/Qwen3-0.6B", "--out", str(out)])
    assert r.exit_code == 0 and "113/113 norms" in r.output
    r = CliRunner().invoke(main, ["plan", str(out), "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 0, r.output
    assert "28/28 mlp" in r.output and ", 0 refused," in r.output


def test_cli_suggest_on_deepseek_v3_s_default_config_checks_and_verifies(tmp_path):
    """Issue 37/38: ``suggest`` on transformers' default DeepSeek-V3 config (its layers cut to 5: 3 dense, 2
    MoE) writes a spec that checks and plans (it used to fail on a ``*.shared_experts`` selector: the tiny
    model kept only dense layers) and verifies in fp32 on the tiny config, with the sigmoid grouped router
    fused and MLA attention left out with its reason."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v3", num_hidden_layers=5)
    cfg.save_pretrained(tmp_path / "dsv3")
    model = str(tmp_path / "dsv3")
    out = tmp_path / "s.kpatch"
    r = CliRunner().invoke(main, ["suggest", "--model", model, "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "*.gate: Router -> fused_router" in text and "*.experts: Experts -> fused_experts" in text, text
    assert "DeepseekV3Attention): multi-head latent attention: RoPE on a decoupled qk_rope_head_dim" in text, text
    r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["verify", str(out), "--model", model, "--dtype", "fp32"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output[-3000:]
    assert "fused_router" in r.output and "top_k_index" in r.output


def test_cli_suggest_leaves_out_vision_rules_verify_cannot_feed(tmp_path):
    """Issue 38: transformers' default Qwen2-VL config (its vision merger projects to 3584 wide, its language
    model is 8192 wide) runs no image batch; suggest kept the vision tower's rules because its tiny model was
    not tried (the tower's embed_dim was not shrunk), and verify of the suggestion FAILED on vision sites that
    never ran.  Now the rules are left out with the reason, and the language model's are written."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2_vl").save_pretrained(tmp_path / "q")
    out = tmp_path / "s.kpatch"
    r = CliRunner().invoke(main, ["suggest", "--model", str(tmp_path / "q"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    rules = [ln for ln in text.splitlines() if ln and not ln.startswith("#") and ":" in ln]
    assert rules and not any("visual" in ln for ln in rules), rules
    assert "no image batch runs on this model" in text


def test_cli_suggest_bad_model_is_exit_2():
    r = CliRunner().invoke(main, ["suggest", "--model", "no/such-model-here"])
    assert r.exit_code == 2 and "Traceback" not in r.output


# ------------------------------------------------------------------ hints that name the structural reason
@pytest.mark.parametrize("family,rule,want,not_want", [
    ("roberta", "lm_head.decoder: Linear -> fused_linear_cross_entropy",
     "RobertaForCausalLM is not recognised as a causal LM", "select it alone"),
    ("gpt2", "*.attn: Attention -> fused_rope", "GPT2Attention has no q_proj, k_proj, v_proj, o_proj", None),
    ("opt", "*.self_attn: Attention -> fused_rope",
     "OPTAttention has no o_proj, nor a rotary embedding to go with its out_proj", None),
    ("nemotron", "*.mlp: SwiGLU -> fused_swiglu", "those modules are: MLP (ops for them: fused_mlp)", None),
    ("bloom", "*.mlp: MLP -> fused_mlp", "BloomMLP", None),
    ("llama", "*.q_proj: Linear -> fused_linear_cross_entropy", "select it alone: 'lm_head: Linear", None),
])
def test_refusal_hints_name_the_structural_reason(family, rule, want, not_want):
    from patchdsl.syntax import SpecError

    with pytest.raises(SpecError) as ei:
        plan(f"{rule}\n", _family_model(family))
    text = ei.value.render()
    assert want in text, text
    if not_want:
        assert not_want not in text


def test_modules_that_do_not_run_are_left_out_with_the_reason():
    from patchdsl.planning.suggestion import NOT_RUN_REASON, modules_not_run

    m = tiny_model("llama")
    m.model.unused_norm = type(m.model.norm)(64, eps=1e-6)     # never called by the forward
    skip = modules_not_run(m)
    assert "model.unused_norm" in skip and "model.norm" not in skip and "model.layers.0.mlp" not in skip
    s = suggest(m, skip=skip)
    assert "model.unused_norm" not in s.patched and s.unpatched["model.unused_norm"] == NOT_RUN_REASON
    assert "model.norm" in s.patched
    # without skip it is patched like any RMSNorm
    assert "model.unused_norm" in suggest(m).patched


def test_python_api():
    import patchdsl
    import patchdsl.planning.suggestion  # noqa: F401  (importing the module keeps patchdsl.suggest the function)

    m = tiny_model("llama")
    assert callable(patchdsl.suggest) and patchdsl.suggest(m).text == suggest(m).text
    d = patchdsl.inspect_model(m)
    assert any(r["pattern"] == "model.layers.{0..1}.mlp" for r in d["modules"])


# ------------------------------------------------------------------ mixtures of experts
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_suggest_patches_routed_experts_and_the_loss_of_moe_models(family):
    """A sparse MoE block is not an MLP site: its experts module is (fused_experts), and so is its router
    (fused_router); the fused loss takes MoE models (the router's auxiliary loss replayed); the
    suggestion verifies."""
    from patchdsl.parity import verify

    from ..moe_families import tiny_moe_model

    s = suggest(tiny_moe_model(family), dtypes=("fp32",))
    assert "*.mlp.experts: Experts -> fused_experts" in s.text or ".mlp.experts: Experts -> fused_experts" in s.text
    assert ".mlp.gate: Router -> fused_router" in s.text, s.text
    assert s.counts()["mlp"] == (2, 2) and s.counts()["loss"] == (1, 1), s.counts()
    assert not any("mixture" in why for why in s.unpatched.values()), s.unpatched
    rep = verify(s.text, lambda: tiny_moe_model(family), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [r.path for r in rep.failures()]
