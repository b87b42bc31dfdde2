"""fused_qk_norm_rope: per-head q/k RMSNorm (Llama or Gemma casting) + RoPE, kernel forward and
backward (including the q_norm/k_norm weight grads) vs float64, specialisation of the generated
source, the replacement attention forward on tiny Qwen3 / Gemma3 models, and refusals.
"""

from __future__ import annotations

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.reference import reference_rmsnorm, reference_rope
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.runtime import PatchError, patch_module

from .helpers import DEVICE, TORCH_DTYPES, assert_close, kernel_for, rel_err, sizes
from .test_rope import _ids, _loss_and_grads, _model

OP = "fused_qk_norm_rope"
EPS = 1e-6


def facts(d, r, nq, nk, offset=0.0, casting="llama", eps=EPS):
    return {"head_dim": d, "rotary_dim": r, "n_heads": nq, "n_kv_heads": nk, "fused_qkv": False,
            "qk_norm": {"eps": eps, "offset": offset, "casting": casting}}


def inputs(b, s, nq, nk, d, r, dtype, seed=0, w_dtype=None, cos_batch=1):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    wdt = TORCH_DTYPES[w_dtype or dtype]
    q = (torch.randn(b, s, nq, d, generator=g) * 2 + 0.3).to(dt).to(DEVICE)
    k = (torch.randn(b, s, nk, d, generator=g) * 0.5).to(dt).to(DEVICE)
    wq = (torch.randn(d, generator=g) * 0.5 + 0.2).to(wdt).to(DEVICE)
    wk = (torch.randn(d, generator=g) * 0.5 - 0.1).to(wdt).to(DEVICE)
    ang = torch.randn(cos_batch, s, r, generator=g) * 3
    cos, sin = ang.cos().to(dt).to(DEVICE), ang.sin().to(dt).to(DEVICE)
    dq = torch.randn(b, s, nq, d, generator=g).to(dt).to(DEVICE)
    dk = torch.randn(b, s, nk, d, generator=g).to(dt).to(DEVICE)
    return q, k, wq, wk, cos, sin, dq, dk


def ref64(q, k, wq, wk, cos, sin, dq, dk, offset, casting="llama", eps=EPS):
    t = [x.detach().double().requires_grad_() for x in (q, k, wq, wk)]
    qn = reference_rmsnorm(t[0], t[2], eps, offset, casting)
    kn = reference_rmsnorm(t[1], t[3], eps, offset, casting)
    qo, ko = reference_rope(qn, kn, cos.double(), sin.double())
    torch.autograd.backward((qo, ko), (dq.double(), dk.double()))
    return qo.detach(), ko.detach(), t[0].grad, t[1].grad, t[2].grad, t[3].grad


def run(kern, q, k, wq, wk, cos, sin, dq, dk):
    t = [x.clone().requires_grad_() for x in (q, k, wq, wk)]
    qo, ko = kern.qk_norm_rope(t[0], t[1], t[2], t[3], cos, sin)
    torch.autograd.backward((qo, ko), (dq, dk))
    return qo, ko, t[0].grad, t[1].grad, t[2].grad, t[3].grad


# (batch, seq, q heads, kv heads, head_dim, rotary_dim, flags, cos batch)
CASES = sizes(
    cpu=[
        (2, 5, 4, 2, 64, 64, {}, 1),                      # GQA, one unmasked tile; 10 tokens over 4 bwd programs
        (1, 3, 4, 2, 128, 128, {}, 1),                    # head_dim 128
        (2, 4, 3, 1, 64, 32, {}, 2),                      # partial 0.5, 3 heads (masked), cos per batch
        (2, 3, 5, 1, 128, 96, {"block": 128, "tokens_per_program": 4}, 1),  # partial 0.75, looped heads + tail
        (3, 1, 4, 2, 64, 64, {}, 3),                      # seq 1 (decoding)
        # forward in one tile, backward looped in 2-head tiles with masked head and rotary tails
        (2, 3, 5, 3, 64, 48, {"bwd_block": 64}, 1),
    ],
    gpu=[
        (8, 2048, 16, 8, 128, 128, {}, 1),                # Qwen3-0.6B
        (8, 2048, 32, 8, 128, 128, {}, 1),                # Qwen3-8B
        (4, 999, 8, 4, 256, 256, {}, 1),                  # Gemma3-4B-like head_dim 256
        (2, 777, 12, 4, 128, 64, {}, 2),                  # partial rotary
        (2, 333, 40, 8, 128, 128, {"block": 512}, 1),     # looped heads
        (64, 1, 32, 8, 128, 128, {}, 64),                 # decoding
        (2, 333, 10, 2, 128, 128, {}, 1),                 # backward's 4-head tiles with a tail (10 = 4+4+2)
    ])
NORMS = [("llama", 0.0), ("gemma", 1.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}s{}q{}k{}d{}r{}".format(*c[:6]))
@pytest.mark.parametrize("casting,offset", NORMS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernel_matches_float64(dtype, casting, offset, case):
    b, s, nq, nk, d, r, flags, cb = case
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk, offset, casting), dtype, flags)
    x = inputs(b, s, nq, nk, d, r, dtype, cos_batch=cb)
    ref = ref64(*x, offset, casting)
    out = run(kern, *x)
    q = x[0]
    assert out[0].shape == q.shape and out[0].dtype == q.dtype and out[2].dtype == q.dtype
    assert out[4].dtype == x[2].dtype and out[4].shape == (d,)
    for o, rr, what in zip(out, ref, ("q_out", "k_out", "dq", "dk", "d_q_norm.weight", "d_k_norm.weight")):
        assert_close(o, rr, dtype, what)


def test_fp32_weights_with_16bit_activations_follow_torch_promotion():
    """Llama casting with an fp32 weight and bf16 q: HF's `w * x.to(bf16)` is fp32, so is the output."""
    kern = kernel_for(OP, "Attention", facts(64, 64, 4, 2), "bf16", w_dtype="fp32")
    x = inputs(2, 3, 4, 2, 64, 64, "bf16", w_dtype="fp32")
    out = run(kern, *x)
    assert out[0].dtype == torch.float32 and out[2].dtype == torch.bfloat16 and out[4].dtype == torch.float32
    ref = ref64(*x, 0.0)
    for o, rr, what in zip(out, ref, ("q_out", "k_out", "dq", "dk", "dwq", "dwk")):
        assert_close(o, rr, "bf16", what)


def test_eps_offset_casting_are_compiled_in_and_change_the_result():
    x = inputs(1, 4, 4, 2, 64, 64, "fp32", seed=7)
    x = (x[0] * 1e-3,) + x[1:]          # small q: eps matters
    base = run(kernel_for(OP, "Attention", facts(64, 64, 4, 2), "fp32"), *x)
    big_eps = run(kernel_for(OP, "Attention", facts(64, 64, 4, 2), "fp32", {"eps": 1e-3}), *x)
    assert_close(big_eps[0], ref64(*x, 0.0, eps=1e-3)[0], "fp32", "eps flag")
    assert rel_err(big_eps[0], base[0]) > 0.1
    gem = run(kernel_for(OP, "Attention", facts(64, 64, 4, 2, 1.0, "gemma"), "fp32"), *x)
    assert_close(gem[0], ref64(*x, 1.0, "gemma")[0], "fp32", "offset 1")
    assert rel_err(gem[0], base[0]) > 0.1


# ------------------------------------------------------------------------------------------
# Specialisation of the generated source
# ------------------------------------------------------------------------------------------

def source(d, r, nq, nk, offset=0.0, casting="llama", target="cuda", **flags):
    op = get_op(OP)
    fl = op.default_flags()
    fl.update(flags)
    info = ModuleInfo("attn", "Attn", (), {"Attention": facts(d, r, nq, nk, offset, casting)})
    p = op.key_params(info, fl, "bf16", target)
    src = render(KernelKey.for_op(op, p))
    return src[src.index("@triton.jit"):src.index("def _tokens")], p


def test_casting_and_offset_change_the_code():
    llama, _ = source(128, 128, 16, 8)
    gemma, p = source(128, 128, 16, 8, 1.0, "gemma")
    assert "(x1 * r).to(Q.dtype.element_ty)" in llama and "(x1 * r).to(" not in gemma
    assert "(x1 * r * wq1)" in gemma
    assert "+ 1.0" in gemma and "+ 1.0" not in llama and "+ 0.0" not in llama
    assert p["tag"].endswith("_gemma")


def test_full_vs_partial_rotary_and_masks():
    full, _ = source(128, 128, 16, 8, bwd_block=256)
    part, _ = source(128, 96, 16, 8, bwd_block=256)
    fwd, bwd = full[full.index("def qk_norm_rope_fwd_"):full.index("def qk_norm_rope_bwd_")], \
        full[full.index("def qk_norm_rope_bwd_"):]
    assert "mask=" not in full and "x_pass" not in full and "for h0" not in fwd
    # per-token cuda backward with bwd_block=256: heads in 4-head tiles (16 q heads in 4 tiles, 8 k heads in 2)
    assert "for h0 in range(0, 16, 4)" in bwd and "for h0 in range(0, 8, 4)" in bwd and "hm = " not in bwd
    one_tile, p = source(128, 128, 16, 8, bwd_block=4096)
    assert "for h0" not in one_tile and not p["bwd_q_loop"]
    assert "x_pass * x_pass" in part and "dwq_pass" in part and "dm = d < HALF" in part


@pytest.mark.parametrize("nq,nk,target,bwd_block,layout,pps,warps", [
    (16, 8, "cuda", "auto", "block", 3, 4),          # Qwen3-0.6B: the H200 sweep's winner
    (32, 8, "cuda", "auto", "block", 2, 4),          # Qwen3-4B/8B
    (64, 8, "cuda", "auto", "per_token", 16, None),  # a block tile of 64 heads would spill
    (16, 8, "cuda", 256, "per_token", 16, None),     # an explicit bwd_block keeps the per-token layout
    (16, 8, "interpreter", "auto", "per_token", 16, None),
])
def test_default_backward_layout(nq, nk, target, bwd_block, layout, pps, warps):
    _, p = source(128, 128, nq, nk, target=target, bwd_block=bwd_block)
    assert p["bwd_layout"] == layout and p["bwd_programs_per_sm"] == pps
    if warps is not None:
        assert p["bwd_warps"] == warps
    _, over = source(128, 128, nq, nk, target=target, bwd_block=bwd_block, bwd_programs_per_sm=5)
    assert over["bwd_programs_per_sm"] == 5


def test_backward_tile_is_separate_from_the_forward():
    src, p = source(64, 48, 5, 3, target="interpreter", bwd_block=64)
    fwd = src[src.index("def qk_norm_rope_fwd_"):src.index("def qk_norm_rope_bwd_")]
    bwd = src[src.index("def qk_norm_rope_bwd_"):]
    assert "for h0" not in fwd and not p["q_loop"]
    assert p["bwd_q_block_heads"] == 2 and p["bwd_q_head_mask"] and p["bwd_k_head_mask"]
    assert "for h0 in range(0, 5, 2)" in bwd and "hm = h < 5" in bwd and "for h0 in range(0, 3, 2)" in bwd


def test_many_heads_loop():
    looped, p = source(128, 128, 40, 8, block=1024)
    assert p["q_loop"] and "for h0 in range(0, 40, 16)" in looped and "hm = h < 40" in looped


# ------------------------------------------------------------------------------------------
# The replacement attention forward on tiny models
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_patched_model_matches_hf(family):
    m = _model(family)
    ids = _ids(m)
    logits0, grads0 = _loss_and_grads(m, ids)
    gen0 = m.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    handles = [patch_module(layer.self_attn, OP) for layer in m.model.layers]
    try:
        logits1, grads1 = _loss_and_grads(m, ids)
        gen1 = m.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    finally:
        for h in handles:
            h.undo()
    assert_close(logits1, logits0, "fp32", "logits")
    assert set(grads1) == set(grads0)
    assert "model.layers.0.self_attn.q_norm.weight" in grads1 and "model.layers.1.self_attn.k_norm.weight" in grads1
    for n in grads0:
        assert_close(grads1[n], grads0[n], "fp32", f"grad {n}", factor=10)
    assert torch.equal(gen1, gen0)


def test_frozen_norm_weights_get_no_grad():
    m = _model("qwen3")
    ids = _ids(m)
    for layer in m.model.layers:
        layer.self_attn.q_norm.weight.requires_grad_(False)
        layer.self_attn.k_norm.weight.requires_grad_(False)
    _, grads0 = _loss_and_grads(m, ids)
    handles = [patch_module(layer.self_attn, OP) for layer in m.model.layers]
    _, grads1 = _loss_and_grads(m, ids)
    for h in handles:
        h.undo()
    assert set(grads1) == set(grads0) and not any("_norm.weight" in n and "self_attn" in n for n in grads1)
    assert_close(grads1["model.layers.0.self_attn.q_proj.weight"], grads0["model.layers.0.self_attn.q_proj.weight"],
                 "fp32", "q_proj grad", factor=10)


def test_weights_are_read_at_call_time():
    m = _model("qwen3")
    ids = _ids(m)
    handles = [patch_module(layer.self_attn, OP) for layer in m.model.layers]
    before = m(ids).logits.detach()
    with torch.no_grad():
        m.model.layers[0].self_attn.q_norm.weight.mul_(-1.5)
    after = m(ids).logits.detach()
    for h in handles:
        h.undo()
    ref = m(ids).logits.detach()
    assert rel_err(after, before) > 1e-3
    assert_close(after, ref, "fp32", "logits after the weight changed")


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------

def test_attention_without_qk_norm_is_refused():
    attn = _model("llama").model.layers[0].self_attn
    with pytest.raises(PatchError, match="no q_norm/k_norm"):
        patch_module(attn, OP)


def test_different_q_and_k_norms_are_refused_unless_flags_given():
    m = _model("qwen3")
    attn = m.model.layers[0].self_attn
    attn.k_norm.variance_epsilon = 1e-3
    with pytest.raises(PatchError, match="differ in eps"):
        patch_module(attn, OP)
    patch_module(attn, OP, eps=1e-3).undo()


def test_non_rotary_module_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(PatchError, match="not an attention module"):
        patch_module(gpt2.transformer.h[0].attn, OP)


def test_covers_the_norm_children():
    assert get_op(OP).covers == ("q_norm", "k_norm")


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_cos_sin_unsqueezed_for_the_heads_give_the_same_result(cos_batch):
    """(batch or 1, 1, seq, R), as apply_rotary_pos_emb unsqueezes them, is read with its seq stride (the
    shared _cos_sin of the rotary templates); a heads dimension other than 1 is refused."""
    nq, nk, d, r = 4, 2, 64, 32
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk), "fp32")
    q, k, wq, wk, cos, sin, dq, dk = inputs(2, 5, nq, nk, d, r, "fp32", seed=9, cos_batch=cos_batch)
    want = ref64(q, k, wq, wk, cos, sin, dq, dk, 0.0)
    got = run(kern, q, k, wq, wk, cos.unsqueeze(1), sin.unsqueeze(1), dq, dk)
    for g, w, name in zip(got, want, ("q_out", "k_out", "dq", "dk", "dwq", "dwk")):
        assert_close(g, w, "fp32", name)
    with pytest.raises(ValueError, match="cos/sin: expected"):
        kern.qk_norm_rope(q, k, wq, wk, cos.unsqueeze(1).expand(-1, 3, -1, -1), sin.unsqueeze(1).expand(-1, 3, -1, -1))
