"""fused_rope's rotary layouts (issue 25): rotate_half, interleaved pairs (Cohere) and interleaved pairs with a
half-width cos (GLM), full and partial rotary, forward and backward against float64 on fresh random inputs;
the float64 reference against transformers' own apply_rotary_pos_emb of each family; the layout probe of a
model's function; and the cases that must fail (a kernel of one layout is not another layout's RoPE, a
function computing none of them is no layout).
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.model.forward.rotary import LAYOUTS, reference_rotary, rope_function_layout, rotate

from .helpers import rope_fwd_bwd as run
from .helpers import DEVICE, TORCH_DTYPES, assert_close, kernel_for, sizes

OP = "fused_rope"


def facts(d, r, nq, nk, layout, rope_input="head"):
    return {"head_dim": d, "rotary_dim": r, "n_heads": nq, "n_kv_heads": nk, "fused_qkv": False,
            "rotary_layout": layout, "rope_input": rope_input}


def inputs(b, s, nq, nk, d, r, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    q = torch.randn(b, s, nq, d, generator=g)
    k = torch.randn(b, s, nk, d, generator=g)
    ang = torch.randn(1, s, r, generator=g) * 3          # general angles: halves and pairs all differ
    dq, dk = torch.randn(b, s, nq, d, generator=g), torch.randn(b, s, nk, d, generator=g)
    return [t.to(dt).to(DEVICE) for t in (q, k, ang.cos(), ang.sin(), dq, dk)]


def ref64(q, k, cos, sin, dq, dk, layout):
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    qo, ko = reference_rotary(q64, k64, cos.double(), sin.double(), layout)
    torch.autograd.backward((qo, ko), (dq.double(), dk.double()))
    return qo.detach(), ko.detach(), q64.grad, k64.grad


# (batch, seq, q heads, kv heads, head_dim, rotary_dim, flags)
SHAPES = sizes(
    cpu=[
        (2, 3, 4, 2, 16, 16, {}),                  # full rotary, GQA
        (1, 4, 3, 1, 32, 16, {}),                  # partial 0.5 (GLM-4, Phi), 3 heads (masked)
        (2, 2, 4, 4, 32, 8, {"block": 16}),        # partial 0.25 (GPT-NeoX, StableLM), heads looped
        (1, 3, 2, 2, 24, 12, {}),                  # rotary half 6 (masked)
    ],
    gpu=[
        (4, 1024, 32, 2, 128, 64, {}),             # GLM-4-9B: 32 q / 2 kv heads, partial 0.5
        (4, 1024, 32, 8, 128, 128, {}),            # Command-R-like, full
        (4, 1000, 32, 32, 80, 20, {}),             # StableLM / GPT-NeoX partial 0.25
    ])
CASES = [(lay, shape, dt) for lay in LAYOUTS for shape in SHAPES for dt in ("fp32", "bf16")]


@pytest.mark.parametrize("layout,shape,dtype", CASES,
                         ids=[f"{c[0]}-d{c[1][4]}r{c[1][5]}q{c[1][2]}k{c[1][3]}-{c[2]}" for c in CASES])
def test_kernel_matches_float64(layout, shape, dtype):
    b, s, nq, nk, d, r, flags = shape
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk, layout), dtype, flags)
    seed = zlib.crc32(repr((layout, shape[:6], dtype)).encode()) % 10_000
    q, k, cos, sin, dq, dk = inputs(b, s, nq, nk, d, r, dtype, seed)
    rq, rk, rdq, rdk = ref64(q, k, cos, sin, dq, dk, layout)
    qo, ko, gq, gk = run(kern, q, k, cos, sin, dq, dk)
    assert qo.dtype == q.dtype and gq.dtype == q.dtype
    for out, ref, what in ((qo, rq, "q_out"), (ko, rk, "k_out"), (gq, rdq, "dq"), (gk, rdk, "dk")):
        assert_close(out, ref, dtype, f"{layout} {what}")
    if r < d:   # the pass-through dims are copied exactly, forward and backward
        assert torch.equal(qo[..., r:], q[..., r:]) and torch.equal(gk[..., r:], dk[..., r:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_kernel_is_no_other_layouts_rope(layout):
    """Must fail: each layout's kernel output is far from every other layout's reference (the layouts are
    truly different arithmetic, so a wrong specialisation would be caught by the test above)."""
    b, s, nq, nk, d, r = 1, 3, 2, 2, 16, 16
    kern = kernel_for(OP, "Attention", facts(d, r, nq, nk, layout), "fp32")
    q, k, cos, sin, _, _ = inputs(b, s, nq, nk, d, r, "fp32", 7)
    qo, _ = kern.rope(q, k, cos, sin)
    for other in LAYOUTS:
        ref, _ = reference_rotary(q.double(), k.double(), cos.double(), sin.double(), other)
        diff = (qo.double() - ref).abs().max().item()
        assert (diff < 1e-5) == (other == layout), (layout, other, diff)


@pytest.mark.parametrize("layout", ["interleaved", "interleaved_half_cos"])
def test_interleaved_layouts_specialise_the_source(layout):
    op = get_op(OP)

    def src(lay, d=128, r=64):
        info = ModuleInfo("attn", "Attn", (), {"Attention": facts(d, r, 32, 2, lay)})
        p = op.key_params(info, op.default_flags(), "bf16", "cuda")
        return render(KernelKey.for_op(op, p)), op.kernel_name(p)

    half, name_half = src("rotate_half")
    inter, name = src(layout)
    assert name == f"fused_rope_bf16_d128_r64_q32k2_{layout}_cuda" and name_half == "fused_rope_bf16_d128_r64_q32k2_cuda"
    assert "2 * d[None, :] + 1" in inter and "2 * d[None, :] + 1" not in half
    assert ("c2 = c1" in inter) == (layout == "interleaved_half_cos")


def test_rotary_input_makes_the_kernel_heads_rotary_dim_wide():
    """Phi / StableLM slice q to the rotary dims before apply_rotary_pos_emb: the kernel's heads are R wide."""
    op = get_op(OP)
    info = ModuleInfo("attn", "Attn", (), {"Attention": facts(32, 8, 4, 4, "rotate_half", "rotary")})
    p = op.key_params(info, op.default_flags(), "fp32", "interpreter")
    assert p["head_dim"] == p["rotary_dim"] == 8 and p["pass_dim"] == 0


# ---- the float64 reference is transformers' own arithmetic ---------------------------------------------
HF = [("llama", "rotate_half", 16), ("gpt_neox", "rotate_half", 8), ("glm4", "interleaved_half_cos", 8),
      ("glm", "interleaved_half_cos", 16), ("cohere", "interleaved", 16), ("phi", "rotate_half", 16)]


@pytest.mark.parametrize("family,layout,r", HF, ids=[h[0] for h in HF])
def test_reference_is_the_models_own_function(family, layout, r):
    fn = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    g = torch.Generator().manual_seed(len(family) * 31 + r)
    q, k = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64), torch.randn(2, 1, 5, 16, generator=g, dtype=torch.float64)
    ang = torch.randn(2, 5, r, generator=g, dtype=torch.float64)
    with torch.no_grad():
        hq, hk = fn(q, k, ang.cos(), ang.sin())
    rq, rk = reference_rotary(q.transpose(1, 2), k.transpose(1, 2), ang.cos(), ang.sin(), layout)
    tol = 1e-6 if family == "cohere" else 1e-12      # Cohere computes in float32 and casts back
    assert torch.allclose(hq, rq.transpose(1, 2), atol=tol) and torch.allclose(hk, rk.transpose(1, 2), atol=tol)
    assert rope_function_layout(fn)["layout"] == layout


def test_a_function_of_no_known_layout_is_none():
    def flipped(q, k, cos, sin, unsqueeze_dim=1):          # rotate_half with the sign of sin flipped
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return rotate(q, c, -s, "rotate_half"), rotate(k, c, -s, "rotate_half")

    def broken(q, k, cos, sin):
        raise RuntimeError("size mismatch")

    assert rope_function_layout(flipped) is None
    assert rope_function_layout(broken) is None
    assert rope_function_layout(None) is None
    with pytest.raises(ValueError, match="unknown rotary layout"):
        rotate(torch.zeros(4), torch.zeros(4), torch.zeros(4), "rotate_every_three")
