"""Host time of the generated norm / GLU / RoPE forwards on the CPU, with the kernel launch stubbed.

    TRITON_INTERPRET=1 python bench/host_cpu_probe.py [N]

Loads each generated module (fp32, small shapes, as tests/kernels do), replaces its module global
``launch`` with a no-op and times, per op: the ``*_forward`` host function alone (no autograd) and
the public entry point with autograd (inputs require grad).  What it measures is the Python /
PyTorch work around the launch (argument checks, reshapes, output allocation, autograd), not the
kernels.  Numbers vary by machine and by run; compare before / after on the same machine.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from tests.kernels.helpers import kernel_for  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000


def per_call_us(f, n=N):
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def stub(k):
    k.launch = lambda *a, **kw: None
    return k


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def cases():
    rows, h = 64, 1024
    k = stub(kernel_for("fused_rmsnorm", "RMSNorm", {"hidden": h, "eps": 1e-6, "offset": 0.0, "casting": "llama"}, "fp32"))
    x, w = leaf(rows, h), leaf(h)
    yield "rmsnorm", lambda: k.rmsnorm_forward(x, w), lambda: k.rmsnorm(x, w)

    k = stub(kernel_for("fused_add_rmsnorm", "DecoderLayer",
                        {"hidden": h, "eps": 1e-6, "offset": 0.0, "casting": "llama", "layout": "prenorm"}, "fp32"))
    r = leaf(rows, h)
    yield "add_rmsnorm", lambda: k.add_rmsnorm_forward(x, r, w), lambda: k.add_rmsnorm(x, r, w)

    k = stub(kernel_for("fused_layernorm", "LayerNorm", {"hidden": h, "eps": 1e-5, "bias": True}, "fp32"))
    b = leaf(h)
    yield "layernorm", lambda: k.layernorm_forward(x, w, b), lambda: k.layernorm(x, w, b)

    inter = 1024
    glu = {"hidden": 32, "intermediate": inter, "bias": False, "activation": "silu"}
    k = stub(kernel_for("fused_swiglu", "SwiGLU", dict(glu, fused_gate_up=False), "fp32"))
    g, u = leaf(rows, inter), leaf(rows, inter)
    yield "swiglu", lambda: k.glu_forward(g, u), lambda: k.glu(g, u)
    k2 = stub(kernel_for("fused_swiglu", "SwiGLU", dict(glu, fused_gate_up=True), "fp32"))
    gu = leaf(rows, 2 * inter)
    yield "swiglu (gate_up)", lambda: k2.glu_forward(gu), lambda: k2.glu(gu)

    bsz, seq, nq, nk, d = 2, 32, 8, 2, 64
    att = {"head_dim": d, "rotary_dim": d, "n_heads": nq, "n_kv_heads": nk, "fused_qkv": False}
    k = stub(kernel_for("fused_rope", "Attention", att, "fp32"))
    q, kk = leaf(bsz, seq, nq, d), leaf(bsz, seq, nk, d)
    cos, sin = torch.randn(1, seq, d), torch.randn(1, seq, d)
    yield "rope", lambda: k.rope_forward(q, kk, cos, sin), lambda: k.rope(q, kk, cos, sin)

    k = stub(kernel_for("fused_qk_norm_rope", "Attention",
                        dict(att, qk_norm={"eps": 1e-6, "offset": 0.0, "casting": "llama"}), "fp32"))
    wq, wk = leaf(d), leaf(d)
    yield ("qk_norm_rope", lambda: k.qk_norm_rope_forward(q, kk, wq, wk, cos, sin),
           lambda: k.qk_norm_rope(q, kk, wq, wk, cos, sin))


def main():
    print(f"{'op':18s} {'*_forward us':>13s} {'entry+autograd us':>18s}")
    for name, fwd, full in cases():
        print(f"{name:18s} {per_call_us(fwd):13.2f} {per_call_us(full):18.2f}", flush=True)


if __name__ == "__main__":
    main()
