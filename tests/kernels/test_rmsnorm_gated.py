"""fused_rmsnorm_gated (issue 25): the gated RMSNorm of linear-attention layers, judged against float64.

Table-driven over the two cast orders (Qwen3-Next's llama order, Kimi Linear's all-fp32 order), both gate
activations, masked and unmasked rows, fp32 / bf16, on fresh random inputs: forward, dx, dgate and dW.
The cases that must fail: a kernel built for the other activation, a gate of another shape (and, in
tests/runtime/test_mutations.py, kernels with a term of the backward dropped).
"""

from __future__ import annotations

import pytest
import torch

from .helpers import DEVICE, TORCH_DTYPES, assert_close, assert_kernel_globals_constexpr, kernel_for, rel_err, sizes

# (hidden, activation, casting): 64 fills its block; 48 leaves a masked tail of 16
CASES = [(64, "silu", "llama"), (48, "silu", "llama"), (64, "sigmoid", "gemma"), (48, "silu", "gemma")]
DTYPES = ["fp32", "bf16"]
ROWS = sizes([(3, 7)], [(16, 2048)])[0]      # rows x heads of a layer: tiny on the interpreter, real on the GPU


def _facts(hidden, activation, casting):
    return {"hidden": hidden, "eps": 1e-6, "activation": activation, "casting": casting}


def _act(name):
    return {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[name]


def reference(x, g, w, activation, eps=1e-6):
    """float64: x / rms(x) * w * act(g)."""
    x, g, w = (t.double() for t in (x, g, w))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w * _act(activation)(g)


def _inputs(hidden, dtype, seed, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    x = torch.randn(*rows, hidden, generator=gen).to(dt)
    g = (torch.randn(*rows, hidden, generator=gen) * 2).to(dt)
    w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dt)
    dy = torch.randn(*rows, hidden, generator=gen).to(dt)
    return tuple(t.to(DEVICE) for t in (x, g, w, dy))


def _run(fn, x, g, w, dy):
    xs, gs, ws = (t.clone().requires_grad_(True) for t in (x, g, w))
    y = fn(xs, gs, ws)
    y.backward(dy.to(y.dtype))
    return y.detach(), xs.grad, gs.grad, ws.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,activation,casting", CASES)
def test_gated_rmsnorm_matches_float64(hidden, activation, casting, dtype):
    mod = kernel_for("fused_rmsnorm_gated", "GatedRMSNorm", _facts(hidden, activation, casting), dtype)
    assert_kernel_globals_constexpr(mod, min_kernels=3)
    for seed in (0, 1):                      # fresh inputs each time
        x, g, w, dy = _inputs(hidden, dtype, seed)
        got = _run(mod.rmsnorm_gated, x, g, w, dy)
        ref = _run(lambda a, b, c: reference(a, b, c, activation), x.double(), g.double(), w.double(), dy.double())
        assert got[0].dtype == x.dtype and got[1].dtype == x.dtype and got[2].dtype == g.dtype
        for name, a, r in zip(("y", "dx", "dgate", "dw"), got, ref):
            # dW sums every row's products: a bf16 result rounds once more than the row outputs
            assert_close(a, r, dtype, f"{casting}/{activation} h{hidden} {name}", factor=2.0 if name == "dw" else 1.0)


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_gated_rmsnorm_bf16_forward_is_the_modules_cast_order(casting):
    """In bf16 the forward is bit-exact with the module's own order (rounding points included) save for
    the last bit of a few elements (sigmoid's fp32 rounding): the other cast order differs far more."""
    x, g, w, _ = _inputs(64, "bf16", 5, rows=(16,))
    n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    a = torch.nn.functional.silu(g.float())
    want = {"llama": ((w * n.to(torch.bfloat16)) * a).to(torch.bfloat16),
            "gemma": (w.float() * n * a).to(torch.bfloat16)}
    mod = kernel_for("fused_rmsnorm_gated", "GatedRMSNorm", _facts(64, "silu", casting), "bf16")
    y = mod.rmsnorm_gated(x, g, w)
    same = (y == want[casting]).float().mean().item()
    assert same > 0.97, same


def test_wrong_activation_fails():
    """The case that must fail: a sigmoid-gated kernel on a silu-gated reference."""
    mod = kernel_for("fused_rmsnorm_gated", "GatedRMSNorm", _facts(64, "sigmoid", "gemma"), "fp32")
    x, g, w, _ = _inputs(64, "fp32", 3)
    assert rel_err(mod.rmsnorm_gated(x, g, w), reference(x, g, w, "silu")) > 0.1


def test_gate_of_another_shape_is_refused():
    mod = kernel_for("fused_rmsnorm_gated", "GatedRMSNorm", _facts(64, "silu", "llama"), "fp32")
    x, g, w, _ = _inputs(64, "fp32", 4)
    with pytest.raises(ValueError, match="gate"):
        mod.rmsnorm_gated(x, g[:, :1], w)


def test_noncontiguous_inputs():
    mod = kernel_for("fused_rmsnorm_gated", "GatedRMSNorm", _facts(48, "silu", "llama"), "fp32")
    x, g, w, dy = _inputs(48, "fp32", 6, rows=(7, 3))
    x, g, dy = x.transpose(0, 1), g.transpose(0, 1), dy.transpose(0, 1)
    got = _run(mod.rmsnorm_gated, x, g, w, dy)
    ref = _run(lambda a, b, c: reference(a, b, c, "silu"), x.double(), g.double(), w.double(), dy.double())
    for name, a, r in zip(("y", "dx", "dgate", "dw"), got, ref):
        assert_close(a, r, "fp32", name)
