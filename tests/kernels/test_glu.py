"""fused_swiglu / fused_geglu: kernel forward and backward vs float64, in-place backward,
specialisation of the generated source, and patched HF MLPs (Qwen3, Gemma3, Phi-3) vs HF.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from patchdsl.codegen import KernelKey, render
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from .helpers import DEVICE, TORCH_DTYPES, assert_close, kernel_for, rel_err, sizes

ACTS = {  # activation -> (op, flags, float64 reference)
    "silu": ("fused_swiglu", {}, F.silu),
    "gelu": ("fused_geglu", {"approximate": "none"}, F.gelu),
    "gelu_tanh": ("fused_geglu", {"approximate": "tanh"}, lambda t: F.gelu(t, approximate="tanh")),
}
KIND = {"fused_swiglu": "SwiGLU", "fused_geglu": "GeGLU"}


def facts(inter: int, fused: bool, act: str, hidden: int = 32) -> dict:
    f = {"hidden": hidden, "intermediate": inter, "fused_gate_up": fused, "bias": False, "activation": act}
    if act.startswith("gelu"):
        f["approximate"] = "tanh" if act == "gelu_tanh" else "none"
    return f


def glu_kernel(act: str, inter: int, fused: bool, dtype: str, **flags):
    op, f0, _ = ACTS[act]
    return kernel_for(op, KIND[op], facts(inter, fused, act), dtype, {**f0, **flags})


def source(op_name: str, inter: int, fused: bool = False, act: str = "silu", dtype: str = "bf16",
           target: str = "interpreter", layout: str = "rows", **flags) -> tuple[str, dict]:
    """The generated module's source; ``layout`` picks the kernel layout (a template parameter the
    H200 sweep chose, not a flag): the source tests below are about the rows layout's specialisation."""
    op = get_op(op_name)
    fl = op.default_flags()
    fl.update(flags)
    info = ModuleInfo("mlp", "MLP", (), {KIND[op_name]: facts(inter, fused, act)})
    params = dict(op.key_params(info, fl, dtype, target), glu_layout=layout)
    return render(KernelKey.for_op(op, params)), params


def code_only(src: str) -> str:
    """The generated source without its docstrings and comments (what actually runs)."""
    out, in_doc = [], False
    for line in src.splitlines():
        s = line.strip()
        if s.startswith('"""'):
            if not (s.count('"""') == 2 and len(s) > 3):
                in_doc = not in_doc
            continue
        if in_doc or s.startswith("#"):
            continue
        out.append(line.split("  #")[0])
    return "\n".join(out)


# ------------------------------------------------------------------------------------------
# Kernel: forward and backward vs float64
# ------------------------------------------------------------------------------------------

SHAPES = sizes(
    # (rows, intermediate): 64 -> several rows per program with a masked last program; 1024 -> one
    # unmasked pass; 1000 -> masked single pass; 2880 -> loop with masked tail; 2048 -> unmasked loop
    cpu=[(1, 64), (37, 64), (3, 1000), (2, 1024), (1, 2880), (2, 2048)],
    gpu=[(1, 64), (1000, 64), (4096, 1000), (8192, 3072), (1, 2880), (2048, 2880), (4096, 8192), (512, 14336)],
)
LAYOUTS = ["separate", "gate_up"]


def make_inputs(rows, inter, dtype, fused, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    gate = (torch.randn(rows, inter, generator=g) * 2.0).to(dt).to(DEVICE)   # spread over the activation's bend
    up = torch.randn(rows, inter, generator=g).to(dt).to(DEVICE)
    dy = torch.randn(rows, inter, generator=g).to(dt).to(DEVICE)
    return gate, up, dy


def reference(act, gate, up, dy):
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    out = ACTS[act][2](g64) * u64
    out.backward(dy.double())
    return out.detach(), g64.grad, u64.grad


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,inter", SHAPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_kernel_matches_float64(dtype, act, rows, inter, layout):
    fused = layout == "gate_up"
    k = glu_kernel(act, inter, fused, dtype)
    gate, up, dy = make_inputs(rows, inter, dtype, fused)
    ref_out, ref_dg, ref_du = reference(act, gate, up, dy)
    if fused:
        gu = torch.cat([gate, up], dim=-1).requires_grad_()
        out = k.glu(gu)
        out.backward(dy)
        dg, du = gu.grad[:, :inter], gu.grad[:, inter:]
    else:
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = k.glu(g, u)
        out.backward(dy)
        dg, du = g.grad, u.grad
    assert out.dtype == gate.dtype and out.shape == (rows, inter)
    assert_close(out, ref_out, dtype, "out")
    assert_close(du, ref_du, dtype, "d_up")
    assert_close(dg, ref_dg, dtype, "d_gate")


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_3d_input_and_block_flag(act, layout):
    """(batch, seq, I) inputs, and a forced small block (looping) gives the same result."""
    fused = layout == "gate_up"
    inter = 96
    gate, up, dy = make_inputs(6, inter, "fp32", fused, seed=3)
    gate, up, dy = (t.view(2, 3, inter) for t in (gate, up, dy))
    ref_out, ref_dg, ref_du = reference(act, gate, up, dy)
    for flags in ({}, {"block": 32}):
        k = glu_kernel(act, inter, fused, "fp32", **flags)
        if fused:
            gu = torch.cat([gate, up], -1).requires_grad_()
            out = k.glu(gu)
            out.backward(dy)
            dg, du = gu.grad[..., :inter], gu.grad[..., inter:]
        else:
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            out = k.glu(g, u)
            out.backward(dy)
            dg, du = g.grad, u.grad
        assert out.shape == (2, 3, inter)
        assert dg.shape == du.shape == (2, 3, inter)
        assert_close(out, ref_out, "fp32", f"out {flags}")
        assert_close(dg, ref_dg, "fp32", f"d_gate {flags}")
        assert_close(du, ref_du, "fp32", f"d_up {flags}")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # numpy, in the interpreter
def test_extreme_gate_values_stay_finite():
    """Large |gate| must not produce inf/nan (sigmoid/exp overflow) and must match the limits."""
    inter = 64
    gate = torch.tensor([-80.0, -30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 80.0] * 7 + [5.0], device=DEVICE)
    gate = gate.view(1, inter)
    up = torch.ones_like(gate)
    dy = torch.ones_like(gate)
    for act in ACTS:
        k = glu_kernel(act, inter, False, "fp32")
        ref_out, ref_dg, ref_du = reference(act, gate, up, dy)
        out = k.glu_forward(gate, up)[0]
        dg, du = k.glu_backward(dy, gate, up)
        for t, r, what in ((out, ref_out, "out"), (dg, ref_dg, "d_gate"), (du, ref_du, "d_up")):
            assert torch.isfinite(t).all(), (act, what)
            torch.testing.assert_close(t.double().cpu(), r.cpu(), rtol=1e-5, atol=1e-6, msg=f"{act} {what}")


# ------------------------------------------------------------------------------------------
# In-place backward
# ------------------------------------------------------------------------------------------

def _projected(layout, inter, seed=0):
    """gate/up produced by a matmul (non-leaf, owned by the graph) like a projection's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 16, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(2 * inter, 16, generator=g) / 4).to(DEVICE).requires_grad_()
    return x, w


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_backward_same_grads_and_reuses_buffers(layout):
    inter, fused = 48, layout == "gate_up"
    k = glu_kernel("silu", inter, fused, "fp32")
    grads, bufs = {}, {}
    for in_place in (False, True):
        x, w = _projected(layout, inter)
        if fused:
            gu = F.linear(x, w)
            before = gu.detach().clone()
            out = k.glu(gu, in_place=in_place)
            held = [gu]
        else:
            gate, up = F.linear(x, w[:inter]), F.linear(x, w[inter:])
            before = torch.cat([gate, up], -1).detach().clone()
            out = k.glu(gate, up, in_place=in_place)
            held = [gate, up]
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        out.backward(dy)
        grads[in_place] = (x.grad.clone(), w.grad.clone())
        now = torch.cat([t.detach() for t in held], -1)
        bufs[in_place] = not torch.equal(now, before)
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[True][1], grads[False][1], rtol=0, atol=0)
    assert bufs[False] is False, "in_place=False must not touch the saved buffers"
    assert bufs[True] is True, "in_place=True must write the gradients over the saved projection outputs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_never_overwrites_caller_leaves(layout):
    inter, fused = 40, layout == "gate_up"
    k = glu_kernel("gelu", inter, fused, "fp32")
    gate, up, dy = make_inputs(3, inter, "fp32", fused, seed=4)
    if fused:
        gu = torch.cat([gate, up], -1).requires_grad_()
        keep = gu.detach().clone()
        k.glu(gu, in_place=True).backward(dy)
        assert torch.equal(gu.detach(), keep)
    else:
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        k.glu(g, u, in_place=True).backward(dy)
        assert torch.equal(g.detach(), gate) and torch.equal(u.detach(), up)
        # a view of someone else's tensor is not owned either
        base = torch.cat([gate, up], -1).requires_grad_()
        y = base * 1.0
        gv, uv = y[:, :inter], y[:, inter:]
        keep = y.detach().clone()
        k.glu(gv, uv, in_place=True).backward(dy)
        assert torch.equal(y.detach(), keep)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_backward_twice_is_an_error(layout):
    inter, fused = 32, layout == "gate_up"
    k = glu_kernel("silu", inter, fused, "fp32")
    for in_place in (False, True):
        x, w = _projected(layout, inter)
        out = k.glu(F.linear(x, w), in_place=in_place) if fused else \
            k.glu(F.linear(x, w[:inter]), F.linear(x, w[inter:]), in_place=in_place)
        loss = out.square().sum()
        loss.backward(retain_graph=True)
        first = w.grad.clone()
        if in_place:
            with pytest.raises(RuntimeError, match="in_place=False with retain_graph"):
                loss.backward()
        else:
            loss.backward()
            torch.testing.assert_close(w.grad, 2 * first)


def test_backward_function_in_place_returns_the_saved_buffers():
    inter = 64
    k = glu_kernel("gelu_tanh", inter, False, "bf16")
    gate, up, dy = make_inputs(4, inter, "bf16", False, seed=5)
    _, rg, ru = reference("gelu_tanh", gate, up, dy)
    g, u = gate.clone(), up.clone()
    dg, du = k.geglu_backward(dy, g, u, in_place=True)
    assert dg.data_ptr() == g.data_ptr() and du.data_ptr() == u.data_ptr()
    assert_close(dg, rg, "bf16", "d_gate")
    assert_close(du, ru, "bf16", "d_up")
    kf = glu_kernel("gelu_tanh", inter, True, "bf16")
    gu = torch.cat([gate, up], -1)
    dgu = kf.geglu_backward(dy, gu, in_place=True)
    assert dgu.data_ptr() == gu.data_ptr()
    assert_close(dgu[:, :inter], rg, "bf16", "fused d_gate")


# ------------------------------------------------------------------------------------------
# Specialisation of the generated source
# ------------------------------------------------------------------------------------------

def test_source_differs_by_activation():
    silu, _ = source("fused_swiglu", 1000)
    gelu, _ = source("fused_geglu", 1000, act="gelu", approximate="none")
    tanh, _ = source("fused_geglu", 1000, act="gelu_tanh", approximate="auto")
    cs, cg, ct = code_only(silu), code_only(gelu), code_only(tanh)
    assert "tl.erf" not in cs and "0.044715" not in cs and "tl.sigmoid(g)" in cs
    assert "tl.erf" in cg and "tl.sigmoid" not in cg
    assert "tl.erf" not in ct and "0.044715" in ct and "tanh(" not in ct and "libdevice" not in ct
    assert len({silu, gelu, tanh}) == 3


def test_approximate_flag_overrides_detection():
    _, p_auto = source("fused_geglu", 256, act="gelu_tanh")
    _, p_none = source("fused_geglu", 256, act="gelu_tanh", approximate="none")
    _, p_exact = source("fused_geglu", 256, act="gelu")
    assert p_auto["activation"] == "gelu_tanh"
    assert p_none["activation"] == "gelu" == p_exact["activation"]


def test_source_one_pass_unmasked_for_power_of_two_row():
    src, p = source("fused_swiglu", 1024)
    code = code_only(src)
    assert p["single_pass"] and p["BLOCK"] == 1024 and p["ROWS"] == 1
    assert "for start in range" not in code and "mask=" not in code


def test_source_one_pass_masked_tail():
    src, p = source("fused_swiglu", 1000)
    code = code_only(src)
    assert p["single_pass"] and p["BLOCK"] == 1024
    assert "for start in range" not in code and "mask=m" in code and "cols < I" in code


def test_source_short_rows_several_per_program():
    src, p = source("fused_swiglu", 64)
    code = code_only(src)
    assert p["ROWS"] > 1
    assert "rows[:, None] < n_rows" in code and "cols < I" not in code


def test_source_long_rows_loop():
    src, p = source("fused_swiglu", 2880)
    code = code_only(src)
    assert not p["single_pass"] and p["n_tiles"] == 3
    assert code.count("for start in range(0, I, BLOCK)") == 2 and "mask=m" in code
    even, pe = source("fused_swiglu", 2048)
    assert not pe["single_pass"] and "for start in range" in code_only(even) and "mask=" not in code_only(even)


def test_source_block_flag_forces_loop():
    src, p = source("fused_swiglu", 1000, block=256)
    assert p["BLOCK"] == 256 and not p["single_pass"]
    assert "for start in range" in code_only(src)


def test_default_layout_is_flat_for_separate_gate_and_up_and_rows_for_a_fused_gate_up():
    """The shipped choice (H200 sweep): separate gate/up tensors are one flat array, FLAT_BLOCK elements
    per program, masked only at the end; Phi-3's interleaved gate_up rows keep the row layout."""
    op = get_op("fused_swiglu")
    for fused, layout in ((False, "flat"), (True, "rows")):
        info = ModuleInfo("mlp", "MLP", (), {KIND["fused_swiglu"]: facts(1000, fused, "silu")})
        p = op.key_params(info, op.default_flags(), "bf16", "cuda")
        src = render(KernelKey.for_op(op, p))
        if layout == "flat" and not fused:
            assert p["glu_layout"] == "flat" and p["num_warps"] == 4
            assert "FLAT_BLOCK = 1024" in src and "n_elem" in code_only(src)
        else:
            assert "FLAT_BLOCK =" not in src and "n_rows" in code_only(src)


def test_source_fused_layout_and_names():
    sep, ps = source("fused_swiglu", 512)
    fus, pf = source("fused_swiglu", 512, fused=True)
    assert "U = GU + I" in code_only(fus) and "GU" not in code_only(sep)
    assert "ROW_STRIDE = 1024" in fus and "ROW_STRIDE = 512" in sep
    op = get_op("fused_swiglu")
    assert op.kernel_name(ps) == "fused_swiglu_silu_bf16_i512_interpreter"
    assert op.kernel_name(pf) == "fused_swiglu_silu_bf16_i512_gate_up_interpreter"
    compile(fus, "fus.py", "exec")
    compile(sep, "sep.py", "exec")


def test_source_cuda_target_is_real_size_config():
    src, p = source("fused_swiglu", 3072, target="cuda")
    assert p["single_pass"] and p["BLOCK"] == 4096 and p["num_warps"] >= 4
    src2, p2 = source("fused_swiglu", 14336, target="cuda")
    assert not p2["single_pass"] and "for start in range" in code_only(src2)
    compile(src, "c.py", "exec")


def test_flags_are_typed():
    from patchdsl.ops.base import FlagTypeError
    sw, ge = get_op("fused_swiglu"), get_op("fused_geglu")
    assert sw.flag("in_place").coerce(False) is False
    with pytest.raises(FlagTypeError):
        sw.flag("in_place").coerce("yes")
    with pytest.raises(FlagTypeError):
        sw.flag("block").coerce(8)
    assert sw.flag("block").coerce("auto") == "auto"
    with pytest.raises(FlagTypeError):
        ge.flag("approximate").coerce("sigmoid")
    assert ge.flag("approximate").coerce("tanh") == "tanh"
    assert sw.flag("approximate") is None


# ------------------------------------------------------------------------------------------
# Module level: tiny HF models
# ------------------------------------------------------------------------------------------

H, INTER = sizes(cpu=(48, 160), gpu=(1024, 2880))
TOKENS = sizes(cpu=(2, 5), gpu=(4, 512))
MODELS = {
    # id: (model_type, config overrides, op)
    "qwen3": ("qwen3", {}, "fused_swiglu"),
    "gemma3": ("gemma3_text", {}, "fused_geglu"),
    "gemma3_exact_gelu": ("gemma3_text", {"hidden_activation": "gelu"}, "fused_geglu"),
    "phi3": ("phi3", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, "fused_swiglu"),
}
_MLP_CACHE: dict = {}
SLACK = {"fp32": 1e-6, "fp16": 5e-4, "bf16": 4e-3}   # about one rounding of the dtype


def tiny_mlp(name):
    if name not in _MLP_CACHE:
        from transformers import AutoConfig, AutoModelForCausalLM

        mt, over, _ = MODELS[name]
        cfg = AutoConfig.for_model(mt, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                                   **over)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        _MLP_CACHE[name] = model.model.layers[0].mlp
    return copy.deepcopy(_MLP_CACHE[name])


def run_mlp(mlp, x, dy):
    x = x.detach().clone().requires_grad_()
    out = mlp(x)
    out.backward(dy)
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in mlp.named_parameters()})
    return out.detach(), grads


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_hf_mlp_matches(name, dtype):
    from patchdsl.runtime import patch_module

    dt = TORCH_DTYPES[dtype]
    base = tiny_mlp(name).to(DEVICE)
    hf = copy.deepcopy(base).to(dt)
    ours = copy.deepcopy(base).to(dt)
    ref = copy.deepcopy(hf).double()          # float64 on the same (rounded) weights
    g = torch.Generator().manual_seed(1)
    b, s = TOKENS
    x = torch.randn(b, s, H, generator=g).to(dt).to(DEVICE)
    dy = torch.randn(b, s, H, generator=g).to(dt).to(DEVICE)

    handle = patch_module(ours, MODELS[name][2])
    assert "forward" in ours.__dict__
    out, grads = run_mlp(ours, x, dy)
    out_hf, grads_hf = run_mlp(hf, x, dy)
    out_ref, grads_ref = run_mlp(ref, x.double(), dy.double())

    assert out.dtype == dt
    assert set(grads) == set(grads_ref) and len(grads) >= 3
    # each rounding step (projections, kernel, down_proj) costs ~u; HF's own error is the yardstick
    assert_close(out, out_ref, dtype, "output", factor=2)
    for n in grads:
        assert grads[n] is not None, n
        assert_close(grads[n], grads_ref[n], dtype, f"grad {n}", factor=2)
        # and no worse than HF's own result in this dtype (up to a small slack: one rounding)
        assert rel_err(grads[n], grads_ref[n]) <= 2 * rel_err(grads_hf[n], grads_ref[n]) + SLACK[dtype], n
    assert rel_err(out, out_ref) <= 2 * rel_err(out_hf, out_ref) + SLACK[dtype]
    handle.undo()
    assert "forward" not in ours.__dict__


def test_patched_mlp_saves_less_for_backward():
    """Eager keeps gate, up and act(gate) (+ the product for down_proj); the patched MLP keeps
    gate and up (one intermediate-sized tensor less)."""
    from patchdsl.runtime import patch_module

    for name in ("qwen3", "phi3"):
        mlp = tiny_mlp(name).to(DEVICE)
        params = {p.data_ptr() for p in mlp.parameters()}
        x = torch.randn(*TOKENS, H, device=DEVICE, requires_grad=True)

        def saved_bytes():
            seen = {}

            def pack(t):
                if t.data_ptr() not in params:
                    seen[(t.data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                mlp(x).sum().backward()
            return sum(seen.values())

        eager = saved_bytes()
        h = patch_module(mlp, "fused_swiglu")
        fused = saved_bytes()
        h.undo()
        n_tok = TOKENS[0] * TOKENS[1]
        assert eager - fused >= n_tok * INTER * 4, (name, eager, fused)


def test_patched_mlp_with_bias_projections():
    """Bias is applied by the projection modules themselves: accepted, and exact."""
    from patchdsl.runtime import patch_module

    class BiasMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(24, 40, bias=True)
            self.up_proj = torch.nn.Linear(24, 40, bias=True)
            self.down_proj = torch.nn.Linear(40, 24, bias=True)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(2)
    mlp = BiasMLP().to(DEVICE)
    ref = copy.deepcopy(mlp).double()
    x = torch.randn(3, 24, device=DEVICE)
    dy = torch.randn(3, 24, device=DEVICE)
    h = patch_module(mlp, "fused_swiglu")
    out, grads = run_mlp(mlp, x, dy)
    out_ref, grads_ref = run_mlp(ref, x.double(), dy.double())
    assert_close(out, out_ref, "fp32", "out")
    for n in grads_ref:
        assert_close(grads[n], grads_ref[n], "fp32", n)
    assert grads["gate_proj.bias"] is not None
    h.undo()


def test_patched_mlp_with_peft_lora():
    """The patched forward calls the projection modules, so LoRA adapters train."""
    peft = pytest.importorskip("peft")
    from patchdsl.runtime import patch_module

    mlp = tiny_mlp("qwen3").to(DEVICE)

    class Wrap(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x)

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    ref_model = peft.get_peft_model(Wrap(copy.deepcopy(mlp)), cfg)
    model = copy.deepcopy(ref_model)
    target = model.base_model.model.mlp
    h = patch_module(target, "fused_swiglu")
    x = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dy = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out, grads = run_mlp(model, x, dy)
    out_ref, grads_ref = run_mlp(ref_model, x, dy)
    assert_close(out, out_ref, "fp32", "out", factor=5)
    lora = [n for n in grads_ref if "lora_" in n]
    assert len(lora) == 6
    for n in lora + ["x"]:
        assert grads[n] is not None, n
        assert_close(grads[n], grads_ref[n], "fp32", n, factor=5)
    h.undo()


def test_swiglu_refuses_geglu_mlp_naming_it():
    from patchdsl.model.index import build_index
    from patchdsl.runtime import PatchError, patch_module

    mlp = tiny_mlp("gemma3")
    info = build_index(mlp).infos[""]
    reason = get_op("fused_swiglu").check(mlp, info, get_op("fused_swiglu").default_flags())
    assert reason and "Gemma3MLP" in reason and "GeGLU" in reason and "fused_geglu" in reason
    with pytest.raises(PatchError, match="Gemma3MLP"):
        patch_module(mlp, "fused_swiglu")
    assert "forward" not in mlp.__dict__
    qwen = tiny_mlp("qwen3")
    qinfo = build_index(qwen).infos[""]
    r2 = get_op("fused_geglu").check(qwen, qinfo, get_op("fused_geglu").default_flags())
    assert r2 and "Qwen3MLP" in r2 and "SwiGLU" in r2


def test_refuses_mlp_whose_forward_differs_from_its_structure():
    """Structure says SwiGLU (gate_proj/up_proj/down_proj/act_fn = SiLU) but the forward swaps gate
    and up, or chunks gate_up up-first: the probe refuses it."""
    from patchdsl.runtime import PatchError, patch_module

    class Swapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 24, bias=False)
            self.up_proj = torch.nn.Linear(16, 24, bias=False)
            self.down_proj = torch.nn.Linear(24, 16, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    class UpFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(16, 48, bias=False)
            self.down_proj = torch.nn.Linear(24, 16, bias=False)
            self.activation_fn = torch.nn.SiLU()

        def forward(self, x):
            up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.activation_fn(gate) * up)

    for cls in (Swapped, UpFirst):
        with pytest.raises(PatchError, match="does not compute down_proj"):
            patch_module(cls(), "fused_swiglu")


def test_refuses_module_that_is_not_an_mlp():
    from patchdsl.runtime import PatchError, patch_module

    with pytest.raises(PatchError, match="not a SwiGLU MLP"):
        patch_module(torch.nn.Linear(4, 4), "fused_swiglu")


class _DropoutMLP(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.gate_proj = torch.nn.Linear(16, 24, bias=False)
        self.up_proj = torch.nn.Linear(16, 24, bias=False)
        self.down_proj = torch.nn.Linear(24, 16, bias=False)
        self.act_fn = torch.nn.SiLU()
        self.dropout = torch.nn.Dropout(p)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def test_dropout_in_forward_is_refused_even_in_eval_mode_and_probe_has_no_side_effects():
    from patchdsl.model.index import build_index
    from patchdsl.runtime import PatchError, patch_module

    op = get_op("fused_swiglu")
    m = _DropoutMLP(0.1).eval()
    rng = torch.get_rng_state()
    reason = op.check(m, build_index(m).infos[""], op.default_flags())
    assert reason and "_DropoutMLP" in reason and "does not compute" in reason
    assert torch.equal(torch.get_rng_state(), rng), "the probe moved the caller's RNG"
    assert not m.training and not m.dropout.training and not m.act_fn.training, "the probe changed train/eval flags"
    with pytest.raises(PatchError):
        patch_module(m, "fused_swiglu")
    h = patch_module(_DropoutMLP(0.0), "fused_swiglu")   # p = 0 computes the plain formula
    h.undo()


def test_float64_and_autocast_inputs():
    """float64 has no kernel: the same formula in torch; under autocast the kernel follows the
    projections' output dtype."""
    from patchdsl.runtime import patch_module

    mlp = tiny_mlp("phi3").to(DEVICE)
    ref = copy.deepcopy(mlp).double()
    h = patch_module(mlp, "fused_swiglu")
    m64 = copy.deepcopy(ref)
    h64 = patch_module(m64, "fused_swiglu")
    x = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    dy = torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out64, g64 = run_mlp(m64, x.double(), dy.double())
    out_ref, g_ref = run_mlp(ref, x.double(), dy.double())
    torch.testing.assert_close(out64, out_ref)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out_ac = mlp(x)
    assert out_ac.dtype == torch.bfloat16
    assert_close(out_ac, out_ref, "bf16", "autocast output", factor=2)
    h.undo()
    h64.undo()


@pytest.mark.filterwarnings("ignore::FutureWarning")   # gradient_checkpointing_enable renamed in transformers 5.2x
@pytest.mark.parametrize("reentrant", [False, True])
def test_whole_model_with_gradient_checkpointing(reentrant):
    """Every MLP of a tiny 2-layer Qwen3 patched, HF gradient checkpointing on (the forward is
    recomputed in backward, so the in-place backward overwrites recomputed buffers): loss and every
    parameter's gradient match the unpatched model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchdsl.runtime import patch_module

    cfg = AutoConfig.for_model("qwen3", hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    torch.manual_seed(5)
    ref = AutoModelForCausalLM.from_config(cfg).to(DEVICE)
    ours = copy.deepcopy(ref)
    handles = [patch_module(layer.mlp, "fused_swiglu") for layer in ours.model.layers]
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    results = []
    for m in (ref, ours):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l_ref, g_ref), (l_ours, g_ours) = results
    assert_close(l_ours, l_ref, "fp32", "loss")
    mlp_grads = [n for n in g_ref if ".mlp." in n]
    assert len(mlp_grads) == 6
    for n in g_ref:
        if g_ref[n] is None:
            continue
        assert g_ours[n] is not None, n
        assert_close(g_ours[n], g_ref[n], "fp32", n, factor=10)
    for h in handles:
        h.undo()
