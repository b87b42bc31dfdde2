"""fused_add_rmsnorm: the residual add + RMSNorm kernel vs float64 (both outputs, both
gradients), the generated source, and patching pre-norm decoder layers of tiny Qwen3 / Llama
models (outputs, gradients, argument pass-through, gradient checkpointing, refusals)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.index import build_index
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.runtime import PatchError, patch_module

from ..families import tiny_model
from .helpers import assert_kernel_globals_constexpr, DEVICE, TORCH_DTYPES, assert_close, kernel_for, rel_err, sizes

OP = "fused_add_rmsnorm"
DTYPES = ["fp32", "bf16", "fp16"]
VARIANTS = [(0.0, "llama"), (1.0, "gemma")]
SHAPES = sizes(cpu=[(5, 1024), (6, 1000), (3, 2500), (1, 96)],
               gpu=[(4096, 1024), (2049, 1000), (1000, 2880), (64, 20000), (1, 4096)])


def _facts(hidden, eps=1e-6, offset=0.0, casting="llama", layout="prenorm"):
    return {"hidden": hidden, "eps": eps, "offset": offset, "casting": casting, "layout": layout}


def _inputs(rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    td = TORCH_DTYPES[dtype]
    x = (torch.randn(rows, hidden, generator=g) * 0.2).to(DEVICE, td)
    r = (torch.randn(rows, hidden, generator=g) * 0.2 + 0.05).to(DEVICE, td)
    w = (torch.randn(hidden, generator=g) * 0.5 + 0.3).to(DEVICE, td)
    dy = torch.randn(rows, hidden, generator=g).to(DEVICE, td)
    ds = torch.randn(rows, hidden, generator=g).to(DEVICE, td)
    return x, r, w, dy, ds


def _reference(x, r, w, dy, ds, eps, offset):
    """float64 (normed, s) and the gradients of <normed, dy> + <s, ds>."""
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (offset + wd)
    torch.autograd.backward((y, s), (dy.double(), ds.double()))
    return y, s, xd.grad, rd.grad, wd.grad


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("offset,casting", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_vs_float64(dtype, offset, casting, rows, hidden):
    eps = 0.02                  # comparable to the mean square of s (~0.08): ignoring it would show
    k = kernel_for(OP, "DecoderLayer", _facts(hidden, eps, offset, casting), dtype)
    x, r, w, dy, ds = _inputs(rows, hidden, dtype)
    xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = k.add_rmsnorm(xi, ri, wi)
    torch.autograd.backward((y, s), (dy, ds))
    ref = _reference(x, r, w, dy, ds, eps, offset)
    assert y.dtype == x.dtype and s.dtype == x.dtype and y.shape == x.shape
    # the new residual is exactly the rounded sum, as HF computes it (bf16 casts round to nearest
    # even on the GPU and, patched, under the interpreter: tests/kernel_support/test_interpreter_bf16_rounding.py)
    assert torch.equal(s, x + r)
    for o, rf, what in zip((y, s, xi.grad, ri.grad, wi.grad), ref, ("normed", "residual", "dx", "dresidual", "dw")):
        assert_close(o, rf, dtype, what)


def test_gradient_of_only_one_output():
    """Only the normed output used: dx = dresidual = the RMSNorm backward alone."""
    hidden = 1000
    k = kernel_for(OP, "DecoderLayer", _facts(hidden), "fp32")
    x, r, w, dy, ds = _inputs(4, hidden, "fp32", seed=1)
    xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
    y, _ = k.add_rmsnorm(xi, ri, wi)
    y.backward(dy)
    ref = _reference(x, r, w, dy, torch.zeros_like(ds), 1e-6, 0.0)
    assert_close(xi.grad, ref[2], "fp32", "dx")
    assert_close(ri.grad, ref[3], "fp32", "dresidual")
    assert_close(wi.grad, ref[4], "fp32", "dw")


def test_eps_flag_overrides_the_module():
    hidden = 1000
    k = kernel_for(OP, "DecoderLayer", _facts(hidden, 1e-6), "fp32", flags={"eps": 0.1})
    x, r, w, dy, ds = _inputs(3, hidden, "fp32", seed=2)
    y, _ = k.add_rmsnorm(x, r, w)
    assert_close(y, _reference(x, r, w, dy, ds, 0.1, 0.0)[0], "fp32", "y with eps=0.1")


# ---- the generated source ---------------------------------------------------------------------
def _source(hidden, target, dtype="bf16", **facts):
    op = get_op(OP)
    info = ModuleInfo("model.layers.0", "L", (), {"DecoderLayer": _facts(hidden, **facts)}, dtype=dtype)
    params = op.key_params(info, op.default_flags(), dtype, target)
    name = op.kernel_name(params)
    return name, render(KernelKey.make(op.name, op.template, name, params))


def _kernels_text(src):
    return src[src.index("def add_rmsnorm_fwd_"):src.index("def add_rmsnorm_dw_sum_")]


@pytest.mark.parametrize("target", ["cuda", "interpreter"])
def test_one_pass_power_of_two_has_no_loop_and_no_mask(target):
    name, src = _source(1024, target)
    body = _kernels_text(src)
    assert "for start in range" not in body and "mask=" not in body
    assert name == f"fused_add_rmsnorm_bf16_h1024_llama_{target}"
    compile(src, name, "exec")


def test_long_rows_loop_and_tails_mask():
    body = _kernels_text(_source(20000, "cuda")[1])
    assert body.count("for start in range(0, HIDDEN, BLOCK)") >= 4
    body = _kernels_text(_source(1000, "cuda")[1])
    assert "mask=" in body and "for start in range" not in body


def test_gemma_mode_is_compiled_in():
    _, llama = _source(1024, "cuda")
    name, gemma = _source(1024, "cuda", offset=1.0, casting="gemma")
    assert "(w + 1.0)" in _kernels_text(gemma) and "(w + 1.0)" not in _kernels_text(llama)
    assert "sn = (s * rstd[:, None]).to(S.dtype.element_ty)" in llama
    assert "sn =" not in gemma
    assert name == "fused_add_rmsnorm_bf16_h1024_gemma_off1_cuda"


# ---- decoder layers of tiny models ------------------------------------------------------------
FAMILIES = ["qwen3", "llama"]


def _randomise_norms(model):
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)


def _patch_layers(model):
    return [patch_module(layer, OP) for layer in model.model.layers]


def _ids(b=2, s=9, seed=0):
    return torch.randint(0, 320, (b, s), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_hf_fp32(family):
    ref = tiny_model(family).to(DEVICE)
    _randomise_norms(ref)
    model = copy.deepcopy(ref)
    handles = _patch_layers(model)
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    ids = _ids()
    o_ref = ref(input_ids=ids, labels=ids)
    o = model(input_ids=ids, labels=ids)
    o_ref.loss.backward()
    o.loss.backward()
    assert type(o.logits) is type(o_ref.logits)
    assert_close(o.logits, o_ref.logits, "fp32", "logits")
    for (n, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert_close(p.grad, p_ref.grad, "fp32", f"grad {n}", factor=3)
    for h in handles:
        h.undo()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def _layer_io(model, dtype, seed=0):
    """A decoder layer's inputs as the model passes them: hidden states, RoPE cos/sin, positions."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    h = torch.randn(2, 7, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])
    pos = torch.arange(7, device=DEVICE)[None].expand(2, 7)
    cos, sin = model.model.rotary_emb(h, pos)
    dy = torch.randn(2, 7, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])
    return h, pos, (cos, sin), dy


def _layer_run(layer, h, pos, pe, dy):
    hi = h.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(hi, attention_mask=None, position_ids=pos, position_embeddings=pe)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), hi.grad, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_layer_matches_hf(family, dtype):
    """One decoder layer: the patched layer is as close to a float64 run of HF's layer as HF's
    own layer in the same dtype is (and within the dtype tolerance), forward and backward."""
    model = tiny_model(family).to(DEVICE)
    _randomise_norms(model)
    layer64 = copy.deepcopy(model.model.layers[0]).double()
    layer = model.model.layers[0].to(TORCH_DTYPES[dtype])
    h, pos, pe, dy = _layer_io(model, dtype)
    ref64 = _layer_run(layer64, h.double(), pos, tuple(t.double() for t in pe), dy.double())
    pe = tuple(t.to(TORCH_DTYPES[dtype]) for t in pe)
    hf = _layer_run(layer, h, pos, pe, dy)
    with patch_module(layer, OP):
        ours = _layer_run(layer, h, pos, pe, dy)
    assert ours[0].dtype == hf[0].dtype and ours[0].shape == hf[0].shape
    pairs = [("out", ours[0], hf[0], ref64[0]), ("dh", ours[1], hf[1], ref64[1])]
    pairs += [(f"grad {n}", ours[2][n], hf[2][n], ref64[2][n]) for n in ref64[2]]
    k = 1.5
    for what, o, r, r64 in pairs:
        assert_close(o, r, dtype, f"{what} vs HF", factor=2)
        assert rel_err(o, r64) <= max(k * rel_err(r, r64), 0.25 * TOL_OF[dtype]), what


TOL_OF = {"fp32": 1e-5, "bf16": 1.6e-2, "fp16": 2e-3}


def test_arguments_pass_through_and_cache():
    """Generation-style call: the cache object reaches attention through the patched layer."""
    from transformers import DynamicCache

    ref = tiny_model("qwen3").to(DEVICE).eval()
    _randomise_norms(ref)
    model = copy.deepcopy(ref)
    _patch_layers(model)
    ids = _ids(b=1, s=6)
    with torch.no_grad():
        c_ref, c = DynamicCache(config=ref.config), DynamicCache(config=model.config)
        o_ref = ref(input_ids=ids, past_key_values=c_ref, use_cache=True)
        o = model(input_ids=ids, past_key_values=c, use_cache=True)
        assert c.get_seq_length() == c_ref.get_seq_length() == 6
        nxt = o_ref.logits[:, -1:].argmax(-1)
        o2_ref = ref(input_ids=nxt, past_key_values=c_ref, use_cache=True)
        o2 = model(input_ids=nxt, past_key_values=c, use_cache=True)
    assert_close(o.logits, o_ref.logits, "fp32", "prefill")
    assert_close(o2.logits, o2_ref.logits, "fp32", "decode step")


def test_positional_arguments_are_bound_like_the_original():
    model = tiny_model("llama").to(DEVICE)
    layer = model.model.layers[0]
    h, pos, pe, _ = _layer_io(model, "fp32")
    with torch.no_grad():
        ref = layer(h, None, pos, None, False, pe)          # the original signature's order
        with patch_module(layer, OP):
            out = layer(h, None, pos, None, False, pe)
    assert_close(out, ref, "fp32", "positional call")
    with torch.no_grad():
        ref = layer(h, position_embeddings=pe)               # the rest defaulted, as the original does
        with patch_module(layer, OP):
            out = layer(h, position_embeddings=pe)
    assert_close(out, ref, "fp32", "defaulted arguments")


def test_gradient_checkpointing_still_recomputes():
    ref = tiny_model("qwen3").to(DEVICE).train()
    _randomise_norms(ref)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _patch_layers(model)
    calls = {"n": 0}
    mlp = model.model.layers[0].mlp
    mlp_forward = type(mlp).forward

    def counting_forward(self, x):        # (module hooks do not fire during the recompute)
        calls["n"] += 1
        return mlp_forward(self, x)

    mlp.forward = types.MethodType(counting_forward, mlp)
    ids = _ids()
    o_ref = ref(input_ids=ids, labels=ids)
    o = model(input_ids=ids, labels=ids)
    assert calls["n"] == 1
    o_ref.loss.backward()
    o.loss.backward()
    del mlp.forward
    assert calls["n"] == 2          # the layer was recomputed in backward: checkpointing is active
    assert_close(o.loss, o_ref.loss, "fp32", "loss")
    for (n, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert_close(p.grad, p_ref.grad, "fp32", f"grad {n}", factor=3)


def test_autocast_mixed_dtypes():
    """fp32 weights under bf16 autocast: attention returns bf16, the residual stream is fp32."""
    ref = tiny_model("llama").to(DEVICE)
    _randomise_norms(ref)
    model = copy.deepcopy(ref)
    _patch_layers(model)
    ids = _ids()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        o_ref = ref(input_ids=ids, labels=ids)
        o = model(input_ids=ids, labels=ids)
    o_ref.loss.backward()
    o.loss.backward()
    assert o.logits.dtype == o_ref.logits.dtype
    assert_close(o.logits, o_ref.logits, "bf16", "logits")
    for (n, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert p.grad.dtype == p_ref.grad.dtype
        assert_close(p.grad, p_ref.grad, "bf16", f"grad {n}", factor=2)


def test_covers_post_attention_layernorm():
    assert get_op(OP).covers == ("post_attention_layernorm",)


# ---- refusals ---------------------------------------------------------------------------------
def _reason(module):
    op = get_op(OP)
    reason = op.check(module, build_index(module).infos[""], op.default_flags())
    if reason is not None:
        assert "\n" not in reason
        with pytest.raises(PatchError):
            patch_module(module, OP)
        assert "forward" not in module.__dict__
    return reason


def test_sandwich_layout_is_refused():
    model = tiny_model("gemma3")
    assert "sandwich" in _reason(model.model.layers[0])


def test_extra_submodule_in_forward_is_refused():
    model = tiny_model("phi3")          # residual dropouts around attention and MLP
    assert "resid_attn_dropout" in _reason(model.model.layers[0])


def test_not_a_decoder_layer_is_refused():
    assert "not a decoder layer" in _reason(torch.nn.Linear(8, 8))
    model = tiny_model("llama")
    assert "not a decoder layer" in _reason(model.model.layers[0].mlp)


def test_a_different_forward_is_refused():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class ScaledResidual(LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
            h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
            h = residual + 0.5 * h                   # not the plain residual add
            residual = h
            h = self.mlp(self.post_attention_layernorm(h))
            return residual + h

    class DropsAnArgument(LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
            h, _ = self.self_attn(hidden_states=h, attention_mask=None, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
            h = residual + h
            residual = h
            return residual + self.mlp(self.post_attention_layernorm(h))

    class ReturnsATuple(LlamaDecoderLayer):           # the transformers 4.x convention
        def forward(self, hidden_states, **kwargs):
            return (LlamaDecoderLayer.forward(self, hidden_states, **kwargs),)

    class VarArgs(LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            return LlamaDecoderLayer.forward(self, *args, **kwargs)

    cfg = tiny_model("llama").config
    assert "pre-norm pattern" in _reason(ScaledResidual(cfg, 0))
    assert "different arguments" in _reason(DropsAnArgument(cfg, 0))
    assert "returns tuple" in _reason(ReturnsATuple(cfg, 0))
    assert "is not (self, hidden_states" in _reason(VarArgs(cfg, 0))
    assert _reason(LlamaDecoderLayer(cfg, 0)) is None


@pytest.mark.parametrize("hidden", [1024, 1000, 2500])
def test_kernel_globals_are_constexpr(hidden):
    for offset, casting in VARIANTS:
        assert_kernel_globals_constexpr(min_kernels=3, mod=kernel_for(OP, "DecoderLayer", _facts(hidden, 1e-6, offset, casting), "bf16"))


def test_cuda_variants_compile_for_sm90(tmp_path):
    from .norm_compile import compile_for_sm90

    cases = [(_facts(1024), "bf16"), (_facts(1000, 1e-6, 1.0, "gemma"), "fp16"), (_facts(20000), "bf16"),
             (_facts(20000, 1e-6, 1.0, "gemma"), "fp32")]
    assert compile_for_sm90(tmp_path, OP, "DecoderLayer", cases) == 3 * len(cases)


def test_zero_rows_give_empty_outputs_and_zero_weight_grad():
    """An empty batch (0 rows) runs forward and backward: empty outputs, dW = 0 (was a 0 / 0 on the host)."""
    k = kernel_for(OP, "DecoderLayer", _facts(64), "fp32")
    x, r, w, dy, ds = _inputs(0, 64, "fp32")
    xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
    y, s = k.add_rmsnorm(xi, ri, wi)
    torch.autograd.backward((y, s), (dy, ds))
    assert y.shape == s.shape == (0, 64) and xi.grad.shape == (0, 64)
    assert torch.equal(wi.grad, torch.zeros_like(w))
