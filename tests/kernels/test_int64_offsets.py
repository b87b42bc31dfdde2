"""64-bit offsets: kernels index tensors that can pass 2**31 elements.

``test_row_offsets_are_64_bit`` (CPU, source level): in every generated kernel of every op, each
product with a tensor stride (``stride_*``, ``STRIDE``, a row length) has a 64-bit operand: a
name whose value was derived from ``.to(tl.int64)``.  ``test_*_past_2_31`` (GPU, H200): cross
entropy over 16384 x 151936 bf16 logits (2.49e9 elements) and linear cross entropy with one
16384-token chunk at vocab 151936 (its chunk logits pass 2**31), against chunked float64.

GPU:  python -m pytest -q -m gpu tests/kernels/test_int64_offsets.py
"""

from __future__ import annotations

import ast

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from .helpers import DEVICE, ON_GPU, kernel_for

# One site per op, with facts that take the looped / masked / multi-row template branches too.
SITES = [
    ("fused_rmsnorm", {"RMSNorm": {"hidden": 96, "eps": 1e-6, "offset": 0.0, "casting": "llama"}}),
    ("fused_rmsnorm", {"RMSNorm": {"hidden": 40000, "eps": 1e-6, "offset": 1.0, "casting": "gemma"}}),
    ("fused_add_rmsnorm", {"DecoderLayer": {"hidden": 96, "eps": 1e-6, "offset": 0.0, "casting": "llama",
                                            "layout": "prenorm"}}),
    ("fused_add_rmsnorm", {"DecoderLayer": {"hidden": 40000, "eps": 1e-6, "offset": 0.0, "casting": "llama",
                                            "layout": "prenorm"}}),
    ("fused_layernorm", {"LayerNorm": {"hidden": 96, "eps": 1e-5, "bias": True}}),
    ("fused_layernorm", {"LayerNorm": {"hidden": 40000, "eps": 1e-5, "bias": False}}),
    ("fused_swiglu", {"SwiGLU": {"hidden": 64, "intermediate": 96, "fused_gate_up": False, "activation": "silu",
                                 "bias": False}}),
    ("fused_swiglu", {"SwiGLU": {"hidden": 64, "intermediate": 40000, "fused_gate_up": True, "activation": "silu",
                                 "bias": False}}),
    ("fused_geglu", {"GeGLU": {"hidden": 64, "intermediate": 96, "fused_gate_up": False, "activation": "gelu_tanh",
                               "approximate": "tanh", "bias": False}}),
    ("fused_rope", {"Attention": {"head_dim": 64, "n_heads": 8, "n_kv_heads": 2, "rotary_dim": 64,
                                  "fused_qkv": False}}),
    ("fused_qk_norm_rope", {"Attention": {"head_dim": 128, "n_heads": 16, "n_kv_heads": 8, "rotary_dim": 128,
                                          "fused_qkv": False,
                                          "qk_norm": {"eps": 1e-6, "offset": 0.0, "casting": "llama"}}}),
    ("fused_cross_entropy", {"CausalLM": {"vocab": 151936, "hidden": 64, "bias": False, "softcap": None,
                                          "logits_scaling": None, "tied": False}}),
    ("fused_cross_entropy", {"CausalLM": {"vocab": 1000, "hidden": 64, "bias": False, "softcap": 30.0,
                                          "logits_scaling": None, "tied": False}}),
    ("fused_linear_cross_entropy", {"CausalLM": {"vocab": 151936, "hidden": 1024, "bias": True, "softcap": None,
                                                 "logits_scaling": None, "tied": False}}),
    ("fused_linear_cross_entropy", {"CausalLM": {"vocab": 256000, "hidden": 2304, "bias": True, "softcap": 30.0,
                                                 "logits_scaling": None, "tied": False}}, {"mode": "fused"}),
]


def _sources():
    for op_name, kinds, *flags in SITES:
        op = get_op(op_name)
        for target in ("cuda", "interpreter"):
            info = ModuleInfo("m", "M", (), kinds, dtype="bf16")
            p = op.key_params(info, dict(op.default_flags(), **(flags[0] if flags else {})), "bf16", target)
            yield f"{op_name}[{next(iter(kinds.values())).get('hidden', '')}/{target}]", \
                render(KernelKey.for_op(op, p))


def _is_stride(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else None
    return name is not None and (name.lower().startswith("stride") or name in {"STRIDE", "ROW_STRIDE", "I"})


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Subscript, ast.Attribute)) and not (
            isinstance(node, ast.Attribute) and node.attr == "int64"):
        node = node.value
    return node


def _wide_names(fn: ast.FunctionDef) -> set[str]:
    """Names in ``fn`` whose value is 64-bit: assigned from an expression that casts to tl.int64 or
    uses a 64-bit name; a for variable over a range starting at a 64-bit value."""
    wide: set[str] = set()

    def is_wide(expr: ast.AST) -> bool:
        src = ast.unparse(expr)
        return "tl.int64" in src or any(isinstance(n, ast.Name) and n.id in wide for n in ast.walk(expr))

    changed = True
    while changed:
        changed = False
        for node in ast.walk(fn):
            targets, value = [], None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AugAssign):
                targets, value = [node.target], node.value
            elif isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and node.iter.args:
                targets, value = [node.target], node.iter.args[0]
            if value is None or not is_wide(value):
                continue
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and n.id not in wide:
                        wide.add(n.id)
                        changed = True
    return wide


def _narrow_products(src: str) -> list[str]:
    bad = []
    for fn in ast.walk(ast.parse(src)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue
        wide = _wide_names(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                for a, b in ((node.left, node.right), (node.right, node.left)):
                    if _is_stride(a):
                        other = _root(b)
                        ok = ("tl.int64" in ast.unparse(b)
                              or any(isinstance(n, ast.Name) and n.id in wide for n in ast.walk(other)))
                        if not ok:
                            bad.append(f"{fn.name}: {ast.unparse(node)}")
    return bad


def test_row_offsets_are_64_bit():
    seen = 0
    failures = []
    for name, src in _sources():
        seen += src.count("@triton.jit")
        failures += [f"{name}: {b}" for b in _narrow_products(src)]
    assert seen > 20
    assert not failures, failures


def test_the_checker_catches_a_32_bit_row_offset():
    src = ("import triton\nimport triton.language as tl\n@triton.jit\n"
           "def k(X, stride_x):\n    row = tl.program_id(0)\n    tl.load(X + row * stride_x)\n")
    assert _narrow_products(src) == ["k: row * stride_x"]
    assert _narrow_products(src.replace("tl.program_id(0)", "tl.program_id(0).to(tl.int64)")) == []


# ------------------------------------------------------------------------ GPU, > 2**31 elements
gpu = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (H200: ~25 GB, ~30 s)")]
ROWS, VOCAB = 16384, 151936             # 2.49e9 logit elements > 2**31 = 2.15e9
CHUNK_REF = 1024


def _ce_chunk64(x, y, n_valid):
    """float64 loss sum and d(mean loss)/dx for one chunk of rows."""
    x = x.double()
    lse = torch.logsumexp(x, -1)
    valid = y != -100
    tgt = x.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    loss = torch.where(valid, lse - tgt, torch.zeros_like(lse)).sum()
    g = torch.softmax(x, -1)
    g[torch.arange(len(y), device=x.device), torch.where(valid, y, 0)] -= 1.0
    g = torch.where(valid[:, None], g, torch.zeros_like(g)) / n_valid
    return loss, g


def test_cross_entropy_past_2_31():
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(ROWS, VOCAB, device="cuda", generator=g, dtype=torch.bfloat16) * 3)
    assert x.numel() > 2 ** 31
    y = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    y[::97] = -100
    y[-1] = VOCAB - 1                   # the very last element of the tensor is a label
    n_valid = int((y != -100).sum())
    mod = kernel_for("fused_cross_entropy", "CausalLM", {"vocab": VOCAB, "hidden": 64, "bias": False,
                     "softcap": None, "logits_scaling": None, "tied": False}, "bf16")
    xs = x.requires_grad_()
    loss = mod.cross_entropy(xs, y)
    loss.backward()
    grad = xs.grad
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for s in range(0, ROWS, CHUNK_REF):
        e = min(s + CHUNK_REF, ROWS)
        l64, g64 = _ce_chunk64(x.detach()[s:e], y[s:e], n_valid)
        total += l64
        err = ((grad[s:e].double() - g64).norm() / g64.norm()).item()
        assert err < 1.6e-2, f"rows {s}:{e} (elements from {s * VOCAB:.3e}): grad relative error {err:.3g}"
        del g64
    ref = (total / n_valid).item()
    assert abs(loss.item() - ref) <= 1e-3 * abs(ref), (loss.item(), ref)


def test_linear_cross_entropy_past_2_31():
    """One 16384-token chunk at vocab 151936: the chunk's logits buffer has 2.49e9 elements."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    hidden = 1024
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(ROWS, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(VOCAB, hidden, device="cuda", generator=g) * (2.0 / hidden ** 0.5)).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    y[::89] = -100
    n_valid = int((y != -100).sum())
    mod = kernel_for("fused_linear_cross_entropy", "CausalLM", {"vocab": VOCAB, "hidden": hidden, "bias": False,
                     "softcap": None, "logits_scaling": None, "tied": False}, "bf16", {"chunk": ROWS})
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = mod.linear_cross_entropy(hs, ws, None, y)
    loss.backward()
    h64, w64 = h.double(), w.double()
    gh = torch.zeros_like(h64)
    gw = torch.zeros_like(w64)
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for s in range(0, ROWS, CHUNK_REF):
        e = min(s + CHUNK_REF, ROWS)
        l64, d = _ce_chunk64(h64[s:e] @ w64.T, y[s:e], n_valid)
        total += l64
        gh[s:e] = d @ w64
        gw += d.T @ h64[s:e]
        err = ((hs.grad[s:e].double() - gh[s:e]).norm() / gh[s:e].norm()).item()
        assert err < 1.6e-2, f"rows {s}:{e}: grad_hidden relative error {err:.3g}"
        del d
    ref = (total / n_valid).item()
    assert abs(loss.item() - ref) <= 1e-3 * abs(ref), (loss.item(), ref)
    err = ((ws.grad.double() - gw).norm() / gw.norm()).item()
    assert err < 1.6e-2, f"grad_weight relative error {err:.3g}"


for _t in (test_cross_entropy_past_2_31, test_linear_cross_entropy_past_2_31):
    for _m in gpu:
        _m(_t)
