"""The host code of the norm / GLU / RoPE forwards and backwards on every input layout it branches on.

A contiguous input is handed to the kernels as it is (its rows are ``hidden`` apart, no 2-D view is
built) and the outputs are allocated in the input's shape; anything else goes through ``_rows`` (a
2-D view with the row stride, or a copy).  Each case below runs one op forward and backward on
one layout (the gradient given in the same layout) and compares with float64, and checks that the
outputs are contiguous in the input's shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from patchdsl.model.reference import reference_rope

from .helpers import DEVICE, assert_close, kernel_for

H = 64        # one unmasked block: cheap on the interpreter; the branches are in the host code


def _filled(t, g):
    return t.copy_(torch.randn(t.shape, generator=g))


def layout(name, shape, g, last=None):
    """A float32 tensor of ``shape`` (..., last dim) laid out as ``name``; a leaf of that layout."""
    *lead, n = shape
    if name == "contiguous":
        t = torch.randn(shape, generator=g)
    elif name == "size-1 dim, odd stride":      # contiguous by torch's rule (size-1 strides ignored)
        assert lead[0] == 1
        st = [0] * len(shape)
        acc = 1
        for i in range(len(shape) - 1, -1, -1):
            st[i] = acc
            acc *= shape[i]
        st[0] = 7
        t = _filled(torch.empty_strided(shape, st), g)
        assert t.is_contiguous() and t.stride(0) == 7
    elif name == "strided rows":                # slice of a wider last dim: no copy, row stride 2n
        t = torch.randn(*lead, 2 * n, generator=g)[..., :n]
    elif name == "permuted":                    # rows not evenly spaced: reshape copies
        t = torch.randn(lead[1], lead[0], *lead[2:], n, generator=g).transpose(0, 1)
    elif name == "strided columns":             # column stride 2: a copy
        t = torch.randn(*lead, 2 * n, generator=g)[..., ::2]
    else:
        raise AssertionError(name)
    assert t.shape == shape
    return t.to(DEVICE).detach().requires_grad_()


ROW_LAYOUTS = [("contiguous", (12, H)), ("contiguous", (2, 5, H)), ("contiguous", (H,)),
               ("size-1 dim, odd stride", (1, 6, H)), ("strided rows", (3, 4, H)),
               ("permuted", (3, 4, H)), ("strided columns", (2, 3, H))]
IDS = [f"{n}-{'x'.join(map(str, s))}" for n, s in ROW_LAYOUTS]


def _grads(out, inputs, douts):
    return torch.autograd.grad(out, inputs, douts)


def _check_out(y, shape, what):
    assert y.shape == shape, f"{what}: shape {tuple(y.shape)} != {tuple(shape)}"
    assert y.is_contiguous(), what


def _rms64(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _as64(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


@pytest.mark.parametrize("name,shape", ROW_LAYOUTS, ids=IDS)
def test_rmsnorm(name, shape):
    k = kernel_for("fused_rmsnorm", "RMSNorm", {"hidden": H, "eps": 1e-6, "offset": 0.0, "casting": "llama"}, "fp32")
    g = torch.Generator().manual_seed(1)
    x, dy = layout(name, shape, g), layout(name, shape, g)
    w = torch.randn(H, generator=g).to(DEVICE).requires_grad_()
    y = k.rmsnorm(x, w)
    _check_out(y, shape, "y")
    dx, dw = _grads(y, (x, w), dy)
    _check_out(dx, shape, "dx")
    x6, w6 = _as64(x, w)
    y6 = _rms64(x6, w6)
    dx6, dw6 = _grads(y6, (x6, w6), dy.double())
    for a, b, what in ((y, y6, "y"), (dx, dx6, "dx"), (dw, dw6, "dw")):
        assert_close(a, b, "fp32", f"rmsnorm {name} {what}")


@pytest.mark.parametrize("name,shape", ROW_LAYOUTS, ids=IDS)
def test_add_rmsnorm(name, shape):
    k = kernel_for("fused_add_rmsnorm", "DecoderLayer",
                   {"hidden": H, "eps": 1e-6, "offset": 0.0, "casting": "llama", "layout": "prenorm"}, "fp32")
    g = torch.Generator().manual_seed(2)
    x, r, dy, ds = (layout(name, shape, g) for _ in range(4))
    w = torch.randn(H, generator=g).to(DEVICE).requires_grad_()
    y, s = k.add_rmsnorm(x, r, w)
    _check_out(y, shape, "y")
    _check_out(s, shape, "s")
    dx, dr, dw = _grads((y, s), (x, r, w), (dy, ds))
    _check_out(dx, shape, "dx")
    x6, r6, w6 = _as64(x, r, w)
    s6 = x6 + r6
    y6 = _rms64(s6, w6)
    dx6, dr6, dw6 = _grads((y6, s6), (x6, r6, w6), (dy.double(), ds.double()))
    for a, b, what in ((y, y6, "y"), (s, s6, "s"), (dx, dx6, "dx"), (dr, dr6, "dr"), (dw, dw6, "dw")):
        assert_close(a, b, "fp32", f"add_rmsnorm {name} {what}")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name,shape", ROW_LAYOUTS, ids=IDS)
def test_layernorm(name, shape, bias):
    k = kernel_for("fused_layernorm", "LayerNorm", {"hidden": H, "eps": 1e-5, "bias": bias}, "fp32")
    g = torch.Generator().manual_seed(3)
    x, dy = layout(name, shape, g), layout(name, shape, g)
    w = torch.randn(H, generator=g).to(DEVICE).requires_grad_()
    b = torch.randn(H, generator=g).to(DEVICE).requires_grad_() if bias else None
    params = (w, b) if bias else (w,)
    y = k.layernorm(x, w, b)
    _check_out(y, shape, "y")
    got = _grads(y, (x, *params), dy)
    _check_out(got[0], shape, "dx")
    x6, *p6 = _as64(x, *params)
    y6 = F.layer_norm(x6, (H,), *p6, eps=1e-5)
    want = _grads(y6, (x6, *p6), dy.double())
    assert_close(y, y6, "fp32", f"layernorm {name} y")
    for a, b6, what in zip(got, want, ("dx", "dw", "db")):
        assert_close(a, b6, "fp32", f"layernorm {name} {what}")


GLU_LAYOUTS = [("contiguous", (12, 48)), ("contiguous", (2, 5, 48)), ("size-1 dim, odd stride", (1, 6, 48)),
               ("strided rows", (3, 4, 48)), ("permuted", (3, 4, 48))]
GLU_IDS = [f"{n}-{'x'.join(map(str, s))}" for n, s in GLU_LAYOUTS]


@pytest.mark.parametrize("layout_", ["rows", "flat"])
@pytest.mark.parametrize("name,shape", GLU_LAYOUTS, ids=GLU_IDS)
def test_glu_separate(name, shape, layout_):
    inter = shape[-1]
    f = {"hidden": 32, "intermediate": inter, "fused_gate_up": False, "bias": False, "activation": "silu"}
    k = kernel_for("fused_swiglu", "SwiGLU", f, "fp32", {"block": 64} if layout_ == "rows" else None)  # block: rows layout
    g = torch.Generator().manual_seed(4)
    gate, up, dy = (layout(name, shape, g) for _ in range(3))
    out = k.glu(gate, up)
    _check_out(out, shape, "out")
    dg, du = _grads(out, (gate, up), dy)
    g6, u6 = _as64(gate, up)
    o6 = F.silu(g6) * u6
    dg6, du6 = _grads(o6, (g6, u6), dy.double())
    for a, b, what in ((out, o6, "out"), (dg, dg6, "d_gate"), (du, du6, "d_up")):
        assert_close(a, b, "fp32", f"swiglu {name} {what}")


@pytest.mark.parametrize("name,shape", GLU_LAYOUTS, ids=GLU_IDS)
def test_glu_fused_gate_up(name, shape):
    inter = shape[-1] // 2
    f = {"hidden": 32, "intermediate": inter, "fused_gate_up": True, "bias": False, "activation": "silu"}
    k = kernel_for("fused_swiglu", "SwiGLU", f, "fp32")
    g = torch.Generator().manual_seed(5)
    gu = layout(name, shape, g)
    oshape = (*shape[:-1], inter)
    dy = layout(name, oshape, g)
    out = k.glu(gu)
    _check_out(out, oshape, "out")
    (dgu,) = _grads(out, (gu,), dy)
    _check_out(dgu, shape, "d_gate_up")
    (gu6,) = _as64(gu)
    o6 = F.silu(gu6[..., :inter]) * gu6[..., inter:]
    (dgu6,) = _grads(o6, (gu6,), dy.double())
    assert_close(out, o6, "fp32", f"swiglu gate_up {name} out")
    assert_close(dgu, dgu6, "fp32", f"swiglu gate_up {name} d_gate_up")


# q / k: (batch, seq, heads, head_dim) as HF hands them over (or as they are made contiguous)
B, S, NQ, NK, D = 2, 3, 4, 2, 64
HEAD_LAYOUTS = ["contiguous", "transposed", "slice of qkv", "size-1 batch, odd stride"]


def head_layout(name, nh, g):
    if name == "contiguous":
        t = torch.randn(B, S, nh, D, generator=g)
    elif name == "transposed":                 # (batch, heads, seq, dim).transpose(1, 2)
        t = torch.randn(B, nh, S, D, generator=g).transpose(1, 2)
    elif name == "slice of qkv":
        t = torch.randn(B, S, nh + 3, D, generator=g)[:, :, 1:nh + 1]
    else:
        t = _filled(torch.empty_strided((1, S, nh, D), (5, nh * D, D, 1)), g)
    return t.to(DEVICE).detach().requires_grad_()


def _cos_sin(g, bsz):
    ang = torch.randn(1, S, D, generator=g) * 3
    return ang.cos().to(DEVICE), ang.sin().to(DEVICE)


@pytest.mark.parametrize("name", HEAD_LAYOUTS)
def test_rope(name):
    att = {"head_dim": D, "rotary_dim": D, "n_heads": NQ, "n_kv_heads": NK, "fused_qkv": False}
    kern = kernel_for("fused_rope", "Attention", att, "fp32")
    g = torch.Generator().manual_seed(6)
    q, k = head_layout(name, NQ, g), head_layout(name, NK, g)
    dq_o, dk_o = head_layout(name, NQ, g), head_layout(name, NK, g)
    cos, sin = _cos_sin(g, q.shape[0])
    qo, ko = kern.rope(q, k, cos, sin)
    _check_out(qo, q.shape, "q_rot")
    _check_out(ko, k.shape, "k_rot")
    dq, dk = _grads((qo, ko), (q, k), (dq_o, dk_o))
    q6, k6 = _as64(q, k)
    qo6, ko6 = reference_rope(q6, k6, cos.double(), sin.double())
    dq6, dk6 = _grads((qo6, ko6), (q6, k6), (dq_o.double(), dk_o.double()))
    for a, b, what in ((qo, qo6, "q_rot"), (ko, ko6, "k_rot"), (dq, dq6, "dq"), (dk, dk6, "dk")):
        assert_close(a, b, "fp32", f"rope {name} {what}")


@pytest.mark.parametrize("name", HEAD_LAYOUTS)
def test_qk_norm_rope(name):
    att = {"head_dim": D, "rotary_dim": D, "n_heads": NQ, "n_kv_heads": NK, "fused_qkv": False,
           "qk_norm": {"eps": 1e-6, "offset": 0.0, "casting": "llama"}}
    kern = kernel_for("fused_qk_norm_rope", "Attention", att, "fp32")
    g = torch.Generator().manual_seed(7)
    q, k = head_layout(name, NQ, g), head_layout(name, NK, g)
    dq_o, dk_o = head_layout(name, NQ, g), head_layout(name, NK, g)
    wq = torch.randn(D, generator=g).to(DEVICE).requires_grad_()
    wk = torch.randn(D, generator=g).to(DEVICE).requires_grad_()
    cos, sin = _cos_sin(g, q.shape[0])
    qo, ko = kern.qk_norm_rope(q, k, wq, wk, cos, sin)
    _check_out(qo, q.shape, "q_out")
    _check_out(ko, k.shape, "k_out")
    got = _grads((qo, ko), (q, k, wq, wk), (dq_o, dk_o))
    q6, k6, wq6, wk6 = _as64(q, k, wq, wk)
    qo6, ko6 = reference_rope(_rms64(q6, wq6), _rms64(k6, wk6), cos.double(), sin.double())
    want = _grads((qo6, ko6), (q6, k6, wq6, wk6), (dq_o.double(), dk_o.double()))
    assert_close(qo, qo6, "fp32", f"qk_norm_rope {name} q_out")
    assert_close(ko, ko6, "fp32", f"qk_norm_rope {name} k_out")
    for a, b, what in zip(got, want, ("dq", "dk", "dwq", "dwk")):
        assert_close(a, b, "fp32", f"qk_norm_rope {name} {what}")


def _opcheck_cases():
    """(name, module loader, forward op args): contiguous 3-D inputs and one non-contiguous one."""
    def rms():
        return kernel_for("fused_rmsnorm", "RMSNorm", {"hidden": H, "eps": 1e-6, "offset": 0.0, "casting": "llama"}, "fp32")

    def add():
        return kernel_for("fused_add_rmsnorm", "DecoderLayer",
                          {"hidden": H, "eps": 1e-6, "offset": 0.0, "casting": "llama", "layout": "prenorm"}, "fp32")

    def ln():
        return kernel_for("fused_layernorm", "LayerNorm", {"hidden": H, "eps": 1e-5, "bias": True}, "fp32")

    def glu(fused):
        f = {"hidden": 32, "intermediate": 48, "fused_gate_up": fused, "bias": False, "activation": "silu"}
        return lambda: kernel_for("fused_swiglu", "SwiGLU", f, "fp32")

    def rope():
        att = {"head_dim": D, "rotary_dim": D, "n_heads": NQ, "n_kv_heads": NK, "fused_qkv": False}
        return kernel_for("fused_rope", "Attention", att, "fp32")

    def qknr():
        att = {"head_dim": D, "rotary_dim": D, "n_heads": NQ, "n_kv_heads": NK, "fused_qkv": False,
               "qk_norm": {"eps": 1e-6, "offset": 0.0, "casting": "llama"}}
        return kernel_for("fused_qk_norm_rope", "Attention", att, "fp32")

    g = torch.Generator().manual_seed(8)
    for lay in ("contiguous", "strided rows"):
        x, r = layout(lay, (2, 3, H), g), layout(lay, (2, 3, H), g)
        w, b = torch.randn(H, generator=g).to(DEVICE), torch.randn(H, generator=g).to(DEVICE)
        yield f"rmsnorm-{lay}", rms, "rmsnorm_forward_op", (x, w)
        yield f"add_rmsnorm-{lay}", add, "add_rmsnorm_forward_op", (x, r, w)
        yield f"layernorm-{lay}", ln, "layernorm_forward_op", (x, w, b)
        yield f"swiglu-{lay}", glu(False), "swiglu_forward_op", (layout(lay, (2, 3, 48), g), layout(lay, (2, 3, 48), g))
        yield f"swiglu_gate_up-{lay}", glu(True), "swiglu_forward_op", (layout(lay, (2, 3, 96), g),)
    for lay in ("contiguous", "slice of qkv"):
        q, k = head_layout(lay, NQ, g), head_layout(lay, NK, g)
        cos, sin = _cos_sin(g, B)
        wq, wk = torch.randn(D, generator=g).to(DEVICE), torch.randn(D, generator=g).to(DEVICE)
        yield f"rope-{lay}", rope, "rope_forward_op", (q, k, cos, sin)
        yield f"qk_norm_rope-{lay}", qknr, "qk_norm_rope_forward_op", (q, k, wq, wk, cos, sin)


OPCHECK = list(_opcheck_cases())


@pytest.mark.parametrize("name,load,op,args", OPCHECK, ids=[c[0] for c in OPCHECK])
def test_forward_custom_op_fake_matches_real(name, load, op, args):
    """torch.compile's path: the fake forward gives the real one's shapes, dtypes and strides
    (opcheck's fake-tensor check), and the op passes the rest of opcheck."""
    mod = load()
    res = torch.library.opcheck(getattr(mod, op), args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res
