"""Liger-Kernel's own families (issue 38): for every model type Liger-Kernel 0.8.5 has an
``apply_liger_kernel_to_*`` function for, ``patchdsl suggest`` on transformers' default config of that
family writes a spec that patches at least what Liger patches there, and that spec verifies in fp32 and
bf16 on the family's tiny config.

What Liger patches is not a second table here: it is :mod:`patchdsl.interop.liger`'s translation of
``use_liger_kernel`` with no config (Liger's defaults for the model type, a vision-language model's
language model as Liger patches it), planned on the same model: every module that translation selects
in the language tower and LM head (refused or not) must be patched by the suggestion, or be a located
refusal listed in KNOWN_GAPS with its reason.  A vision-language model is judged on its language model
(the suggestion is written with ``--text-only``; its vision tower is covered by the census and
tests/model_families/test_vision_language*.py).

Cheap on purpose: the default config is built on the meta device (no memory; the index probes each
distinct module once), the tiny model once per family and shared by both dtypes' verify (batch 1 x 8).
"""

from __future__ import annotations

import pytest
import torch

from patchdsl.interop.liger import liger_model_types, text_model_type_of, translate_liger
from patchdsl.model.index import build_index
from patchdsl.planning.planner import plan
from patchdsl.planning.suggestion import suggest, vision_modules
from patchdsl.syntax import parse_spec

# model types Liger has a function for that are judged as part of another (no model class of their own)
JUDGED_AS = {"qwen2_vl_text": "qwen2_vl", "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_vl_text": "qwen3_vl",
             "qwen3_vl_moe_text": "qwen3_vl_moe", "mllama_text_model": "mllama",
             "pixtral": "llava (Pixtral is a vision encoder; Liger patches it as a Llava tower's)"}

# Modules Liger patches that patchdsl refuses, with the reason the suggestion must give (a located refusal,
# never a silent skip): {model type: {leaf of the module path: reason fragment}}
KNOWN_GAPS: dict[str, dict[str, str]] = {
    # transformers' default DeepSeek-V2 config routes no experts (num_experts_per_tok None)
    "deepseek_v2": {"experts": "its top-k is not known"},
    # the causal LM hands logits_to_keep to its model, which may slice the hidden states itself
    "gemma4": {"lm_head": "does not pass its arguments through to self.model unchanged (logits_to_keep)"},
    "gemma4_text": {"lm_head": "does not pass its arguments through to self.model unchanged (logits_to_keep)"},
    # gpt-oss rotates halves with half-width cos/sin tables (no layout fused_rope has yet)
    "gpt_oss": {"self_attn": "computes none of the rotary layouts"},
    # Llama 4 rotates q and k as complex numbers (apply_rotary_emb on freqs_cis)
    "llama4": {"self_attn": "applies its rotary embedding with apply_rotary_emb(...)"},
    "llama4_text": {"self_attn": "applies its rotary embedding with apply_rotary_emb(...)"},
    # Mllama's cross-attention layers run only with image states (skipped on text)
    "mllama": {"cross_attn": "part of a cross-attention block", "q_norm": "part of a cross-attention block",
               "k_norm": "part of a cross-attention block"},
    # MuSE-Glimmer scales its logits by text_config.output_multiplier
    "muse_glimmer": {"lm_head": "output_multiplier, which the fused loss does not reproduce"},
}


def _installed(model_type: str) -> str | None:
    """Why the installed transformers cannot judge ``model_type`` (None: it can)."""
    import transformers
    from transformers.models.auto import modeling_auto as ma
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in JUDGED_AS:
        return f"judged as {JUDGED_AS[model_type]}"
    if model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} has no model type {model_type}"
    if (model_type not in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})):
        return f"transformers {transformers.__version__} has no causal-LM or image-text-to-text class for {model_type}"
    return None


_DONE: dict[str, tuple] = {}


def _judged(model_type: str, tmp_path_factory) -> tuple:
    """(meta model of the default config, its suggestion, Liger's modules in the language model) - once."""
    if model_type in _DONE:
        return _DONE[model_type]
    from transformers import AutoConfig

    from patchdsl.model import load_model
    from patchdsl.model.tiny import quiet

    folder = tmp_path_factory.mktemp(model_type)
    with quiet():
        AutoConfig.for_model(model_type).save_pretrained(folder)
        model = load_model(str(folder), meta=True, log=None).model    # as `patchdsl suggest --model FOLDER`
        s = suggest(model, name=model_type, images=False)
    index = build_index(model)
    t = translate_liger(None, index, text_model_type=text_model_type_of(model))
    outside = vision_modules(model)
    sites = {p: op for p, op in _liger_sites(t.rules, index).items() if p not in outside}
    _DONE[model_type] = (model, s, t, sites, folder)
    return _DONE[model_type]


def _liger_sites(rules, index) -> dict[str, str]:
    """The modules the Liger translation's rules select (path -> op), refused or not: each rule planned
    alone on the index; a rule the planner rejects as a whole (DeepSeek-V2's default config names no top-k,
    so its experts fit no Experts kind) selects the modules of its kind its selectors match."""
    from patchdsl.syntax import SpecError
    from patchdsl.syntax.selectors import compile_selector

    out: dict[str, str] = {}
    for _key, rule in rules:
        try:
            out.update({x.path: x.op for x in plan(parse_spec(rule + "\n", "<liger>"), index).sites})
        except SpecError:
            sels, _, rest = rule.partition(": ")
            kind, op = (x.strip() for x in rest.split("->"))
            rxs = [compile_selector(x.strip()) for x in sels.split(",")]
            out.update({i.path: op.split("(")[0] for i in index if i.path and kind in i.kinds
                        and any(rx.match(i.path) for rx in rxs)})
    return out


@pytest.mark.parametrize("model_type", liger_model_types())
def test_suggestion_patches_what_liger_patches(model_type, tmp_path_factory):
    why = _installed(model_type)
    if why:
        pytest.skip(why)
    model, s, t, liger_sites, _ = _judged(model_type, tmp_path_factory)
    assert not t.problems, t.problems           # every key Liger turns on fits modules patchdsl recognises
    assert liger_sites, "Liger patches nothing patchdsl can see"
    known = KNOWN_GAPS.get(model_type, {})
    done = set(s.patched) | set(s.covered)
    missing = {p: s.unpatched.get(p, "not considered by suggest") for p in liger_sites if p not in done}
    unexpected = {p: w for p, w in missing.items() if p.rsplit(".", 1)[-1] not in known}
    assert not unexpected, {p: (liger_sites[p], w) for p, w in list(unexpected.items())[:6]}
    for p, w in missing.items():
        assert known[p.rsplit(".", 1)[-1]] in w, (p, w)


_TINY: dict[str, object] = {}
# verify cases open with their finding (xfail, not strict: they pass where the rounding falls the other way)
OPEN = {("deepseek_v4", "fp32"): "DeepSeek-V4's hc_head.hc_scale gradient is 1.4x over the fp32 tolerance with one "
                                 "CPU thread (1.7e-5 vs 1.2e-5; passes with several): not yet traced to a site"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model_type", liger_model_types())
def test_suggestion_for_a_liger_family_verifies(model_type, dtype, tmp_path_factory, request):
    """The spec written from the default config verifies on the family's tiny config (text only, as Liger's
    language model): one tiny model per family, deep-copied by verify for each dtype."""
    from patchdsl.model.tiny import build, quiet, tiny_family_config
    from patchdsl.parity import verify

    why = _installed(model_type)
    if why:
        pytest.skip(why)
    if (model_type, dtype) in OPEN:
        request.applymarker(pytest.mark.xfail(reason=OPEN[model_type, dtype], strict=False))
    _, s, _, _, _ = _judged(model_type, tmp_path_factory)
    with quiet():
        if model_type not in _TINY:
            _TINY[model_type] = build(tiny_family_config(model_type))
        rep = verify(s.text, _TINY[model_type], dtype=dtype, batch=1, seq=8, seed=0, device="cpu", images=False,
                     layers=1)          # one decoder layer of each layer type: half the interpreter time
    assert rep.passed, [(r.path, r.op, r.quantity, r.rel_fro_err, r.tolerance) for r in rep.failures()][:6]
    assert not rep.refused_required, rep.refused_required[:3]
    assert rep.sites, "nothing of the suggestion was patched on the tiny model"


def test_a_vision_language_moe_s_router_loss_is_replayed_by_the_fused_loss():
    """Qwen3-VL-MoE and GLM-4.5V read output_router_logits, the experts' counts and router_aux_loss_coef from
    their text config (issue 38: "no loss"): the fused loss replays that, and verify (the router loss on)
    passes."""
    from patchdsl.model.tiny import build, quiet, tiny_family_config
    from patchdsl.parity import verify

    if _installed("qwen3_vl_moe"):
        pytest.skip(_installed("qwen3_vl_moe"))
    with quiet():
        cfg = tiny_family_config("qwen3_vl_moe")
        cfg.text_config.output_router_logits = True
        model = build(cfg)
        s = suggest(model, images=False)
        assert s.patched.get("lm_head") == "fused_linear_cross_entropy", s.unpatched.get("lm_head")
        rep = verify(s.text, model, dtype="fp32", batch=1, seq=8, seed=0, device="cpu", images=False)
    assert rep.passed, [(r.path, r.op, r.quantity, r.rel_fro_err, r.tolerance) for r in rep.failures()][:6]
