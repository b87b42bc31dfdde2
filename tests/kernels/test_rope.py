"""fused_rope: kernel forward/backward vs float64 (GQA, partial rotary, strided q/k, seq 1, cos
broadcast over batch), specialisation of the generated source, and the replacement attention
forward on tiny Qwen3 / Llama / Gemma3 / Phi-3 models (logits, grads, KV-cache generation, the
cache argument under both names, PEFT LoRA) plus the refusals of check().
"""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.index import build_index
from patchdsl.model.forward.attention import analyse
from patchdsl.model.reference import reference_rope
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.runtime import PatchError, patch_module

from ..families import tiny_model
from .helpers import rope_fwd_bwd as run
from .helpers import DEVICE, TARGET, TOL, TORCH_DTYPES, assert_close, kernel_for, rel_err, sizes

OP = "fused_rope"


def facts(head_dim, rotary_dim, nq, nk):
    return {"head_dim": head_dim, "rotary_dim": rotary_dim, "n_heads": nq, "n_kv_heads": nk, "fused_qkv": False}


def inputs(b, s, nq, nk, d, r, dtype, seed=0, cos_batch=1):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    q = torch.randn(b, s, nq, d, generator=g).to(dt).to(DEVICE)
    k = torch.randn(b, s, nk, d, generator=g).to(dt).to(DEVICE)
    ang = torch.randn(cos_batch, s, r, generator=g) * 3   # general angles: the two halves differ
    cos, sin = ang.cos().to(dt).to(DEVICE), ang.sin().to(dt).to(DEVICE)
    dq = torch.randn(b, s, nq, d, generator=g).to(dt).to(DEVICE)
    dk = torch.randn(b, s, nk, d, generator=g).to(dt).to(DEVICE)
    return q, k, cos, sin, dq, dk


def ref64(q, k, cos, sin, dq, dk):
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    qo, ko = reference_rope(q64, k64, cos.double(), sin.double())
    torch.autograd.backward((qo, ko), (dq.double(), dk.double()))
    return qo.detach(), ko.detach(), q64.grad, k64.grad


# (batch, seq, q heads, kv heads, head_dim, rotary_dim, flags, cos batch)
CASES = sizes(
    cpu=[
        (2, 5, 4, 2, 64, 64, {}, 1),                      # GQA 4q/2kv, full rotary, one unmasked tile
        (1, 3, 4, 2, 128, 128, {}, 1),                    # head_dim 128
        (2, 4, 3, 1, 64, 32, {}, 2),                      # partial 0.5, 3 heads (masked), cos per batch
        (2, 3, 6, 2, 128, 96, {"block": 128}, 1),         # partial 0.75 (half 48: masked), heads looped 2 per tile
        (2, 3, 5, 1, 64, 48, {"block": 64, "tokens_per_program": 4}, 1),  # looped with a head tail, 4 tok/prog
        (3, 1, 4, 2, 64, 64, {}, 3),                      # seq 1 (decoding), batch 3
    ],
    gpu=[
        (8, 2048, 16, 8, 128, 128, {}, 1),                # Qwen3-0.6B
        (8, 2048, 32, 8, 128, 128, {}, 1),                # Qwen3-8B
        (4, 1000, 24, 8, 96, 96, {}, 4),                  # Phi-3-mini-like, odd seq
        (2, 777, 24, 8, 128, 96, {}, 1),                  # Phi-4-mini partial 0.75
        (2, 333, 40, 8, 128, 128, {"block": 512}, 1),     # looped heads
        (64, 1, 32, 8, 128, 128, {}, 64),                 # decoding
    ])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}s{}q{}k{}d{}r{}".format(*c[:6]))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernel_matches_float64(dtype, case):
    b, s, nq, nk, d, r, flags, cb = case
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk), dtype, flags)
    q, k, cos, sin, dq, dk = inputs(b, s, nq, nk, d, r, dtype, cos_batch=cb)
    rq, rk, rdq, rdk = ref64(q, k, cos, sin, dq, dk)
    qo, ko, gq, gk = run(kern, q, k, cos, sin, dq, dk)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype and gq.dtype == q.dtype
    assert_close(qo, rq, dtype, "q_out")
    assert_close(ko, rk, dtype, "k_out")
    assert_close(gq, rdq, dtype, "dq")
    assert_close(gk, rdk, dtype, "dk")
    if r < d:   # the pass-through dims are copied exactly
        assert torch.equal(qo[..., r:], q[..., r:]) and torch.equal(gk[..., r:], dk[..., r:])


def test_strided_q_k_from_a_fused_qkv_projection():
    """Phi-3: q, k are slices of one qkv tensor (token stride > heads * head_dim)."""
    nq, nk, d, r = 4, 2, 64, 32
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk), "fp32")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 3, (nq + 2 * nk) * d, generator=g).to(DEVICE).requires_grad_()
    q = qkv[..., : nq * d].view(2, 3, nq, d)
    k = qkv[..., nq * d: (nq + nk) * d].view(2, 3, nk, d)
    assert not q.is_contiguous()
    ang = torch.randn(1, 3, r, generator=g)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    qo, ko = kern.rope(q, k, cos, sin)
    rq, rk = reference_rope(q.detach().double(), k.detach().double(), cos.double(), sin.double())
    assert_close(qo, rq, "fp32", "q_out")
    assert_close(ko, rk, "fp32", "k_out")
    (qo.sum() + 2 * ko.sum()).backward()
    ref = qkv.detach().double().requires_grad_()
    a, bb = reference_rope(ref[..., : nq * d].view(2, 3, nq, d), ref[..., nq * d: (nq + nk) * d].view(2, 3, nk, d),
                           cos.double(), sin.double())
    (a.sum() + 2 * bb.sum()).backward()
    assert_close(qkv.grad, ref.grad, "fp32", "d_qkv")


def test_non_contiguous_output_gradient():
    """The gradient reaching the kernel is often the transposed (b, h, s, d) layout of sdpa's backward."""
    nq, nk, d = 4, 2, 64
    kern = kernel_for(OP, "Attention", facts(d, d, nq, nk), "fp32")
    q, k, cos, sin, dq, dk = inputs(2, 5, nq, nk, d, d, "fp32", seed=2)
    dq_t = dq.transpose(1, 2).contiguous().transpose(1, 2)   # same values, (b, h, s, d) memory
    assert not dq_t.is_contiguous()
    _, _, rdq, rdk = ref64(q, k, cos, sin, dq, dk)
    _, _, gq, gk = run(kern, q, k, cos, sin, dq_t, dk)
    assert_close(gq, rdq, "fp32", "dq")
    assert_close(gk, rdk, "fp32", "dk")


# cos/sin layouts: HF's rotary embedding returns (batch or 1, seq, R); apply_rotary_pos_emb unsqueezes them to
# (batch or 1, 1, seq, R) for the heads; a (seq, R) table is the plain one.  Each must give the same rotation.
COS_LAYOUTS = [
    ("3-D, one for all rows", 1, lambda c: c),
    ("3-D, per row", 2, lambda c: c),
    ("2-D (seq, R)", 1, lambda c: c[0]),
    ("4-D unsqueezed for the heads", 1, lambda c: c.unsqueeze(1)),
    ("4-D unsqueezed, per row", 2, lambda c: c.unsqueeze(1)),
]


@pytest.mark.parametrize("what,cos_batch,layout", COS_LAYOUTS, ids=[c[0] for c in COS_LAYOUTS])
def test_cos_sin_layouts_give_the_same_rotation(what, cos_batch, layout):
    nq, nk, d, r = 4, 2, 64, 32
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk), "fp32")
    q, k, cos, sin, dq, dk = inputs(2, 5, nq, nk, d, r, "fp32", seed=7, cos_batch=cos_batch)
    rq, rk, rdq, rdk = ref64(q, k, cos, sin, dq, dk)
    qo, ko, gq, gk = run(kern, q, k, layout(cos), layout(sin), dq, dk)
    for got, want, name in ((qo, rq, "q_out"), (ko, rk, "k_out"), (gq, rdq, "dq"), (gk, rdk, "dk")):
        assert_close(got, want, "fp32", f"{what}: {name}")


BAD_COS = [
    ("heads dim not 1", lambda c: c.unsqueeze(1).expand(-1, 2, -1, -1)),
    ("5-D", lambda c: c[None, None]),
    ("1-D", lambda c: c[0, 0]),
    ("wrong seq", lambda c: c[:, :4]),
]


@pytest.mark.parametrize("what,bad", BAD_COS, ids=[c[0] for c in BAD_COS])
def test_a_cos_sin_layout_that_is_not_a_rotary_table_is_refused(what, bad):
    """Must fail: a 4-D cos with a heads dimension other than 1 was accepted before and read with its
    heads stride as the seq stride."""
    kern = kernel_for(OP, "Attention", facts(64, 32, 4, 2), "fp32")
    q, k, cos, sin, _, _ = inputs(1, 5, 4, 2, 64, 32, "fp32")
    with pytest.raises(ValueError, match=r"cos/sin: expected \(5, 32\), \(1 or 1, 5, 32\) or \(1 or 1, 1, 5, 32\)"):
        kern.rope(q, k, bad(cos), bad(sin))


def test_shape_mismatch_is_an_error():
    kern = kernel_for(OP, "Attention", facts(64, 64, 4, 2), "fp32")
    q, k, cos, sin, _, _ = inputs(1, 3, 4, 2, 64, 64, "fp32")
    with pytest.raises(ValueError, match="cos/sin"):
        kern.rope(q, k, cos[..., :32], sin[..., :32])
    with pytest.raises(ValueError, match="expected"):
        kern.rope(q[:, :, :3], k, cos, sin)


# ------------------------------------------------------------------------------------------
# The dtype of the rotated q/k: what the model's own apply_rotary_pos_emb returns.  OLMo 2/3 keep cos/sin
# in float32 in a bf16 model and cast the result back to q's dtype (a promoting kernel handed float32 q/k
# to a bf16 attention: `verify --dtype bf16` crashed); Llama's returns the promotion (cos/sin are cast to
# the activations' dtype first, so this differs only under autocast, where q/k come out float32 too)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,rule", [("olmo2", "input"), ("olmo3", "input"), ("llama", "promote"),
                                         ("qwen3", "promote")])
def test_rotary_out_dtype_is_probed_from_the_models_function(family, rule):
    from .helpers import tiny_family

    attn = tiny_family(family).model.layers[0].self_attn
    assert build_index(attn).infos[""].facts("Attention")["rotary_out_dtype"] == rule


@pytest.mark.parametrize("rule,dtype,expect", [("input", "bf16", torch.bfloat16), ("input", "fp16", torch.float16),
                                               ("promote", "bf16", torch.float32)])
@pytest.mark.parametrize("op_name", [OP, "fused_qk_norm_rope"])
def test_kernels_return_the_models_rotary_dtype(op_name, rule, dtype, expect):
    """bf16 / fp16 q and k with float32 cos / sin: the kernel's outputs (and its fake for torch.compile) have
    the dtype the model's function gives; the gradients are in q's / k's dtype."""
    f = {**facts(16, 16, 2, 1), "rotary_out_dtype": rule}
    if op_name != OP:
        f["qk_norm"] = {"eps": 1e-6, "offset": 0.0, "casting": "llama"}
    kern = kernel_for(op_name, "Attention", f, dtype)
    q, k, cos, sin, dq, dk = inputs(1, 3, 2, 1, 16, 16, dtype)
    cos, sin = cos.float(), sin.float()
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    if op_name == OP:
        qo, ko = kern.rope(q, k, cos, sin)
    else:
        w = torch.ones(16, dtype=q.dtype, device=q.device)
        qo, ko = kern.qk_norm_rope(q, k, w, w, cos, sin)
    assert qo.dtype == ko.dtype == expect
    torch.autograd.backward((qo, ko), (dq.to(expect), dk.to(expect)))
    assert q.grad.dtype == k.grad.dtype == q.dtype
    ref_q = reference_rope(q.detach().double(), k.detach().double(), cos.double(), sin.double())[0]
    if op_name == OP:
        assert rel_err(qo.double(), ref_q) < TOL[dtype]


def test_olmo2_bf16_attention_hands_the_attention_bf16_q_and_k():
    """The shape of the crash: OLMo 2 in bf16 patched with fused_rope runs, and its logits and gradients match
    the unpatched bf16 model's to bf16 rounding."""
    import patchdsl
    from .helpers import tiny_family

    ref = tiny_family("olmo2").to(torch.bfloat16)
    pat = copy.deepcopy(ref)
    patchdsl.apply("*.self_attn: Attention -> fused_rope\n", pat)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    r, p = ref(input_ids=ids, labels=ids), pat(input_ids=ids, labels=ids)
    assert p.logits.dtype == r.logits.dtype == torch.bfloat16
    assert rel_err(p.logits.double(), r.logits.double()) < 2e-2


# ------------------------------------------------------------------------------------------
# Specialisation of the generated source
# ------------------------------------------------------------------------------------------

def source(d, r, nq, nk, target="cuda", dtype="bf16", **flags):
    op = get_op(OP)
    fl = op.default_flags()
    fl.update(flags)
    info = ModuleInfo("attn", "Attn", (), {"Attention": facts(d, r, nq, nk)})
    p = op.key_params(info, fl, dtype, target)
    src = render(KernelKey.for_op(op, p))
    return src, p


def kernels_only(src):
    return src[src.index("@triton.jit"):src.index("def _tokens")]


@pytest.mark.parametrize("target", ["cuda", "interpreter"])
def test_power_of_two_heads_full_rotary_is_one_unmasked_tile(target):
    src, p = source(128, 128, 16, 8, target)
    code = kernels_only(src)
    assert "mask=" not in code and "for h0 in range" not in code
    assert "ROTARY_DIM + p" not in code and "PASS_DIM" not in src
    assert p["q_block_heads"] == 16 and not p["q_loop"] or target == "interpreter"


def test_partial_rotary_changes_the_code():
    full = kernels_only(source(128, 128, 16, 8)[0])
    part = kernels_only(source(128, 64, 16, 8)[0])
    assert full != part
    assert "xp = tl.load(src + ROTARY_DIM + p[None, :]" in part and "ROTARY_DIM + p" not in full
    # half of 0.75 * 128 = 48 is not a power of two: the rotary tile is masked
    p75 = kernels_only(source(128, 96, 16, 8)[0])
    assert "dm = d < HALF" in p75 and "dm = d < HALF" not in full


def test_many_heads_loop_and_odd_heads_mask():
    looped, p = source(128, 128, 40, 8, block=1024)
    assert p["q_loop"] and not p["k_loop"]
    code = kernels_only(looped)
    assert "for h0 in range(0, 40, 16)" in code and "hm = h < 40" in code
    odd, p = source(64, 64, 12, 4)
    assert not p["q_loop"] and p["q_head_mask"]
    assert "hm = h < 12" in kernels_only(odd) and "for h0" not in kernels_only(odd)


def test_short_tokens_share_a_program():
    src, p = source(64, 64, 4, 2, "cuda")
    assert p["tokens_per_program"] > 1 and "for i in range(TOKENS_PER_PROGRAM)" in src
    src, p = source(128, 128, 32, 8, "cuda")
    assert p["tokens_per_program"] == 1 and "for i in range(TOKENS_PER_PROGRAM)" not in src


def test_kernel_name_is_readable():
    _, p = source(128, 96, 24, 8)
    assert get_op(OP).kernel_name(p) == "fused_rope_bf16_d128_r96_q24k8_cuda"


# ------------------------------------------------------------------------------------------
# The replacement attention forward on tiny models
# ------------------------------------------------------------------------------------------

FAMILIES = ["qwen3", "llama", "gemma3", "phi3"]


def _model(family, dtype=torch.float32):
    m = tiny_model(family, seed=0, dtype=dtype).to(DEVICE)
    with torch.no_grad():   # non-trivial norm weights (Gemma's are zero at init)
        g = torch.Generator().manual_seed(3)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_((torch.randn(p.shape, generator=g) * 0.3).to(p.dtype).to(DEVICE))
    return m


def _ids(m, b=2, s=7, seed=1):
    return torch.randint(3, m.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _loss_and_grads(m, ids):
    m.zero_grad(set_to_none=True)
    out = m(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def _patch_all(m, op=OP, **flags):
    return [patch_module(layer.self_attn, op, **flags) for layer in m.model.layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hf(family):
    m = _model(family)
    ids = _ids(m)
    logits0, grads0 = _loss_and_grads(m, ids)
    gen0 = m.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    handles = _patch_all(m)
    try:
        for layer in m.model.layers:
            assert "forward" in layer.self_attn.__dict__
        logits1, grads1 = _loss_and_grads(m, ids)
        gen1 = m.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    finally:
        for h in handles:
            h.undo()
    assert "forward" not in m.model.layers[0].self_attn.__dict__
    assert_close(logits1, logits0, "fp32", "logits")
    assert set(grads1) == set(grads0)
    for n in grads0:
        assert_close(grads1[n], grads0[n], "fp32", f"grad {n}", factor=10)
    assert torch.equal(gen1, gen0)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_patched_model_bf16(family):
    """bf16: HF rounds each of q*cos, rotate_half(q)*sin and their sum; the kernel rounds once."""
    m = _model(family, torch.bfloat16)
    ids = _ids(m)
    logits0, grads0 = _loss_and_grads(m, ids)
    m64 = copy.deepcopy(m).double()
    logits64, _ = _loss_and_grads(m64, ids)
    handles = _patch_all(m)
    logits1, grads1 = _loss_and_grads(m, ids)
    for h in handles:
        h.undo()
    # the patched model is at least as close to the float64 model as HF's bf16 forward (+ slack)
    e_hf, e_fused = rel_err(logits0, logits64), rel_err(logits1, logits64)
    assert e_fused <= max(2 * e_hf, TOL["bf16"]), (e_fused, e_hf)
    assert rel_err(logits1, logits0) <= 2 * TOL["bf16"]
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        key = n if n in grads0 else n.replace("q_proj", "qkv_proj")
        assert rel_err(grads1[key], grads0[key]) <= 4 * TOL["bf16"], key


def test_kv_cache_two_steps_and_both_cache_names():
    """Manual prefill + one decode step with use_cache, and the attention called directly with the
    cache positionally, as `cache=` and as `past_key_values=` (transformers 5.17 name)."""
    from transformers.cache_utils import DynamicCache

    m = _model("qwen3")
    ids = _ids(m, b=2, s=6)

    def two_steps():
        out = m(ids[:, :5], use_cache=True)
        out2 = m(ids[:, 5:], past_key_values=out.past_key_values, use_cache=True)
        return out.logits, out2.logits

    a0, b0 = two_steps()
    handles = _patch_all(m)
    a1, b1 = two_steps()
    assert_close(a1, a0, "fp32", "prefill logits")
    assert_close(b1, b0, "fp32", "decode logits")

    attn = m.model.layers[0].self_attn
    an = analyse(type(attn))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, m.config.hidden_size, generator=g).to(DEVICE)
    ang = torch.randn(1, 3, attn.head_dim, generator=g).to(DEVICE)
    pe = (ang.cos(), ang.sin())
    ref_cache = DynamicCache()
    ref = type(attn).forward(attn, x, pe, None, **{an.cache_param: ref_cache})[0]
    for how in ("positional", "cache", "past_key_values"):
        c = DynamicCache()
        if how == "positional":
            out = attn(x, pe, None, c)[0]
        else:
            out = attn(x, position_embeddings=pe, attention_mask=None, **{how: c})[0]
        assert_close(out, ref, "fp32", how)
        assert_close(c.layers[attn.layer_idx].keys, ref_cache.layers[attn.layer_idx].keys, "fp32", f"{how} keys")
    for h in handles:
        h.undo()


def test_kernel_is_what_runs():
    """Install through op.install with a counting kernel getter: the generated rope runs once per
    layer per forward (q and k in one call), the original forward does not."""
    op = get_op(OP)
    m = _model("llama")
    calls = []
    undo = []
    for layer in m.model.layers:
        attn = layer.self_attn
        info = build_index(attn).infos[""]
        assert op.check(attn, info, op.default_flags()) is None
        params = op.key_params(info, op.default_flags(), "fp32", TARGET)
        from patchdsl.codegen import load_kernel
        mod = load_kernel(KernelKey.for_op(op, params))

        def getter(dt, _mod=mod):
            calls.append(dt)
            return _mod

        for obj, attr, value in op.install(attn, getter, op.default_flags(), info):
            undo.append((obj, attr))
            setattr(obj, attr, value)
    orig = type(m.model.layers[0].self_attn).forward
    try:
        type(m.model.layers[0].self_attn).forward = None   # would raise if the class forward ran
        m(_ids(m))
    finally:
        type(m.model.layers[0].self_attn).forward = orig
        for obj, attr in undo:
            delattr(obj, attr)
    assert calls == [torch.float32] * len(m.model.layers)


def test_peft_lora_projections():
    peft = pytest.importorskip("peft")
    m = _model("llama")
    lm = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "k_proj"],
                                                lora_dropout=0.0, init_lora_weights=False))
    ids = _ids(m)
    inner = lm.base_model.model

    def run_():
        lm.zero_grad(set_to_none=True)
        out = lm(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    l0, g0 = run_()
    handles = [patch_module(layer.self_attn, OP) for layer in inner.model.layers]
    l1, g1 = run_()
    for h in handles:
        h.undo()
    assert_close(l1, l0, "fp32", "logits")
    assert g0 and set(g1) == set(g0) and all("lora" in n for n in g0)
    for n in g0:
        assert_close(g1[n], g0[n], "fp32", n, factor=10)


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------

def test_module_without_rotary_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    attn = gpt2.transformer.h[0].attn
    with pytest.raises(PatchError, match="not an attention module with rotary"):
        patch_module(attn, OP)


def test_forward_without_apply_rotary_is_refused():
    from transformers.models.llama import modeling_llama as ml

    class NoRopeAttention(ml.LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            q = self.q_proj(hidden_states)
            return self.o_proj(q), None

    m = _model("llama")
    attn = m.model.layers[0].self_attn
    attn.__class__ = NoRopeAttention
    with pytest.raises(PatchError, match=r"does not call apply_rotary_pos_emb\("):
        patch_module(attn, OP)


# A forward that passes every structural check but scales q after the rotation: only the stand-in
# comparison can see it.
_SCALED_SRC = '''
def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    query_states = query_states * 1.5
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask,
                                                    dropout=0.0, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
'''


def _class_from_source(name, src, base, extra_globals=None):
    import sys
    import tempfile

    from transformers.models.llama import modeling_llama as ml

    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False, prefix=f"patchdsl_test_{name}_")
    path.write("from transformers.models.llama.modeling_llama import (apply_rotary_pos_emb, "
               "ALL_ATTENTION_FUNCTIONS, eager_attention_forward)\n" + src)
    path.close()
    modname = f"patchdsl_test_attn_{name}"
    spec = __import__("importlib.util").util.spec_from_file_location(modname, path.name)
    mod = __import__("importlib.util").util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    cls = type(name, (base,), {"forward": mod.forward, "__module__": modname})
    del ml
    return cls


def test_structurally_similar_but_different_forward_is_refused_by_the_stand_in():
    from transformers.models.llama import modeling_llama as ml

    cls = _class_from_source("ScaledQAttention", _SCALED_SRC, ml.LlamaAttention)
    assert not isinstance(analyse(cls), str)          # the source analysis alone accepts it ...
    m = _model("llama")
    attn = m.model.layers[0].self_attn
    attn.__class__ = cls
    from patchdsl.ops.rope import rope_route

    # ... the stand-in comparison of the rebuilt forward does not (it would drop the scaling), so fused_rope
    # runs the class's own forward with apply_rotary_pos_emb resolved to the kernel instead (issue 25)
    info = build_index(attn).infos[""]
    assert rope_route(attn, info.kinds["Attention"])[0] == "swap"
    x = torch.randn(2, 5, attn.config.hidden_size, generator=torch.Generator().manual_seed(4))
    ang = torch.randn(1, 5, attn.head_dim, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = attn(x, (ang.cos(), ang.sin()), None)[0]
        h = patch_module(attn, OP)
        out = attn(x, (ang.cos(), ang.sin()), None)[0]
        h.undo()
    assert torch.allclose(out, ref, atol=1e-5)
    # the same source without the scaling is accepted
    ok = _class_from_source("UnscaledAttention", _SCALED_SRC.replace("    query_states = query_states * 1.5\n", ""),
                            ml.LlamaAttention)
    attn.__class__ = ok
    patch_module(attn, OP).undo()


def test_branching_or_other_rope_conventions_are_refused():
    from transformers.models.cohere import modeling_cohere as mc

    reason = analyse(mc.CohereAttention)
    assert isinstance(reason, str) and "branch" in reason


def test_qk_norm_of_neither_width_is_refused():
    """Olmo2 normalises the whole q projection (patched: tests/kernels/test_rope_variants.py); a q_norm
    over some other width can be called neither per head nor per projection: refused, with the reason."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmo2", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64, pad_token_id=0)
    attn = AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
    attn.q_norm = type(attn.q_norm)(32, eps=1e-6)
    with pytest.raises(PatchError, match="neither each head .* nor the whole q/k projection"):
        patch_module(attn, OP)


def test_flags_are_typed():
    with pytest.raises(PatchError, match="unknown flag"):
        patch_module(_model("llama").model.layers[0].self_attn, OP, heads=3)
    spec = get_op(OP).flag("block")
    with pytest.raises(ValueError):
        spec.coerce("big")
    assert re.search(r"auto", spec.doc)


@pytest.mark.parametrize("op_name", ["fused_rope", "fused_qk_norm_rope"])
@pytest.mark.parametrize("r", [64, 48])
def test_kernel_globals_are_constexpr(op_name, r):
    """Compiled Triton only lets a @jit function read module globals that are tl.constexpr (the
    interpreter does not check), so catch a plain global on the CPU."""
    import triton.language as tl

    f = dict(facts(64, r, 6, 2), qk_norm={"eps": 1e-6, "offset": 1.0, "casting": "gemma"})
    mod = kernel_for(op_name, "Attention", f, "bf16", {"block": 64, "tokens_per_program": 2})
    jitted = [v for v in vars(mod).values()
              if type(v).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(v, "fn")]
    assert len(jitted) == 2
    for fn in jitted:
        for name in fn.fn.__code__.co_names:
            if name in vars(mod):
                v = vars(mod)[name]
                assert isinstance(v, (tl.constexpr, types.ModuleType)), f"{fn.fn.__name__} reads plain global {name}"
