"""Attention variants fused_rope / fused_qk_norm_rope patch beyond the Llama shape, each judged
against float64 by verify (the patched fp32 model must be as close to the float64 model as HF's):

* q/k norms over the whole projection (OLMo 2/3): q_norm(q_proj(x)) before the heads are split;
* a forward that also takes ``position_ids`` (Ministral 3);
* per-layer NoPE: SmolLM3 (``if self.use_rope``), Exaone 4 (``if self.sliding_window is None or
  self.is_sliding``, with per-head q/k norms: fused_qk_norm_rope), Granite SWA (``if
  position_embeddings is not None``).
"""

from __future__ import annotations

import dataclasses
import logging
import types
import warnings

import pytest
import torch

from patchdsl.model.forward.attention import analyse
from patchdsl.ops.attention_forward import build_forward
from patchdsl.model.reference import reference_rope
from patchdsl.parity import verify
from patchdsl.planning.planner import plan


def _cfg(model_type):
    from patchdsl.model.tiny import tiny_family_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return tiny_family_config(model_type)
        finally:
            logging.disable(logging.NOTSET)


def _model(model_type, seed=0):
    from patchdsl.model.tiny import build

    cfg = _cfg(model_type)
    if model_type == "smollm3":
        cfg.no_rope_layers = [1, 0]     # the tiny config keeps layers 0 and 1, which both rotate by default
    return build(cfg, seed)


CASES = [
    ("olmo2", "fused_rope", "projection q/k norms"),
    ("ministral3", "fused_rope", "a forward that takes position_ids (query scaling by position)"),
    ("smollm3", "fused_rope", "NoPE layers (use_rope)"),
    ("exaone4", "fused_qk_norm_rope", "NoPE layers (sliding_window / is_sliding) with per-head q/k norms"),
    ("granite_swa", "fused_rope", "rotation under 'if position_embeddings is not None'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,op,what", CASES, ids=[c[0] for c in CASES])
def test_variant_is_patched_and_matches_float64(model_type, op, what):
    spec = f"dtype fp32\n*.self_attn: Attention -> {op}\n"
    m = _model(model_type)
    p = plan(spec, m)
    assert p.sites and not p.refused_sites, [(s.path, s.refused) for s in p.refused_sites]
    rep = verify(spec, lambda: _model(model_type), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [(r.path, r.quantity) for r in rep.failures()][:5]


def test_nope_layers_exist_in_the_tiny_configs():
    """The NoPE cases above are only meaningful with a layer that does not rotate and one that does."""
    m = _model("smollm3")
    assert {bool(layer.self_attn.use_rope) for layer in m.model.layers} == {True, False}
    m = _model("exaone4")
    an = analyse(type(m.model.layers[0].self_attn))
    assert {bool(an.rope_cond(layer.self_attn, {})) for layer in m.model.layers} == {True, False}


def _attn_io(attn, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, attn.config.hidden_size, generator=g)
    ang = torch.randn(1, 5, attn.head_dim, generator=g)
    return x, (ang.cos(), ang.sin())


def test_ignoring_the_rope_condition_would_be_wrong():
    """A case that must fail: on a SmolLM3 NoPE layer, rotating anyway (the condition dropped) differs from
    HF, while the analysed replacement matches it."""
    m = _model("smollm3")
    attn = next(layer.self_attn for layer in m.model.layers if not layer.self_attn.use_rope)
    an = analyse(type(attn))
    assert an.rope_cond is not None and "use_rope" in an.rope_cond_text
    x, pe = _attn_io(attn)
    kw = dict(position_embeddings=pe, attention_mask=None, cache=None)
    with torch.no_grad():
        ref = type(attn).forward(attn, x, **kw)[0]
        good = types.MethodType(build_forward(an, lambda s, q, k, c, si: reference_rope(q, k, c, si)), attn)(x, **kw)[0]
        always = dataclasses.replace(an, rope_cond=None)
        bad = types.MethodType(build_forward(always, lambda s, q, k, c, si: reference_rope(q, k, c, si)), attn)(x, **kw)[0]
    assert torch.allclose(good, ref, atol=1e-6)
    assert not torch.allclose(bad, ref, atol=1e-3)


def test_projection_norms_called_per_head_would_be_wrong():
    """A case that must fail: OLMo 2's q_norm applied per head (as for Qwen3) is not the model's arithmetic."""
    from patchdsl.ops.rope import apply_qk_norms

    attn = _model("olmo2").model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    nq, d = attn.config.num_attention_heads, attn.head_dim
    nk = attn.config.num_key_value_heads
    q, k = torch.randn(2, 3, nq, d, generator=g), torch.randn(2, 3, nk, d, generator=g)
    with torch.no_grad():
        qa, ka = apply_qk_norms(attn, q, k, "projection")
        assert torch.allclose(qa, attn.q_norm(q.reshape(2, 3, nq * d)).view_as(q))
        with pytest.raises(RuntimeError):
            apply_qk_norms(attn, q, k, "head")     # a head_dim-wide input to a projection-wide norm


@pytest.mark.parametrize("model_type,why", [
    ("gpt_oss", "apply_rotary_pos_emb computes none of the rotary layouts fused_rope knows"),
])
def test_layouts_fused_rope_does_not_compute_are_refused_with_the_structural_reason(model_type, why):
    """A probe that used to crash on its stand-in now names what differs (never a crash, never silence)."""
    spec = "dtype fp32\n*.self_attn: Attention -> fused_rope\n"
    p = plan(spec, _model(model_type))
    assert p.sites and all(why in s.refused for s in p.sites), [s.refused for s in p.sites]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mimo_v2_flash"])
def test_layouts_the_rebuilt_forward_refuses_run_the_models_own_forward(model_type):
    """Qwen3.5's per-head output gate and MiMo-V2's other value width are refused by the rebuilt forward
    (with the reason) but patched by running the model's own forward around the kernel (issue 25)."""
    from patchdsl.ops.attention_forward import layout_reason
    from patchdsl.ops.rope import rope_route

    m = _model(model_type)
    attn = next(mod for _, mod in m.named_modules() if type(mod).__name__.endswith("Attention"))
    f = build_index_facts(attn)
    assert layout_reason(attn, f, analyse(type(attn)))
    assert rope_route(attn, f)[0] == "swap"
    p = plan("dtype fp32\n*.self_attn: Attention -> fused_rope\n", m)
    assert p.sites and not p.refused_sites


def build_index_facts(attn):
    from patchdsl.model.index import build_index

    return dict(build_index(attn).infos[""].kinds["Attention"])
