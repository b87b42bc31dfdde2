"""Vision-language models (issue 25, deliverable 3): the shipped multimodal specs on tiny
Qwen2.5-VL / Qwen3-VL / Gemma 3 ``...ForConditionalGeneration`` models (random weights, fp32, CPU).

Each spec plans with nothing refused and verifies against float64 (text-only batches, as
``patchdsl verify`` runs); the patched model's loss and every parameter gradient match the
unpatched model's on text and on text + one image (the vision tower runs inside the body the fused
loss calls); the body receives exactly the arguments HF's forward gives it (Gemma 3's labels); the
vision towers' norms and MLPs patched with the existing ops match on an image batch; what cannot
fit is refused with its reason.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

from patchdsl.model.forward import causal_lm
from patchdsl.parity import verify
from patchdsl.planning.planner import plan
from patchdsl.util.resources import shipped_spec
from patchdsl.runtime import PatchError, apply, patch_module
from patchdsl.syntax import load_spec

# shipped spec -> model type of the multimodal model it is for
VLM_SPECS = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "gemma3": "gemma3"}
FLCE = "fused_linear_cross_entropy"
IMAGE, VIDEO, START, END, BOI, EOI = 500, 501, 502, 503, 504, 505     # special ids moved inside the tiny vocabulary


def vlm_model(model_type: str, seed: int = 0):
    """A tiny ``...ForConditionalGeneration`` of ``model_type`` (census shrink), fp32, its image
    tokens inside the tiny vocabulary so that image batches can be built."""
    from patchdsl.model.tiny import build, tiny_family_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            cfg = tiny_family_config(model_type)
            for k, v in (("image_token_id", IMAGE), ("image_token_index", IMAGE), ("video_token_id", VIDEO),
                         ("vision_start_token_id", START), ("vision_end_token_id", END),
                         ("boi_token_index", BOI), ("eoi_token_index", EOI)):
                if hasattr(cfg, k):
                    setattr(cfg, k, v)
            return build(cfg, seed=seed)
        finally:
            logging.disable(logging.NOTSET)


def text_batch(seed: int = 0, n: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 400, (2, n), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def image_batch(model, seed: int = 0) -> dict:
    """One image and some text, built as the model's processor lays them out (image tokens masked
    out of the labels, as the processors' collators do)."""
    g = torch.Generator().manual_seed(seed)
    c, vc = model.config, model.config.vision_config
    if hasattr(vc, "spatial_merge_size"):                  # Qwen2/2.5/3-VL: flattened patches + a grid
        ps, tp, ms = vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size
        thw = torch.tensor([[1, 4, 4]])
        n = int(thw.prod())
        pv = torch.randn(n, vc.in_channels * tp * ps * ps, generator=g)
        img = [START] + [IMAGE] * (n // (ms * ms)) + [END]
        ids = torch.cat([torch.randint(0, 400, (1, 3), generator=g), torch.tensor([img]),
                         torch.randint(0, 400, (1, 5), generator=g)], 1)
        extra = {"pixel_values": pv, "image_grid_thw": thw, "mm_token_type_ids": (ids == IMAGE).int()}
    else:                                                  # Gemma 3: an image, mm_tokens_per_image tokens
        pv = torch.randn(1, 3, vc.image_size, vc.image_size, generator=g)
        img = [BOI] + [IMAGE] * c.mm_tokens_per_image + [EOI]
        ids = torch.cat([torch.randint(0, 400, (1, 3), generator=g), torch.tensor([img]),
                         torch.randint(0, 400, (1, 5), generator=g)], 1)
        extra = {"pixel_values": pv, "token_type_ids": (ids == IMAGE).long()}
    labels = ids.masked_fill((ids == IMAGE) | (ids == START) | (ids == END) | (ids == BOI) | (ids == EOI), -100)
    return {"input_ids": ids, "labels": labels, **extra}


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(ref, pat, b, rtol=1e-4, atol=1e-6):
    ref.train(), pat.train()
    r, p = ref(**b), pat(**b)
    assert p.logits is None, "the fused loss did not take the call"
    torch.testing.assert_close(p.loss, r.loss, rtol=rtol, atol=atol)
    r.loss.backward()
    p.loss.backward()
    gr, gp = grads(ref), grads(pat)
    assert gr.keys() == gp.keys()
    for n in gr:
        # relative to the tensor's scale: random Gemma 3 image projections have gradients of 1e7
        err, scale = (gp[n] - gr[n]).abs().max().item(), gr[n].abs().max().item()
        assert err <= 2e-4 * scale + 1e-6, (n, err, scale)
    return gr


@pytest.mark.parametrize("spec", sorted(VLM_SPECS))
def test_multimodal_spec_plans_every_rule_on_the_language_tower(spec):
    sp = load_spec(shipped_spec(spec))
    p = plan(sp, vlm_model(VLM_SPECS[spec]))
    assert not p.refused_sites, [(s.path, s.refused) for s in p.refused_sites]
    assert {s.op for s in p.sites} == {r.op.name for r in sp.rules}
    assert any(s.path == "lm_head" and s.op == FLCE for s in p.sites)
    assert all(s.path == "lm_head" or ".language_model." in s.path for s in p.sites), \
        [s.path for s in p.sites if ".language_model." not in s.path]


# the multimodal specs verified in fp32, bf16 and fp16: the spec x dtype table, tests/planning/test_shipped_specs.py


@pytest.mark.slow
def test_suggest_on_a_vision_language_model_verifies():
    """``patchdsl suggest`` patches the language tower (M-RoPE attention included), the LM head and
    loss, lists the vision tower with its reason, and its spec verifies."""
    from patchdsl.planning.suggestion import VISION_REASON, suggest

    m = vlm_model("qwen2_5_vl")
    s = suggest(m, dtypes=("fp32",))
    assert "*.self_attn: Attention -> fused_rope" in s.text and "lm_head: Linear -> fused_linear_cross_entropy" in s.text
    assert "model.visual.blocks.0.mlp (Qwen2_5_VLMLP): " + VISION_REASON in s.text
    rep = verify(s.text, lambda: vlm_model("qwen2_5_vl"), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [(r.path, r.quantity) for r in rep.failures()][:5]


@pytest.mark.parametrize("inputs", ["text", "image"])
@pytest.mark.parametrize("spec", sorted(VLM_SPECS))
def test_patched_loss_and_grads_match_hf(spec, inputs):
    ref = vlm_model(VLM_SPECS[spec])
    pat = copy.deepcopy(ref)
    h = apply(plan(load_spec(shipped_spec(spec)), pat), pat, strict=True)
    assert "lm_head" in h.patched
    b = text_batch(seed=3) if inputs == "text" else image_batch(ref, seed=3)
    g = assert_same_step(ref, pat, b)
    if inputs == "image":      # the vision tower ran inside the body the fused loss called
        assert any(n.startswith(("model.visual.", "model.vision_tower.")) for n in g)


@pytest.mark.parametrize("spec", sorted(VLM_SPECS))
def test_fused_loss_label_handling(spec):
    """num_items_in_batch (sum / n) and shift_labels (used as given), as the model's own loss does."""
    ref = vlm_model(VLM_SPECS[spec])
    pat = copy.deepcopy(ref)
    patch_module(pat, FLCE)
    b = text_batch(seed=5)
    assert_same_step(ref, pat, {**b, "num_items_in_batch": torch.tensor(11)})
    shift = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    ref.zero_grad(), pat.zero_grad()
    assert_same_step(ref, pat, {**b, "shift_labels": shift})


@pytest.mark.parametrize("spec", sorted(VLM_SPECS))
def test_the_body_gets_what_the_models_forward_gives_it(spec):
    """The fused forward calls ``self.model`` with the arguments HF's forward passes (Gemma 3 passes its
    labels, which it reads for the image tokens' attention mask, and return_dict=True)."""
    ref = vlm_model(VLM_SPECS[spec])
    pat = copy.deepcopy(ref)
    patch_module(pat, FLCE)
    seen = []
    for m in (ref, pat):
        def spy(module, args, kwargs):
            seen.append({k: (v if k in ("labels", "return_dict") else None) for k, v in kwargs.items()})
        m.model.register_forward_pre_hook(spy, with_kwargs=True)
    b = image_batch(ref, seed=7)
    ref.train(), pat.train()
    ref(**b), pat(**b)
    assert seen[0].keys() == seen[1].keys()
    if "labels" in seen[0]:
        assert torch.equal(seen[1]["labels"], b["labels"])
    assert seen[0].get("return_dict") == seen[1].get("return_dict")


# the vision towers' norms and MLPs that existing ops fit; they run only on an image batch
VISION_RULES = {
    "qwen2_5_vl": "model.visual.blocks.*.{norm1,norm2}, model.visual.merger.ln_q: RMSNorm -> fused_rmsnorm\n"
                  "model.visual.blocks.*.mlp: SwiGLU -> fused_swiglu\n",
    "qwen3_vl": "model.visual.blocks.*.{norm1,norm2}, model.visual.{merger,deepstack_merger_list.*}.norm: "
                "LayerNorm -> fused_layernorm\n",
    "gemma3": "model.vision_tower.{*.layer_norm1,*.layer_norm2,post_layernorm}: LayerNorm -> fused_layernorm\n"
              "model.multi_modal_projector.mm_soft_emb_norm: RMSNorm -> fused_rmsnorm\n",
}


@pytest.mark.parametrize("spec", sorted(VISION_RULES))
def test_vision_tower_norms_and_mlps_on_an_image_batch(spec):
    ref = vlm_model(VLM_SPECS[spec])
    pat = copy.deepcopy(ref)
    text = shipped_spec(spec).read_text() + VISION_RULES[spec]
    p = plan(text, pat)
    assert not p.refused_sites, [(s.path, s.refused) for s in p.refused_sites]
    h = apply(p, pat, strict=True)
    vision = [s for s in h.patched if s.startswith(("model.visual.", "model.vision_tower."))]
    assert vision, h.patched
    b = image_batch(ref, seed=9)
    assert_same_step(ref, pat, b)


# ---- what must fail, with its reason -----------------------------------------------------------

def test_a_text_config_vocab_size_other_than_the_lm_heads_is_refused():
    m = vlm_model("qwen3_vl")
    m.config.text_config.vocab_size = 777
    causal_lm._SHAPES.clear()
    with pytest.raises(PatchError, match=r"vocab_size=config\.text_config\.vocab_size = 777.*lm_head has 512"):
        patch_module(m, FLCE)
    assert causal_lm.read_value(m, "self.config.get_text_config().vocab_size") == 777


_VARIANT = """
import torch
from transformers import Qwen3VLForConditionalGeneration
from transformers.modeling_outputs import CausalLMOutputWithPast


class Variant(Qwen3VLForConditionalGeneration):
    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, {body}**kwargs)
        hidden_states = outputs[0]
        logits = self.lm_head(hidden_states)
        {head}
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size={vocab}, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
"""

V = "self.config.text_config.vocab_size"
# (what the forward passes its body, the vocab_size it gives its loss, a step on the logits) -> None
# (reproduced) or the refusal
VARIANTS = {
    ("", V, "pass"): None,
    ("return_dict=True, ", "self.config.get_text_config().vocab_size", "pass"): None,
    ("labels=labels, ", V, "pass"): None,
    ("", V, "logits = logits * self.config.text_config.logits_scaling"): None,      # HyperCLOVAX vision's
    ("", "self.config.text_config.image_size", "pass"): r"reads config\.text_config\.image_size",
    ("", "self.config.vision_config.hidden_size", "pass"): r"reads config\.vision_config",
    ("output_attentions=True, ", V, "pass"): r"passes output_attentions=True",
    ("", V, "logits = logits * self.config.text_config.initializer_range"): r"reads config\.text_config\.initializer_range",
}


@pytest.mark.parametrize("body,vocab,head", list(VARIANTS))
def test_a_vision_language_forward_is_reproduced_or_refused_by_name(body, vocab, head, tmp_path, monkeypatch):
    import importlib.util
    import sys

    path = tmp_path / "vlm_variant.py"
    path.write_text(_VARIANT.format(body=body, vocab=vocab, head=head))
    spec = importlib.util.spec_from_file_location(f"vlm_variant_{abs(hash((body, vocab, head)))}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    base = vlm_model("qwen3_vl")
    base.config.text_config.logits_scaling = 0.25
    ref = mod.Variant(base.config)
    ref.load_state_dict(base.state_dict())
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)           # logits of tens: a scaling moves the loss
    causal_lm._SHAPES.clear()
    expected = VARIANTS[(body, vocab, head)]
    pat = copy.deepcopy(ref)
    if expected is not None:
        with pytest.raises(PatchError, match=expected):
            patch_module(pat, FLCE)
        return
    patch_module(pat, FLCE)
    assert_same_step(ref, pat, text_batch(seed=11))


def test_vision_attention_is_refused_with_its_reason():
    """Qwen2.5-VL's vision attention (one fused qkv, 2-D rotary over patches, no causal mask) is no
    decoder attention: the rule is an error naming the structure it lacks."""
    from patchdsl.syntax.errors import SpecError

    m = vlm_model("qwen2_5_vl")
    with pytest.raises(SpecError, match=r"Qwen2_5_VLVisionAttention \(children: qkv, proj\) fits no Attention"):
        plan("model.visual.blocks.*.attn: Attention -> fused_rope", m)


def test_a_vision_rule_on_a_text_only_verify_is_not_judged_a_pass():
    """Vision-tower sites do not run on a text-only batch (``verify --text-only``; by default verify feeds
    a vision-language model an image batch, tests/model_families/test_vision_language_images.py): verify fails them, saying why,
    rather than passing what it did not see."""
    rep = verify(shipped_spec("qwen3_vl").read_text() + VISION_RULES["qwen3_vl"], lambda: vlm_model("qwen3_vl"),
                 dtype="fp32", batch=1, seq=8, device="cpu", images=False)
    assert not rep.passed
    bad = {r.path: r.note for r in rep.failures()}
    assert set(bad) >= {"model.visual.blocks.0.norm1", "model.visual.blocks.0.norm2"}
    assert "did not run" in bad["model.visual.blocks.0.norm1"] and "text only asked" in bad["model.visual.blocks.0.norm1"]


def test_paligemma_softcap_read_from_the_text_config_is_reproduced():
    """PaliGemma (transformers 5.24) softcaps its logits by ``getattr(self.config.get_text_config(),
    'final_logit_softcapping', None)``: the fused loss reads the same value (5.17's forward applies none,
    and neither does the fused loss there: the steps come from the forward's source)."""
    from patchdsl.model.tiny import build, tiny_family_config

    cfg = tiny_family_config("paligemma")
    cfg.text_config.final_logit_softcapping = 2.0
    ref = build(cfg)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)           # logits of tens: the cap moves the loss
    pat = copy.deepcopy(ref)
    causal_lm._SHAPES.clear()
    patch_module(pat, FLCE)
    applies = causal_lm.forward_shape(type(ref)).applies_softcap
    assert applies == ("get_text_config" in __import__("inspect").getsource(type(ref).forward))
    assert_same_step(ref, pat, text_batch(seed=13))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llava", "paligemma", "mllama"])
def test_other_vision_language_models_language_tower_and_loss(model_type):
    """Llava, PaliGemma and Mllama (no shipped spec): ``suggest`` on the ...ForConditionalGeneration
    patches every norm, MLP and attention of the language tower (Mllama's tiny config has no
    cross-attention layer) and the loss, and the suggestion verifies."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from patchdsl.model.shrink import shrink_composite
    from patchdsl.model.loading import tiny_config
    from patchdsl.planning.suggestion import modules_not_run, suggest

    cfg = shrink_composite(AutoConfig.for_model(model_type), tiny_config)
    cfg._attn_implementation = "eager"

    def make():
        torch.manual_seed(0)
        return AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager")

    m = make()
    assert type(m).__name__.endswith("ForConditionalGeneration")
    s = suggest(m, dtypes=("fp32",), skip=modules_not_run(m))
    counts = s.counts()
    text = {k: counts[k] for k in ("attention", "loss")}
    assert text["loss"] == (1, 1) and text["attention"][0] == len(m.model.language_model.layers), counts
    rep = verify(s.text, make, dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [(r.path, r.quantity) for r in rep.failures()][:5]
