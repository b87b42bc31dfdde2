"""Image batches for verify (patchdsl/parity/images.py): a vision-language model's vision tower runs in
verify's forward, so its norms and MLPs can be suggested, patched and judged against float64.

Tiny ``...ForConditionalGeneration`` models built as the census builds them (their special token ids
outside the tiny vocabulary: the recipe moves them in).  Each recipe's batch runs the vision tower
(forward hooks see its norms and MLPs); a wrong token count makes the model's own check fail (the
batch is no guess that happens to pass); the token count missing from a config is read back from the
model's "features / tokens do not match" check; suggest with images keeps the vision tower's rules and
verify of it passes; a family no recipe fits, or a text-only model asked for images, fails cleanly with
its reason.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from click.testing import CliRunner

from patchdsl.parity import VerifyError, verify
from patchdsl.parity.images import image_recipe, plan_recipe

from ..kernels.helpers import tiny_family


def model_of(model_type: str, seed: int = 0):
    return tiny_family(model_type, seed)


def vision_paths(model) -> set[str]:
    from patchdsl.planning.suggestion import vision_modules

    return set(vision_modules(model))


# family -> (layout, how the token count is found)
FAMILIES = {
    "qwen2_5_vl": ("grid", "(2m x 2m patches) / m^2"),
    "qwen3_vl": ("grid", "(2m x 2m patches) / m^2"),
    "gemma3": ("square", "mm_tokens_per_image"),
    "llava": ("square", "(image_size / patch_size)^2"),
    "paligemma": ("square", "(image_size / patch_size)^2"),
    "aya_vision": ("square", "read from the model's features / tokens check"),     # a pixel shuffle
    "glm4v": ("grid", "(2m x 2m patches) / m^2"),
    "idefics3": ("square", "(image_size / patch_size / scale_factor)^2"),     # [B, 1, C, S, S] + pixel mask
    "mistral3": ("square", "read from the model's features / tokens check"),     # "features" = values / hidden
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_image_batch_runs_the_vision_tower(family):
    m = model_of(family)
    m.train()
    r, why = image_recipe(m)
    assert r is not None, why
    assert (r.layout, r.how) == FAMILIES[family]
    vocab = m.get_input_embeddings().num_embeddings
    assert all(0 <= t < vocab for t in r.specials())             # moved into the tiny vocabulary
    ran = set()
    vis = vision_paths(m)
    hooks = [mod.register_forward_pre_hook(lambda _m, _a, _n=n: ran.add(_n)) for n, mod in m.named_modules()
             if n in vis]
    b = r.batch(torch.Generator().manual_seed(1), 2, 8)
    assert (b["labels"][b["input_ids"] == r.token] == -100).all()
    assert int((b["input_ids"] == r.token).sum()) == 2 * r.per_image
    out = m(**b)
    for h in hooks:
        h.remove()
    assert torch.isfinite(out.loss)
    kinds = {type(mod).__name__ for n, mod in m.named_modules() if n in ran}
    assert any("Norm" in k for k in kinds), kinds
    assert any("MLP" in k or "Mlp" in k for k in kinds), kinds
    # one image token too many: the model's own check refuses the batch (the count is no lucky guess)
    bad = copy.copy(r)
    bad.per_image += 1
    # (transformers 5.17's Idefics3 says it through masked_scatter: "Number of elements of source < ...")
    with pytest.raises(Exception, match=r"(?i)tokens|features|size|shape|number of elements"):
        m(**bad.batch(torch.Generator().manual_seed(1), 2, 8))


# the vision towers' norms and MLPs (what suggest --images adds), verified alone: fewer sites, a quick check
VISION_RULES = {
    "qwen2_5_vl": "model.visual.blocks.*.{norm1,norm2}, model.visual.merger.ln_q: RMSNorm -> fused_rmsnorm\n"
                  "model.visual.blocks.*.mlp: SwiGLU -> fused_swiglu\n",
    "gemma3": "model.vision_tower.{*.layer_norm1,*.layer_norm2,post_layernorm}: LayerNorm -> fused_layernorm\n"
              "model.vision_tower.*.mlp: MLP -> fused_mlp\n"
              "model.multi_modal_projector.mm_soft_emb_norm: RMSNorm -> fused_rmsnorm\n",
    "paligemma": "model.vision_tower.{*.layer_norm1,*.layer_norm2,post_layernorm}: LayerNorm -> fused_layernorm\n"
                 "model.vision_tower.*.mlp: MLP -> fused_mlp\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(VISION_RULES))
def test_verify_judges_the_vision_towers_norms_and_mlps(family):
    rep = verify("dtype fp32\n" + VISION_RULES[family], lambda: model_of(family), dtype="fp32", batch=1, seq=8,
                 device="cpu")
    assert rep.passed, [(x.path, x.quantity, x.note) for x in rep.failures()][:5]
    assert rep.images["fed"], rep.images
    ops = {x.op for x in rep.rows if x.kind == "site" and x.passed and x.quantity == "output"}
    assert "fused_mlp" in ops or "fused_swiglu" in ops, ops
    assert ops & {"fused_layernorm", "fused_rmsnorm"}, ops
    assert not rep.failures()


@pytest.mark.slow
def test_suggest_with_images_patches_the_vision_tower_and_verifies():
    from patchdsl.planning.suggestion import VISION_REASON, suggest

    m = model_of("llava")
    r, why = image_recipe(m)
    assert r is not None, why
    s = suggest(m, dtypes=("fp32",), images=True)
    assert VISION_REASON not in s.text
    assert "model.vision_tower.encoder.layers.0.mlp: MLP -> fused_mlp" in s.text
    vis = vision_paths(m)
    assert len([p for p in s.patched if p in vis]) == 5, s.patched      # 4 LayerNorms, 1 MLP
    rep = verify(s.text, lambda: model_of("llava"), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [(x.path, x.quantity, x.note) for x in rep.failures()][:5]
    assert rep.images["fed"] and rep.images["image_tokens"] == r.per_image
    judged = {x.path for x in rep.rows if x.kind == "site" and x.passed}
    assert len(judged & vis) == 5, judged


def test_suggest_without_images_leaves_the_tower_out_with_the_reason():
    from patchdsl.planning.suggestion import VISION_REASON, suggest

    m = model_of("llava_next")
    r, why = image_recipe(m)
    assert r is None
    s = suggest(m, dtypes=("fp32",), images=why)
    assert "no image batch runs on this model: with image_sizes: RuntimeError" in s.text and VISION_REASON not in s.text
    assert not set(s.patched) & vision_paths(m)
    s = suggest(m, dtypes=("fp32",))
    assert VISION_REASON in s.text


# ---- what must fail, with its reason -----------------------------------------------------------

def test_a_family_no_recipe_fits_gives_its_reason():
    """LlavaNext tiles an image into a resolution-dependent number of crops (image_grid_pinpoints): a
    square image batch does not run, and that is the reason given: verify(images=True) fails with it,
    verify's default falls back to text and says so."""
    m = model_of("llava_next")
    r, why = image_recipe(m)
    assert r is None and "with image_sizes: RuntimeError" in why and "an image batch built from its config" in why
    spec = "*.language_model.norm: RMSNorm -> fused_rmsnorm\n"
    with pytest.raises(VerifyError, match=r"cannot feed images to LlavaNextForConditionalGeneration: with image_sizes: RuntimeError"):
        verify(spec, lambda: model_of("llava_next"), dtype="fp32", batch=1, seq=8, device="cpu", images=True)
    rep = verify(spec, lambda: model_of("llava_next"), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed and not rep.images["fed"] and "RuntimeError" in rep.images["reason"]
    assert "images: none fed, text only" in "\n".join(rep.plain_lines())


@pytest.mark.parametrize("edit,reason", [
    (lambda c: setattr(c, "vision_config", None), r"no vision_config"),
    (lambda c: setattr(c, "image_token_id", None), r"names no image placeholder token"),
    (lambda c: setattr(c.vision_config, "image_size", None), r"states no image_size"),
])
def test_a_config_without_what_a_recipe_needs_is_refused_by_name(edit, reason):
    m = model_of("llava")
    edit(m.config)
    r, why = plan_recipe(m)
    assert r is None and re.search(reason, why), why


def test_images_asked_of_a_text_only_model_exits_2(tmp_path):
    import json

    from patchdsl.cli import main
    from tests.families import tiny_config

    p = tmp_path / "llama.json"
    p.write_text(json.dumps(tiny_config("llama").to_dict()))
    r = CliRunner().invoke(main, ["verify", "qwen3", "--model", str(p), "--images", "--seq", "4", "--batch", "1"])
    assert r.exit_code == 2, (r.output, r.exception)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    assert "not a vision-language model" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("family,extra,included", [
    ("llava", [], True),                   # an image batch runs: the vision tower's rules are kept
    ("llava", ["--text-only"], False),
    ("llava_next", [], False),             # none runs: left out, with the reason
    ("llava_next", ["--images"], True),    # insisted on
])
def test_cli_suggest_keeps_the_vision_tower_where_verify_can_feed_it(family, extra, included, tmp_path):
    from patchdsl.model.tiny import tiny_family_config
    from patchdsl.cli import main
    from patchdsl.planning.suggestion import VISION_REASON

    p = tmp_path / "config.json"
    tiny_family_config(family).to_json_file(str(p))
    r = CliRunner().invoke(main, ["suggest", "--model", str(p), *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    rules = [ln for ln in r.output.splitlines() if "->" in ln and not ln.startswith("#")]
    assert any("model.vision_tower." in ln for ln in rules) == included, r.output
    if not included:
        why = VISION_REASON if "--text-only" in extra else "no image batch runs on this model: with image_sizes"
        assert why in r.output, r.output


def test_cli_suggest_images_on_a_text_only_model_exits_2(tmp_path):
    import json

    from patchdsl.cli import main
    from tests.families import tiny_config

    p = tmp_path / "llama.json"
    p.write_text(json.dumps(tiny_config("llama").to_dict()))
    r = CliRunner().invoke(main, ["suggest", "--model", str(p), "--images"])
    assert r.exit_code == 2 and "not a vision-language model" in r.output, (r.output, r.exception)
