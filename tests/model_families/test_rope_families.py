"""Attention and RoPE on the dense families beyond the Llama shape (issue 25, deliverable 2): partial rotary
(Phi, StableLM, Persimmon, GPT-NeoX, GLM-4), interleaved rotary (GLM, GLM-4, Cohere), output projections
named ``dense`` and a fused ``query_key_value`` split per head (GPT-NeoX, Persimmon), q/k norms under a
config branch (Cohere's ``use_qk_norm``).  On tiny models of the installed transformers: the suggested
spec patches every attention module with fused_rope and verifies against float64; the Attention kind's
facts show the rotary layout; the kernel is what runs and nothing process-wide is rebound; what cannot be
fused is refused with the structural reason.
"""

from __future__ import annotations

import importlib
import logging
import types
import warnings

import pytest
import torch

from patchdsl.model.index import build_index
from patchdsl.planning.planner import plan


def _cfg(model_type, **over):
    from patchdsl.model.tiny import tiny_family_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            cfg = tiny_family_config(model_type)
        finally:
            logging.disable(logging.NOTSET)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _model(model_type, seed=0, **over):
    from patchdsl.model.tiny import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(_cfg(model_type, **over), seed)


def _attn(m):
    return next(mod for _, mod in m.named_modules() if type(mod).__name__.endswith("Attention"))


# family -> (rotary_layout, rope_input, out_proj, rotary_dim / head_dim)
FACTS = {
    "phi": ("rotate_half", "rotary", "dense", 0.5),
    "stablelm": ("rotate_half", "rotary", "o_proj", 0.25),
    "persimmon": ("rotate_half", "rotary", "dense", 0.5),
    "gpt_neox": ("rotate_half", "head", "dense", 0.25),
    "glm4": ("interleaved_half_cos", "head", "o_proj", 0.5),
    "glm": ("interleaved_half_cos", "head", "o_proj", 0.5),
    "cohere": ("interleaved", "head", "o_proj", 1.0),
    "llama": ("rotate_half", "head", "o_proj", 1.0),
}


@pytest.mark.parametrize("family", list(FACTS))
def test_attention_facts_show_the_rotary_layout(family):
    layout, rope_input, out, frac = FACTS[family]
    with torch.device("meta"):
        m = _model(family)
    attn = _attn(m)
    f = build_index(attn).infos[""].kinds["Attention"]
    assert f["rotary_layout"] == layout and f["rope_input"] == rope_input
    assert f.get("out_proj", "o_proj") == out
    assert f["rotary_dim"] == int(f["head_dim"] * frac)


SUGGESTED = ["phi", "glm4", "cohere", "gpt_neox", "stablelm", "persimmon"]


@pytest.mark.slow
@pytest.mark.parametrize("family", SUGGESTED)
def test_suggested_spec_patches_attention_and_verifies(family):
    from patchdsl.parity import verify
    from patchdsl.planning.suggestion import suggest

    with torch.device("meta"):
        m = _model(family)
    s = suggest(m, dtypes=("fp32",))
    attn = [p for p, c in s.concern_of.items() if c == "attention"]
    assert attn and all(p in s.patched for p in attn), {p: s.unpatched.get(p) for p in attn}
    assert "fused_rope" in s.text
    rep = verify(s.text, lambda: _model(family), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, (rep.verdict, [(r.path, r.quantity) for r in rep.failures()][:5], rep.refused)


@pytest.mark.slow
@pytest.mark.parametrize("family,over", [
    ("cohere", {"use_qk_norm": True}),            # LayerNorm over (heads, head_dim) under 'if self.use_qk_norm'
    ("stablelm", {"qk_layernorm": True}),         # a LayerNorm per head under 'if self.qk_layernorm'
    ("phi", {"qk_layernorm": True}),
    ("glm", {}), ("cohere2", {}), ("mllama", {}), ("qwen3_5_text", {}),
    ("falcon", {}),                               # multi-query query_key_value (1 kv head), a required alibi=None
])
def test_branch_norms_and_other_shapes_verify(family, over):
    from patchdsl.parity import verify

    spec = "dtype fp32\n*: Attention -> fused_rope\n"
    p = plan(spec, _model(family, **over))
    assert p.sites and not p.refused_sites, [s.refused for s in p.refused_sites]
    rep = verify(spec, lambda: _model(family, **over), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, (rep.verdict, rep.refused)


def _install_counting(attn, calls, op_name="fused_rope"):
    from patchdsl.codegen import KernelKey, load_kernel
    from patchdsl.ops.registry import get_op

    from ..kernels.helpers import TARGET

    op = get_op(op_name)
    info = build_index(attn).infos[""]
    assert op.check(attn, info, op.default_flags()) is None
    params = op.key_params(info, op.default_flags(), "fp32", TARGET)
    mod = load_kernel(KernelKey.for_op(op, params))

    def getter(dt):
        calls.append(dt)
        return mod

    for obj, attr, value in op.install(attn, getter, op.default_flags(), info):
        setattr(obj, attr, value)


@pytest.mark.parametrize("family", ["gpt_neox", "phi", "cohere"])
def test_kernel_is_what_runs_and_nothing_process_wide_changes(family):
    """The original forward runs with apply_rotary_pos_emb resolved to the kernel on this instance only: the
    kernel is called once per layer, the modeling module's global is the same object, and an unpatched
    model of the same class computes what it did."""
    m, twin = _model(family), _model(family)
    modeling = importlib.import_module(type(_attn(m)).__module__)
    before = modeling.apply_rotary_pos_emb
    ids = torch.randint(3, m.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = twin(ids).logits
    layers = [mod for n, mod in m.named_modules() if mod is not m and type(mod) is type(_attn(m))]
    calls = []
    for a in layers:
        _install_counting(a, calls)
        assert isinstance(a.__dict__["forward"], types.MethodType)
    with torch.no_grad():
        out = m(ids).logits
        again = twin(ids).logits
    assert calls == [torch.float32] * len(layers)
    assert modeling.apply_rotary_pos_emb is before
    assert torch.equal(again, ref)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_wrong_layout_would_be_caught_by_the_probe():
    """Must fail: GLM-4's attention with rotate_half claimed as its layout is refused by the stand-in probe."""
    from patchdsl.ops.rope import rope_route

    attn = _attn(_model("glm4"))
    f = dict(build_index(attn).infos[""].kinds["Attention"])
    assert not isinstance(rope_route(attn, f), str)
    f["rotary_layout"] = "rotate_half"
    why = rope_route(attn, f)
    assert isinstance(why, str) and "does not reproduce" in why


@pytest.mark.parametrize("family,why", [
    ("gpt_oss", "computes none of the rotary layouts fused_rope knows"),
])
def test_what_cannot_be_fused_is_refused_with_the_structural_reason(family, why):
    p = plan("dtype fp32\n?*: Attention -> fused_rope\n", _model(family))
    refused = [s.refused for s in p.sites if s.refused]
    assert refused and all(why in r for r in refused), refused


def test_a_forward_that_calls_the_rotary_function_twice_is_refused():
    from patchdsl.ops.attention_swap import analyse_swap

    mod = importlib.import_module("transformers.models.llama.modeling_llama")

    class Twice(mod.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
            q = k = hidden_states[:, None]
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # noqa: F821 - a module global where it is analysed
            return apply_rotary_pos_emb(q, k, cos, sin)  # noqa: F821

    why = analyse_swap(Twice)
    assert isinstance(why, str) and "2 times" in why


@pytest.mark.parametrize("op_name", ["fused_qk_norm_rope", "liger.rope"])
def test_ops_that_compute_rotate_half_only_refuse_other_layouts(op_name):
    """A Qwen3 attention (per-head q/k RMSNorms: fused_qk_norm_rope fits it) with an interleaved layout in
    its facts: the rotate_half-only ops refuse it and point to fused_rope; with its own facts they do not."""
    from patchdsl.model.info import ModuleInfo
    from patchdsl.ops.registry import get_op

    from ..families import tiny_model

    attn = tiny_model("qwen3").model.layers[0].self_attn
    info = build_index(attn).infos[""]
    f = dict(info.kinds["Attention"])
    op = get_op(op_name)
    inter = ModuleInfo(info.path, info.cls, info.bases, {"Attention": dict(f, rotary_layout="interleaved")},
                       dtype=info.dtype, children=info.children)
    why = op.check(attn, inter, op.default_flags())
    assert why and "interleaved" in why and "use fused_rope" in why
    if op_name == "fused_qk_norm_rope":
        assert op.check(attn, info, op.default_flags()) is None


@pytest.mark.slow
def test_swapped_forward_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces the recompiled forward (GPT-NeoX: query_key_value, partial rotary,
    dense) as it traces the original, and matches eager; the kernel runs as its custom op."""
    import patchdsl
    from patchdsl.syntax import load_spec

    m = _model("gpt_neox")
    h = patchdsl.apply(load_spec("dtype fp32\n*: Attention -> fused_rope\n"), m)
    assert not h.refused
    ids = torch.randint(3, m.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))

    def step(call):
        m.zero_grad(set_to_none=True)
        loss = call(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    le, ge = step(m)
    torch._dynamo.reset()
    try:
        lc, gc = step(torch.compile(m, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
        h.undo()
    assert torch.allclose(lc, le, rtol=1e-5) and gc.keys() == ge.keys()
    assert all(torch.allclose(gc[n], ge[n], rtol=1e-4, atol=1e-6) for n in ge)
