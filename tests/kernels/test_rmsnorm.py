"""fused_rmsnorm: kernel forward/backward vs float64, specialisation of the generated source,
and patching real (tiny) Qwen3 / Gemma 3 RMSNorm modules."""

from __future__ import annotations

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.index import build_index
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.runtime import PatchError, patch_module

from .helpers import assert_kernel_globals_constexpr, DEVICE, TORCH_DTYPES, assert_close, kernel_for, sizes

OP = "fused_rmsnorm"
DTYPES = ["fp32", "bf16", "fp16"]
# (offset, casting): Llama/Qwen, Gemma, and the uncommon mix (1 + w with Llama's cast order).
VARIANTS = [(0.0, "llama"), (1.0, "gemma"), (1.0, "llama"), (0.0, "gemma")]
# (rows, hidden): power of two in one block, non-power of two (masked tail), longer than one
# block (looped: the interpreter caps row blocks at 1024, the GPU at 16384), a single row.
SHAPES = sizes(cpu=[(5, 1024), (6, 1000), (3, 2500), (1, 96), (19, 64)],
               gpu=[(4096, 1024), (2049, 1000), (1000, 2880), (64, 20000), (1, 4096), (8193, 128)])


def reference(x, w, eps, offset):
    """float64 RMSNorm of the (already rounded) inputs."""
    xd, wd = x.double(), w.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (offset + wd)


def _inputs(rows, hidden, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * scale + 0.1).to(DEVICE, TORCH_DTYPES[dtype])
    w = (torch.randn(hidden, generator=g) * 0.5 + 0.3).to(DEVICE, TORCH_DTYPES[dtype])
    dy = torch.randn(rows, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])
    return x, w, dy


def to_bf16_as_triton(t):
    """fp32 -> bf16 the way the kernel's casts round: to nearest even, on the GPU and (patchdsl's
    fix of its truncation, tests/kernel_support/test_interpreter_bf16_rounding.py) under the interpreter."""
    return t.float().to(torch.bfloat16)


def _facts(hidden, eps=1e-6, offset=0.0, casting="llama"):
    return {"hidden": hidden, "eps": eps, "offset": offset, "casting": casting}


def _run(k, x, w, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = k.rmsnorm(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


def _ref_grads(x, w, dy, eps, offset):
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    yd = reference(xd, wd, eps, offset)
    yd.backward(dy.double())
    return yd, xd.grad, wd.grad


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("offset,casting", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_vs_float64(dtype, offset, casting, rows, hidden):
    # eps comparable to the mean square (inputs scaled to ~0.3), so ignoring it would show
    eps = 0.05
    k = kernel_for(OP, "RMSNorm", _facts(hidden, eps, offset, casting), dtype)
    x, w, dy = _inputs(rows, hidden, dtype, scale=0.3)
    y, dx, dw = _run(k, x, w, dy)
    yd, dxd, dwd = _ref_grads(x, w, dy, eps, offset)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, yd, dtype, "y")
    assert_close(dx, dxd, dtype, "dx")
    assert_close(dw, dwd, dtype, "dw")
    assert dw.dtype == w.dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_eps_is_the_flag(dtype):
    hidden = 1000
    x, w, dy = _inputs(4, hidden, dtype, seed=1, scale=0.2)
    k = kernel_for(OP, "RMSNorm", _facts(hidden, 1e-6), dtype, flags={"eps": 0.1})
    y, dx, _ = _run(k, x, w, dy)
    yd, dxd, _ = _ref_grads(x, w, dy, 0.1, 0.0)
    assert_close(y, yd, dtype, "y with eps=0.1")
    assert_close(dx, dxd, dtype, "dx with eps=0.1")
    # and it is not the module's eps
    y_wrong = reference(x, w, 1e-6, 0.0)
    assert (y.double() - y_wrong).norm() > 10 * (y.double() - yd).norm()


def test_three_dim_and_strided_input():
    hidden = 96
    k = kernel_for(OP, "RMSNorm", _facts(hidden), "fp32")
    g = torch.Generator().manual_seed(2)
    big = torch.randn(2, 5, 2 * hidden, generator=g).to(DEVICE)
    x = big[..., :hidden]                      # rows with a stride of 2 * hidden
    w = torch.randn(hidden, generator=g).to(DEVICE)
    y = k.rmsnorm(x, w)
    assert y.shape == (2, 5, hidden)
    assert_close(y, reference(x, w, 1e-6, 0.0), "fp32", "strided 3-D")


@pytest.mark.parametrize("casting,other", [("llama", "gemma"), ("gemma", "llama")])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_cast_order_is_compiled_in(casting, offset, other):
    """In bf16 the kernel reproduces its own cast order (nearly bit for bit), not the other one."""
    hidden = 1000
    x, w, _ = _inputs(8, hidden, "bf16", seed=3)
    y = kernel_for(OP, "RMSNorm", _facts(hidden, 1e-6, offset, casting), "bf16").rmsnorm(x, w)

    def emulate(cast):
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        if cast == "llama":
            return to_bf16_as_triton((offset + w.float()) * to_bf16_as_triton(n).float())
        return to_bf16_as_triton(n * (offset + w.float()))

    same = (y == emulate(casting)).float().mean().item()
    diff = (y == emulate(other)).float().mean().item()
    assert same > 0.99, same
    assert diff < same - 0.05, (same, diff)


# ---- the generated source ---------------------------------------------------------------------
def _source(hidden, target, dtype="bf16", offset=0.0, casting="llama", flags=None):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags or {})
    info = ModuleInfo("m", "M", (), {"RMSNorm": _facts(hidden, 1e-6, offset, casting)}, dtype=dtype)
    params = op.key_params(info, f, dtype, target)
    return op.kernel_name(params), render(KernelKey.for_op(op, params))


def _kernels_text(src):
    """The text of the row kernels (not the dW-sum helper, which always masks its tail)."""
    start = src.index("def rmsnorm_fwd_")
    return src[start:src.index("def rmsnorm_dw_sum_")]


@pytest.mark.parametrize("target", ["cuda", "interpreter"])
def test_one_pass_power_of_two_has_no_loop_and_no_mask(target):
    name, src = _source(1024, target)
    body = _kernels_text(src)
    assert "for start in range" not in body
    assert "mask=" not in body
    assert "one pass, no mask" in src
    assert name == f"fused_rmsnorm_bf16_h1024_llama_{target}"
    compile(src, name, "exec")


def test_non_power_of_two_masks_the_tail_without_looping():
    _, src = _source(1000, "cuda")
    body = _kernels_text(src)
    assert "mask=" in body and "cols < HIDDEN" in body
    assert "for start in range" not in body


@pytest.mark.parametrize("hidden,target", [(20000, "cuda"), (2500, "interpreter")])
def test_long_rows_loop(hidden, target):
    _, src = _source(hidden, target)
    body = _kernels_text(src)
    assert body.count("for start in range(0, HIDDEN, BLOCK)") >= 4   # 2 passes forward, 2 backward
    assert "looped in" in src


def test_modes_change_the_code():
    _, llama = _source(1024, "cuda", casting="llama")
    _, gemma = _source(1024, "cuda", casting="gemma")
    name, gemma1 = _source(1024, "cuda", offset=1.0, casting="gemma")
    assert ".to(tl.bfloat16).to(tl.float32)" in _kernels_text(llama)
    assert ".to(tl.bfloat16)" not in _kernels_text(gemma)
    assert "(w + 1.0)" in _kernels_text(gemma1) and "(w + 1.0)" not in _kernels_text(gemma)
    assert name == "fused_rmsnorm_bf16_h1024_gemma_off1_cuda"
    # short rows: the GPU kernels normalise a tile of several rows per program
    assert "ROWS = tl.constexpr(4)" in llama
    assert "ROWS = tl.constexpr(1)" in _source(4096, "cuda")[1]


def test_block_flag_forces_the_loop():
    _, src = _source(1024, "cuda", flags={"block": 256})
    assert "for start in range" in _kernels_text(src)


# ---- real modules ---------------------------------------------------------------------------
def _tiny(model_type, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=128,
                               **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


MODULES = {
    # name: (model_type, extra config, module path, expected offset, expected casting)
    "qwen3": ("qwen3", {}, "model.layers.0.input_layernorm", 0.0, "llama"),
    "qwen3_qnorm": ("qwen3", {}, "model.layers.0.self_attn.q_norm", 0.0, "llama"),
    "gemma3": ("gemma3_text", {"query_pre_attn_scalar": 24}, "model.layers.0.post_feedforward_layernorm", 1.0, "gemma"),
}


def _module_fwd_bwd(norm, x, dy):
    """(y, dx, dw) of one forward + backward of the module ``norm`` on a fresh copy of ``x``."""
    xi = x.clone().requires_grad_()
    norm.weight.grad = None
    y = norm(xi)
    y.backward(dy)
    return y.detach(), xi.grad, norm.weight.grad.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODULES))
def test_patched_module_matches_hf(name, dtype):
    model_type, extra, path, offset, casting = MODULES[name]
    model = _tiny(model_type, **extra)
    norm = model.get_submodule(path).to(DEVICE, TORCH_DTYPES[dtype])
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)      # HF initialises to ones (or zeros for Gemma): make it matter
    facts = build_index(norm).infos[""].facts("RMSNorm")
    assert (facts["offset"], facts["casting"]) == (offset, casting)   # detected by the probe
    hidden = facts["hidden"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])
    dy = torch.randn(2, 7, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])

    ref = _module_fwd_bwd(norm, x, dy)
    handle = patch_module(norm, OP)
    try:
        assert "forward" in norm.__dict__          # the instance was patched, not the class
        out = _module_fwd_bwd(norm, x, dy)
    finally:
        handle.undo()
    assert "forward" not in norm.__dict__
    for o, r, what in zip(out, ref, ("y", "dx", "dw")):
        assert o.dtype == r.dtype, what
        assert_close(o, r, dtype, f"{name} {what}")
    if dtype == "bf16":
        # same cast order as HF and the same rounding: the forward is (nearly) bit-identical
        assert (out[0] == ref[0]).float().mean().item() > 0.99


def test_not_an_rmsnorm_is_refused():
    op = get_op(OP)
    for module in (torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)):
        info = build_index(module).infos[""]
        reason = op.check(module, info, op.default_flags())
        assert reason and "not an RMSNorm" in reason and "\n" not in reason
        with pytest.raises(PatchError, match="not an RMSNorm"):
            patch_module(module, OP)
        assert "forward" not in module.__dict__


class _Bf16ComputeRMSNorm(torch.nn.Module):
    """Normalises in the input dtype (no fp32 upcast): matches neither HF cast order in bf16."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_unknown_cast_order_is_refused_unless_forced():
    module = _Bf16ComputeRMSNorm(64)
    info = build_index(module).infos[""]
    assert info.facts("RMSNorm")["casting"] == "unknown"
    op = get_op(OP)
    reason = op.check(module, info, op.default_flags())
    assert reason and "cast order" in reason
    handle = patch_module(module, OP, casting="gemma")
    handle.undo()


def test_fp32_weight_with_bf16_input_follows_hf_promotion():
    """Mixed precision (fp32 master weight, bf16 activations): HF Llama/Qwen returns fp32 here."""
    model = _tiny("qwen3")
    norm = model.get_submodule("model.layers.0.input_layernorm").to(DEVICE)        # fp32 weight
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 96, generator=g).to(DEVICE, torch.bfloat16)
    dy = torch.randn(3, 5, 96, generator=g).to(DEVICE, torch.float32)

    ref = _module_fwd_bwd(norm, x, dy)
    with patch_module(norm, OP):
        out = _module_fwd_bwd(norm, x, dy)
    assert out[0].dtype == ref[0].dtype == torch.float32
    assert out[1].dtype == torch.bfloat16 and out[2].dtype == torch.float32
    for o, r, what in zip(out, ref, ("y", "dx", "dw")):
        assert_close(o, r, "bf16", what)


@pytest.mark.parametrize("hidden", [1024, 1000, 2500])
def test_kernel_globals_are_constexpr(hidden):
    for offset, casting in VARIANTS:
        assert_kernel_globals_constexpr(min_kernels=3, mod=kernel_for(OP, "RMSNorm", _facts(hidden, 1e-6, offset, casting), "bf16"))


def test_cuda_variants_compile_for_sm90(tmp_path):
    from .norm_compile import compile_for_sm90

    cases = [(_facts(1024, 1e-6, 0.0, "llama"), "bf16"), (_facts(1000, 1e-6, 1.0, "gemma"), "fp16"),
             (_facts(4096, 1e-6, 0.0, "llama"), "fp32"), (_facts(20000, 1e-6, 1.0, "llama"), "bf16"),
             (_facts(128, 1e-6, 0.0, "gemma"), "bf16")]
    assert compile_for_sm90(tmp_path, OP, "RMSNorm", cases) == 3 * len(cases)
