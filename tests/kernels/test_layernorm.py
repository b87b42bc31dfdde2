"""fused_layernorm: kernel forward/backward (dx, dW, dB) vs float64, specialisation of the
generated source, and patching nn.LayerNorm modules."""

from __future__ import annotations

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.index import build_index
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.runtime import PatchError, patch_module

from .helpers import assert_kernel_globals_constexpr, DEVICE, TORCH_DTYPES, assert_close, kernel_for, sizes

OP = "fused_layernorm"
DTYPES = ["fp32", "bf16", "fp16"]
SHAPES = sizes(cpu=[(5, 1024), (6, 1000), (3, 2500), (1, 96), (19, 64)],
               gpu=[(4096, 1024), (2049, 1000), (1000, 2880), (64, 20000), (1, 4096), (8193, 128)])


def _inputs(rows, hidden, dtype, bias, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    td = TORCH_DTYPES[dtype]
    x = (torch.randn(rows, hidden, generator=g) * scale + 0.7).to(DEVICE, td)     # non-zero mean
    w = (torch.randn(hidden, generator=g) * 0.5 + 0.3).to(DEVICE, td)
    b = torch.randn(hidden, generator=g).to(DEVICE, td) if bias else None
    dy = torch.randn(rows, hidden, generator=g).to(DEVICE, td)
    return x, w, b, dy


def _run(k, x, w, b, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    args = (x, w)
    if b is not None:
        b = b.clone().requires_grad_()
        args = (x, w, b)
    y = k.layernorm(*args)
    y.backward(dy)
    return y, x.grad, w.grad, (b.grad if b is not None else None)


def _ref(x, w, b, dy, eps):
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if b is not None else None
    yd = torch.nn.functional.layer_norm(xd, (x.shape[-1],), wd, bd, eps)
    yd.backward(dy.double())
    return yd, xd.grad, wd.grad, (bd.grad if bd is not None else None)


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_vs_float64(dtype, bias, rows, hidden):
    eps = 0.05          # comparable to the variance of inputs scaled to ~0.3: ignoring it would show
    k = kernel_for(OP, "LayerNorm", {"hidden": hidden, "eps": eps, "bias": bias}, dtype)
    x, w, b, dy = _inputs(rows, hidden, dtype, bias, scale=0.3)
    out = _run(k, x, w, b, dy)
    ref = _ref(x, w, b, dy, eps)
    assert out[0].shape == x.shape and out[0].dtype == x.dtype   # output in the input dtype
    for o, r, what in zip(out, ref, ("y", "dx", "dw", "db")):
        if r is None:
            assert o is None
            continue
        assert_close(o, r, dtype, what)
    assert out[2].dtype == w.dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_eps_is_the_flag(dtype):
    hidden = 1000
    x, w, b, dy = _inputs(4, hidden, dtype, True, seed=1, scale=0.2)
    k = kernel_for(OP, "LayerNorm", {"hidden": hidden, "eps": 1e-5, "bias": True}, dtype, flags={"eps": 0.1})
    out = _run(k, x, w, b, dy)
    ref = _ref(x, w, b, dy, 0.1)
    assert_close(out[0], ref[0], dtype, "y with eps=0.1")
    assert_close(out[1], ref[1], dtype, "dx with eps=0.1")
    wrong = _ref(x, w, b, dy, 1e-5)[0]
    assert (out[0].double() - wrong).norm() > 10 * (out[0].double() - ref[0]).norm()


def test_no_bias_kernel_rejects_a_bias():
    k = kernel_for(OP, "LayerNorm", {"hidden": 64, "eps": 1e-5, "bias": False}, "fp32")
    x, w, b, _ = _inputs(2, 64, "fp32", True)
    with pytest.raises(ValueError, match="without a bias"):
        k.layernorm(x, w, b)


def test_large_mean_is_stable():
    """Two-pass variance: rows with a large common offset still normalise accurately in fp32."""
    hidden = 2500         # looped on the interpreter
    k = kernel_for(OP, "LayerNorm", {"hidden": hidden, "eps": 1e-5, "bias": True}, "fp32")
    x, w, b, dy = _inputs(3, hidden, "fp32", True, seed=4)
    x = x + 300.0
    out = _run(k, x, w, b, dy)
    ref = _ref(x, w, b, dy, 1e-5)
    assert_close(out[0], ref[0], "fp32", "y", factor=5)
    assert_close(out[1], ref[1], "fp32", "dx", factor=50)   # dx of an offset row amplifies rounding of x itself


# ---- the generated source ---------------------------------------------------------------------
def _source(hidden, target, bias=True, dtype="bf16", flags=None):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags or {})
    info = ModuleInfo("m", "M", (), {"LayerNorm": {"hidden": hidden, "eps": 1e-5, "bias": bias}}, dtype=dtype)
    params = op.key_params(info, f, dtype, target)
    return op.kernel_name(params), render(KernelKey.for_op(op, params))


def _kernels_text(src):
    return src[src.index("def layernorm_fwd_"):src.index("def layernorm_param_sum_")]


@pytest.mark.parametrize("target", ["cuda", "interpreter"])
def test_one_pass_power_of_two_has_no_loop_and_no_mask(target):
    name, src = _source(1024, target)
    body = _kernels_text(src)
    assert "for start in range" not in body and "mask=" not in body
    assert name == f"fused_layernorm_bf16_h1024_bias_{target}"
    compile(src, name, "exec")


def test_tail_and_loop_variants():
    body = _kernels_text(_source(1000, "cuda")[1])
    assert "mask=" in body and "for start in range" not in body
    body = _kernels_text(_source(20000, "cuda")[1])
    assert body.count("for start in range(0, HIDDEN, BLOCK)") >= 5     # 3 passes forward, 2 backward


def test_bias_is_compiled_in():
    name, with_b = _source(1024, "cuda", bias=True)
    name2, without = _source(1024, "cuda", bias=False)
    assert "y = y + b[None, :]" in _kernels_text(with_b) and "db +=" in _kernels_text(with_b)
    assert " b = " not in _kernels_text(without) and "db" not in _kernels_text(without)
    assert name2 == "fused_layernorm_bf16_h1024_nobias_cuda"


# ---- real modules ---------------------------------------------------------------------------
class NoBiasLayerNorm(torch.nn.Module):
    """A LayerNorm without bias written the way model code does (``bias`` a plain None)."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.bias = None
        self.eps = eps

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


def _layernorm(kind, hidden):
    if kind == "nn_bias":
        return torch.nn.LayerNorm(hidden, eps=1e-5)
    if kind == "nn_nobias":
        return torch.nn.LayerNorm(hidden, eps=1e-5, bias=False)
    return NoBiasLayerNorm(hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [
    "nn_bias", "custom_nobias", "nn_nobias",
])
def test_patched_layernorm_matches_torch(kind, dtype):
    hidden = 96
    ln = _layernorm(kind, hidden).to(DEVICE, TORCH_DTYPES[dtype])
    bias = ln.bias is not None
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.5)
        if bias:
            ln.bias.normal_(0.0, 0.5)
    facts = build_index(ln).infos[""].facts("LayerNorm")
    assert facts == {"hidden": hidden, "eps": 1e-5, "bias": bias}
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 5, hidden, generator=g) + 0.5).to(DEVICE, TORCH_DTYPES[dtype])
    dy = torch.randn(2, 5, hidden, generator=g).to(DEVICE, TORCH_DTYPES[dtype])

    def run():
        xi = x.clone().requires_grad_()
        ln.zero_grad(set_to_none=True)
        y = ln(xi)
        y.backward(dy)
        return [y.detach(), xi.grad, ln.weight.grad] + ([ln.bias.grad] if bias else [])

    ref = run()
    with patch_module(ln, OP):
        assert "forward" in ln.__dict__
        out = run()
    assert "forward" not in ln.__dict__
    for o, r, what in zip(out, ref, ("y", "dx", "dw", "db")):
        assert o.dtype == r.dtype
        assert_close(o, r, dtype, what)


def test_modules_that_are_not_layernorms_are_refused():
    op = get_op(OP)

    class RMS(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(16))
            self.eps = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    for module in (torch.nn.Linear(16, 16), RMS(), torch.nn.LayerNorm(16, elementwise_affine=False)):
        info = build_index(module).infos[""]
        reason = op.check(module, info, op.default_flags())
        assert reason and "not a LayerNorm" in reason and "\n" not in reason, type(module)
        with pytest.raises(PatchError, match="not a LayerNorm"):
            patch_module(module, OP)


@pytest.mark.parametrize("hidden", [1024, 1000, 2500])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_globals_are_constexpr(hidden, bias):
    assert_kernel_globals_constexpr(min_kernels=3, mod=kernel_for(OP, "LayerNorm", {"hidden": hidden, "eps": 1e-5, "bias": bias}, "bf16"))


def test_cuda_variants_compile_for_sm90(tmp_path):
    from .norm_compile import compile_for_sm90

    cases = [({"hidden": h, "eps": 1e-5, "bias": b}, dt)
             for h, b, dt in ((1024, True, "bf16"), (1000, False, "fp16"), (20000, True, "fp32"), (20000, False, "bf16"))]
    assert compile_for_sm90(tmp_path, OP, "LayerNorm", cases) == 3 * len(cases)


@pytest.mark.parametrize("bias", [True, False])
def test_zero_rows_give_empty_outputs_and_zero_param_grads(bias):
    """An empty batch (0 rows) runs forward and backward: dW (and dB) = 0 (was a 0 / 0 on the host)."""
    k = kernel_for(OP, "LayerNorm", {"hidden": 64, "eps": 1e-5, "bias": bias}, "fp32")
    x, w, b, dy = _inputs(0, 64, "fp32", bias)
    y, dx, dw, db = _run(k, x, w, b, dy)
    assert y.shape == dx.shape == (0, 64)
    assert torch.equal(dw, torch.zeros_like(w))
    if bias:
        assert torch.equal(db, torch.zeros_like(b))
