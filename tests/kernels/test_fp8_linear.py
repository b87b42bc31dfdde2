"""fp8_linear: planning, refusal where fp8 matmuls cannot run, and the recipes' numerics (CPU).

fp8 matmuls (``torch._scaled_mm``) need Hopper/Ada; on this CPU the op is refused unless
``emulate=true``, which runs the same quantisation with an fp32 matmul of the dequantised fp8
values.  The numerics are checked against float64 with bounds derived from the recipe:

* quantisation, element by element: |deq(q(x)) - x| <= u |x| + d, u the format's unit roundoff
  (e4m3 2^-4, e5m2 2^-3), d half its smallest subnormal times the dequantisation factor;
* each matmul C = A B^T (forward y, grad_input, grad_weight), element by element:
  |C^ - C| <= Ea |B|^T + |A| Eb^T + Ea Eb^T + g_K |A^| |B^|^T + u_out |C^|, with Ea, Eb the
  quantisation bounds above, g_K fp32 accumulation over K terms, u_out the output rounding;
* verify passes emulated fp8 sites against the recipe's floor (``ops.fp8_linear.tolerance_floor``).
Must-fail: e5m2 values judged with e4m3's roundoff, a doubled dequantisation factor.
"""

from __future__ import annotations

import os

import pytest
import torch

import patchdsl
from patchdsl.ops import fp8_linear as fp8op
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.syntax import SpecError

from ..families import tiny_model

PROJ = "*.mlp.{gate_proj,up_proj,down_proj}, *.self_attn.{q_proj,k_proj,v_proj,o_proj}"
SUBNORMAL_HALF = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}


def spec(recipe="rowwise", emulate=False, dtype="bf16"):
    return f"dtype {dtype}\n{PROJ}: Linear -> fp8_linear(recipe={recipe}{', emulate=true' if emulate else ''})\n"


@pytest.fixture
def gpu(monkeypatch):
    """Pretend this machine has a GPU of the given compute capability (planning only: nothing runs on it)."""
    def set_(cap, name):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    return set_


# ------------------------------------------------------------------------------ planning / refusal
@pytest.mark.parametrize("recipe", list(fp8op.RECIPES))
def test_plans_every_projection_on_hopper(gpu, recipe):
    gpu((9, 0), "NVIDIA H200")
    model = tiny_model("qwen3", num_hidden_layers=2)
    p = patchdsl.plan(spec(recipe), model, target="cuda", dtypes=("bf16",))
    assert len(p.sites) == 14 and {s.op for s in p.sites} == {"fp8_linear"}
    assert {s.path.rsplit(".", 1)[-1] for s in p.sites} == {"gate_proj", "up_proj", "down_proj", "q_proj", "k_proj",
                                                             "v_proj", "o_proj"}
    assert all(s.flag_dict["recipe"] == recipe and not s.flag_dict["emulate"] for s in p.sites)
    k = p.sites[0].keys[0].param_dict
    assert k["formats"] == "_".join(fp8op.RECIPES[recipe]) and k["target"] == "cuda"
    assert k["hp_grad_weight"] == (recipe in fp8op.HP_GRAD_WEIGHT)
    assert set(fp8op.SCALING) == set(fp8op.RECIPES) and k["scaling"] == fp8op.SCALING[recipe] in ("rowwise", "tensorwise")


REFUSALS = [   # (target, GPU or None, what the error must say)
    ("interpreter", None, r"Triton interpreter \(no GPU\).*emulate=true"),
    ("cuda", ((8, 0), "NVIDIA A100-SXM4-80GB"), r"compute capability >= 8\.9.*this GPU \(NVIDIA A100-SXM4-80GB\) is 8\.0"),
    ("cuda", ((8, 6), "NVIDIA RTX A6000"), r"is 8\.6"),
    ("cuda", "none", r"none is visible"),
]


@pytest.mark.parametrize("target,dev,msg", REFUSALS, ids=["cpu", "a100", "sm86", "no-gpu"])
def test_refused_where_fp8_matmuls_cannot_run(gpu, monkeypatch, target, dev, msg):
    if dev == "none":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    elif dev is not None:
        gpu(*dev)
    model = tiny_model("qwen3", num_hidden_layers=1)
    with pytest.raises(SpecError, match=msg) as ei:
        patchdsl.plan(spec(), model, target=target, dtypes=("bf16",))
    text = str(ei.value)
    assert "<string>:2:" in text and "fp8_linear cannot be used here" in text and "^~~" in text   # located at the op
    assert "model.layers.0." in text                                  # names the site


def test_sm89_and_emulation_plan(gpu):
    gpu((8, 9), "NVIDIA L40S")
    model = tiny_model("qwen3", num_hidden_layers=1)
    assert len(patchdsl.plan(spec(), model, target="cuda", dtypes=("bf16",)).sites) == 7
    assert len(patchdsl.plan(spec(emulate=True), model, target="interpreter", dtypes=("fp32",)).sites) == 7


def test_weight_dimensions_not_multiples_of_16_are_refused_by_name():
    model = tiny_model("qwen3", num_hidden_layers=1, intermediate_size=72)
    with pytest.raises(SpecError, match=r"multiples of 16: out_features=72"):
        patchdsl.plan("dtype fp32\n*.mlp.gate_proj: Linear -> fp8_linear(emulate=true)\n", model)


def test_flags_are_checked():
    with pytest.raises(SpecError, match="recipe"):
        patchdsl.plan("dtype fp32\n*.mlp.gate_proj: Linear -> fp8_linear(recipe=blockwise, emulate=true)\n",
                      tiny_model("qwen3", num_hidden_layers=1))


# ------------------------------------------------------------------------------ numerics
def kernel(recipe: str, k: int, n: int, bias: bool = False):
    from patchdsl.codegen import KernelKey, load_kernel

    op = get_op("fp8_linear")
    info = ModuleInfo("p", "Linear", (), {"Linear": {"in_features": k, "out_features": n, "bias": bias}}, "fp32")
    p = op.key_params(info, {"recipe": recipe, "emulate": True}, "fp32", "interpreter")
    return load_kernel(KernelKey.for_op(op, p))


def data(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[3, 5] = 90.0                       # an outlier: tensorwise scaling squeezes everything else
    x[7] *= 1e-3                         # a quiet token: rowwise gives it its own scale
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * 1e-2
    return x, w, dy


def q_err_bound(t, inv, fmt):
    """Elementwise bound of |deq(q(t)) - t| for ``t`` quantised to ``fmt`` with dequantisation factor ``inv``."""
    return fp8op.UNIT_ROUNDOFF[fmt] * t.double().abs() + SUBNORMAL_HALF[fmt] * inv.double()


def mm_bound(a, ai, fa, b, bi, fb, out_u):
    """Elementwise bound of the emulated fp8 product a b^T against the float64 one (module docstring)."""
    a64, b64 = a.double(), b.double()
    ea, eb = q_err_bound(a, ai, fa), q_err_bound(b, bi, fb)
    ah, bh = a64.abs() + ea, b64.abs() + eb
    k = a.shape[1]
    g = k * 2.0 ** -24 / (1 - k * 2.0 ** -24) + 2.0 ** -23          # accumulation + the fp32 dequantisation
    return ea @ b64.abs().t() + a64.abs() @ eb.t() + ea @ eb.t() + (g + out_u * (1 + g)) * (ah @ bh.t())


@pytest.mark.parametrize("recipe", list(fp8op.RECIPES))
def test_quantisation_within_the_formats_roundoff(recipe):
    mod = kernel(recipe, 64, 48)
    x, w, dy = data(37, 64, 48, seed=1)
    fmts = fp8op.RECIPES[recipe]
    dim = -1 if recipe.startswith("rowwise") else None
    for t, fmt, fp8 in ((x, fmts[0], mod.X_FP8), (w, fmts[1], mod.W_FP8), (dy, fmts[2], mod.DY_FP8)):
        q, inv = mod.quantise(t, fp8, dim)
        assert q.dtype == fp8 and torch.isfinite(q.float()).all()
        deq = q.double() * inv.double()
        assert ((deq - t.double()).abs() <= q_err_bound(t, inv, fmt)).all(), fmt
        amax = q.float().abs().amax(dim=-1) if dim == -1 else q.float().abs().amax()
        if dim == -1:               # rowwise: power-of-two scales: the largest element lands in [max/2, max]
            assert torch.equal(torch.log2(inv), torch.round(torch.log2(inv)))
            assert (amax >= mod.FP8_MAX[fp8] / 2).all() and (amax <= mod.FP8_MAX[fp8]).all()
        else:
            assert float(amax) == mod.FP8_MAX[fp8]
    # must fail: the e5m2 gradient of the tensorwise recipe is not within e4m3's roundoff
    if recipe == "tensorwise":
        q, inv = mod.quantise(dy, mod.DY_FP8, None)
        assert ((q.double() * inv.double() - dy.double()).abs() > q_err_bound(dy, inv, "e4m3")).any()


@pytest.mark.parametrize("shape,pad", [((37, 64), 16), ((48, 80), 16), ((5, 4100), 1), ((16, 48), 1), ((200, 16), 16)])
def test_quantisation_kernels_equal_the_torch_reference(shape, pad):
    """The rowwise recipe's Triton quantisation (a row's amax and cast in one program; the column
    amax, then scale + cast + transpose) gives the torch reference's bits: values, scales, padding.
    Inputs include exact powers of two (the pow2 scale's boundary), an outlier, a zero row, a row
    4100 wide (two column blocks of the row kernel) and 200 rows (the column amax in four row chunks,
    merged by atomic max: the first and last chunks hold the two outliers)."""
    mod = kernel("rowwise", 64, 48)
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    t = torch.randn(*shape, generator=g)
    t[0, 0] = 448.0
    t[1 % shape[0], :] = 0.0
    t[2 % shape[0], 1] = 2.0 ** -7
    t[-1, -1] = -3.0e3
    for fp8 in (mod.E4M3, mod.E5M2):
        q, inv = mod.quant_rows(t, fp8)
        rq, rinv = mod.quantise(t, fp8, -1)
        assert q.dtype == fp8 and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv)
        qt, invt = mod.quant_cols_t(t, fp8, pad)
        tp = shape[0] + (-shape[0]) % pad
        ref = torch.nn.functional.pad(t, (0, 0, 0, tp - shape[0])).t().contiguous()
        rq, rinv = mod.quantise(ref, fp8, -1)
        assert qt.shape == (shape[1], tp) and torch.equal(qt.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(invt, rinv)
    # must fail: a scale off by one binade changes the bits
    q, _ = mod.quant_rows(t * 2.0 ** -0.5, mod.E4M3)
    assert not torch.equal(q.view(torch.uint8), mod.quantise(t, mod.E4M3, -1)[0].view(torch.uint8))


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_share_switched_restores_the_setting_it_found(monkeypatch, before):
    from patchdsl.kernel_support import share

    monkeypatch.delenv("PATCHDSL_SHARE", raising=False)
    if before is not None:
        monkeypatch.setenv("PATCHDSL_SHARE", before)
    for on in (False, True):
        with pytest.raises(RuntimeError):          # restored also when the block raises
            with share.switched(on):
                assert share.enabled() is on and share.stats == {"hits": 0, "misses": 0}
                raise RuntimeError
        assert os.environ.get("PATCHDSL_SHARE") == before


def test_siblings_share_one_quantisation_of_their_input():
    """q/k/v-like siblings on the same input quantise it once in the forward and once (along tokens)
    in the backward; an in-place write to the input, or another input, is not shared; the results
    equal unshared ones bit for bit."""
    from patchdsl.kernel_support import share

    k, n = 64, 48
    mods = [kernel("rowwise", k, n, bias=False) for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    ws = [(torch.randn(n, k, generator=g) * 0.05).requires_grad_(True) for _ in range(3)]
    x0 = torch.randn(37, k, generator=g)

    def run(shared):
        with share.switched(shared):
            try:
                x = x0.clone().requires_grad_(True)
                h = x * 1.0          # one non-leaf activation read by the three projections
                ys = [m.fp8_linear(h, w) for m, w in zip(mods, ws)]
                sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
                return [y.detach() for y in ys], x.grad, [w.grad.clone() for w in ws], dict(share.stats)
            finally:
                for w in ws:
                    w.grad = None

    ys, gx, gws, st = run(True)
    ys0, gx0, gws0, st0 = run(False)
    assert st == {"hits": 4, "misses": 2}, st         # forward rows: 1 + 2 hits; backward columns: 1 + 2 hits
    assert st0 == {"hits": 0, "misses": 0}
    for a, b in zip(ys + [gx] + gws, ys0 + [gx0] + gws0):
        assert torch.equal(a, b)
    # an in-place write between two readers: the second quantises again (a miss, not a stale hit)
    share.clear()
    h = x0.clone()
    a = mods[0].fp8_linear_forward(h, ws[0].detach(), None)
    h.mul_(2.0)
    b = mods[1].fp8_linear_forward(h, ws[0].detach(), None)
    assert share.stats == {"hits": 0, "misses": 2} and torch.equal(b, mods[1].fp8_linear_forward(x0 * 2.0, ws[0].detach(), None))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("recipe", list(fp8op.RECIPES))
@pytest.mark.parametrize("m", [37, 48])
def test_forward_and_backward_within_the_recipes_bound(recipe, m):
    """y, grad_input and grad_weight of the emulated recipe against float64, element by element; the
    token count 37 is not a multiple of 16 (dW's reduction is padded).  A recipe with grad_weight in
    high precision: dW is the fp32 product, within fp32's rounding, and no longer fp8's error."""
    k, n = 64, 48
    mod = kernel(recipe, k, n, bias=True)
    x, w, dy = data(m, k, n, seed=2)
    b = torch.randn(n) * 0.1
    fx, fw, fd = (getattr(mod, a) for a in ("X_FP8", "W_FP8", "DY_FP8"))
    names = fp8op.RECIPES[recipe]
    dim = -1 if recipe.startswith("rowwise") else None

    y = mod.fp8_linear_forward(x, w, b)
    dx, dw, db = mod.fp8_linear_backward(dy, x, w, True, True, True)
    checks = []      # (name, result, a, its format, b^T, its format): result ~ a @ (b^T)^T
    checks.append(("y", y - b, x, fx, names[0], w, fw, names[1]))                       # along k
    checks.append(("grad_input", dx, dy, fd, names[2], w.t().contiguous(), fw, names[1]))    # along n
    exact_dw = dy.double().t() @ x.double()
    if recipe in fp8op.HP_GRAD_WEIGHT:
        rel_dw = float((dw.double() - exact_dw).norm() / exact_dw.norm())
        assert rel_dw < 1e-6, rel_dw               # fp32's rounding, not fp8's (~1e-2)
    else:
        checks.append(("grad_weight", dw, dy.t().contiguous(), fd, names[2], x.t().contiguous(), fx, names[0]))
        assert float((dw.double() - exact_dw).norm() / exact_dw.norm()) > 1e-4     # fp8's error
    for name, got, a, pa, fa, bt, pb, fb in checks:
        qa, ai = mod.quantise(a, pa, dim)
        qb, bi = mod.quantise(bt, pb, dim)
        exact = a.double() @ bt.double().t()
        bound = mm_bound(a, ai, fa, bt, bi, fb, 2.0 ** -24)
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), (name, float((err / bound).max()))
        assert float(err.max()) > 0            # it is fp8: not exact
        # must fail: a doubled dequantisation factor of one operand is far outside the bound
        bad = mod.scaled_mm(qa, ai, qb, 2 * bi, torch.float32, False)
        assert not ((bad.double() - exact).abs() <= bound).all(), name
    torch.testing.assert_close(db, dy.sum(0), rtol=1e-6, atol=1e-6)
    # the recipe's verify floor covers the relative Frobenius error measured here
    for name, got, a, _, _, bt, _, _ in checks:
        exact = a.double() @ bt.double().t()
        rel = float((got.double() - exact).norm() / exact.norm())
        assert rel <= fp8op.tolerance_floor(recipe, "fp32") / 2, (name, rel)


@pytest.mark.parametrize("recipe,dtype", [("rowwise", "bf16"), ("tensorwise", "fp32"), ("rowwise_with_gw_hp", "bf16")])
def test_verify_passes_emulated_sites_against_the_recipes_floor(recipe, dtype):
    report = patchdsl.verify(spec(recipe, emulate=True, dtype=dtype), lambda: tiny_model("qwen3", num_hidden_layers=1),
                             dtype=dtype, batch=2, seq=8, device="cpu")
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    floor = fp8op.tolerance_floor(recipe, dtype)
    assert len(report.sites) == 7 and all(s["floor"] == pytest.approx(floor) for s in report.sites)
    site_rows = [r for r in report.rows if r.kind == "site"]
    assert {r.quantity for r in site_rows} >= {"output", "grad_input", "grad_weight"}
    assert max(r.rel_fro_err for r in site_rows) > 2.0 ** -8      # fp8, not bf16: the dtype floor alone would fail


def test_verify_the_shipped_ops_around_fp8_projections():
    """bench/specs/qwen3_fp8.kpatch (emulated, fp32): the fused MLP and attention sites call their fp8
    projections, so they are judged with the fp8 floor too; the norms and the loss head keep fp32's
    (the end-to-end rows take the fp8 floor)."""
    from patchdsl_tools.bench.e2e import resolve_spec
    from patchdsl.parity.compare import FLOORS

    text = open(resolve_spec("qwen3_fp8")).read().replace("dtype bf16, fp32", "dtype fp32")
    report = patchdsl.verify(text.replace("recipe=rowwise", "recipe=rowwise, emulate=true"),
                             lambda: tiny_model("qwen3", num_hidden_layers=1), dtype="fp32", batch=2, seq=8,
                             device="cpu")
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    floors = {s["path"]: s.get("floor") for s in report.sites}
    fp8 = fp8op.tolerance_floor("rowwise", "fp32")
    assert floors["model.layers.0.mlp"] == pytest.approx(fp8) and floors["model.layers.0.self_attn"] == pytest.approx(fp8)
    assert floors["model.layers.0.input_layernorm"] is None and floors["model.norm"] is None
    assert floors["lm_head"] is None            # its check runs the head alone, on captured hidden states
    norm_rows = [r for r in report.rows if r.kind == "site" and r.path == "model.norm"]
    assert norm_rows and all(r.tolerance <= 4 * r.reference_err + FLOORS["fp32"] * 1.0001 for r in norm_rows)


# ------------------------------------------------------------------------------ on a Hopper GPU
fp8_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                             reason="needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)")


def _gpu_kernel(recipe: str, k: int, n: int, emulate: bool):
    from patchdsl.codegen import KernelKey, load_kernel

    op = get_op("fp8_linear")
    info = ModuleInfo("p", "Linear", (), {"Linear": {"in_features": k, "out_features": n, "bias": False}}, "bf16")
    p = op.key_params(info, {"recipe": recipe, "emulate": emulate}, "bf16", "cuda")
    return load_kernel(KernelKey.for_op(op, p))


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("recipe", list(fp8op.RECIPES))
def test_gpu_scaled_mm_computes_the_emulated_recipe(recipe):
    """torch._scaled_mm on the GPU gives the products of the same quantised operands as the emulated
    recipe (differences: fp32 accumulation order, fast accumulation in the forward), and stays within
    the recipe's floor of float64; 300 tokens: dW's padded reduction."""
    m, k, n = 300, 512, 768
    real, emu = _gpu_kernel(recipe, k, n, False), _gpu_kernel(recipe, k, n, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(m, n, device="cuda", generator=g) * 1e-2).bfloat16()
    outs = {}
    for name, mod in (("real", real), ("emu", emu)):
        y = mod.fp8_linear_forward(x, w, None)
        dx, dw, _ = mod.fp8_linear_backward(dy, x, w, True, True, False)
        outs[name] = (y, dx, dw)
    exact = (x.double() @ w.double().t(), dy.double() @ w.double(), dy.double().t() @ x.double())
    for i, q in enumerate(("y", "grad_input", "grad_weight")):
        r, e = outs["real"][i].double(), outs["emu"][i].double()
        assert r.dtype == e.dtype and r.shape == e.shape
        assert float((r - e).norm() / e.norm()) <= 2e-2, q
        assert float((r - exact[i]).norm() / exact[i].norm()) <= fp8op.tolerance_floor(recipe, "bf16"), q


@pytest.mark.gpu
@fp8_gpu
def test_gpu_verify_passes_real_fp8_sites():
    report = patchdsl.verify(spec("rowwise"), lambda: tiny_model("qwen3", num_hidden_layers=1), dtype="bf16",
                             batch=2, seq=16, device="cuda")
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    assert len(report.sites) == 7


BENCH_FP8 = [("Qwen/Qwen3-0.6B", "qwen3_fp8", "rowwise"), ("meta-llama/Llama-3.2-1B", "llama_fp8", "rowwise"),
             ("meta-llama/Llama-3.1-8B", "llama_fp8", "rowwise"),
             ("meta-llama/Llama-3.1-8B", "llama_fp8_gw_hp", "rowwise_with_gw_hp")]


@pytest.mark.parametrize("family,spec_name,recipe", BENCH_FP8, ids=[f"{s}-{f.split('/')[1]}" for f, s, _ in BENCH_FP8])
def test_bench_fp8_spec_plans_every_projection_of_the_real_shapes(gpu, family, spec_name, recipe):
    """The fp8 specs of bench/specs/ on the full architectures (meta device, a pretend H200): every
    projection's dimensions are multiples of 16, so each of the 7 per layer is an fp8 site of the
    spec's recipe, and every other rule plans too."""
    from patchdsl_tools.bench.e2e import filtered_spec
    from patchdsl.model import load_model

    gpu((9, 0), "NVIDIA H200")
    model = load_model(family, meta=True, log=None).model
    text, dropped, _ = filtered_spec(spec_name)
    assert not dropped
    p = patchdsl.plan(text, model, target="cuda", dtypes=("bf16",))
    fp8 = [s for s in p.sites if s.op == "fp8_linear"]
    assert len(fp8) == 7 * model.config.num_hidden_layers
    assert {s.flag_dict["recipe"] for s in fp8} == {recipe}
    assert len(p.sites) > len(fp8)                 # the shipped rules around them
    assert all(a == b for _, a, b in p.totals), p.totals


def _fp8_bench():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "fp8_bench.py")
    spec_ = importlib.util.spec_from_file_location("fp8_bench", path)
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    return bench


def test_fp8_bench_layer_totals_count_a_shared_input_once():
    """bench/fp8_bench.py's layer sum: x's quantisation (rows and columns) once per sibling group (q/k/v,
    gate/up: the generated module quantises their shared input once), every other piece per projection."""
    bench = _fp8_bench()
    pieces = {"bf16 fwd": 1, "bf16 dgrad": 1, "bf16 wgrad": 1, "fp8 fwd mm": 0.5, "fp8 dgrad mm": 0.5,
              "fp8 wgrad mm": 0.5, "quant x rows": 0.1, "quant x cols^T": 0.2, "quant W rows": 0.01,
              "quant W cols^T": 0.02, "quant dy rows": 0.03, "quant dy cols^T": 0.04}
    projs = [{"projection": p, "group": g, "pieces": {n: {"ms": v} for n, v in pieces.items()},
              "whole bf16 ms": 3.0, "whole fp8 ms": 2.0} for p, (_, g) in bench.PROJ.items()]
    tot = bench.layer_totals(projs)
    groups = len({g for _, g in bench.PROJ.values()})          # qkv, o, gu, down: 4
    assert groups == 4
    assert tot["bf16_ms"] == pytest.approx(7 * 3)
    assert tot["fp8_gemm_ms"] == pytest.approx(7 * 1.5)
    assert tot["fp8_quant_ms"] == pytest.approx(groups * 0.3 + 7 * 0.1)
    assert tot["fp8_ms"] == pytest.approx(tot["fp8_gemm_ms"] + tot["fp8_quant_ms"])
    assert tot["whole_fp8_ms"] == pytest.approx(14.0)
    # rowwise_with_gw_hp: per projection the fp8 wgrad (0.5) and dy's columns (0.04) give way to the bf16
    # wgrad (1); x's columns (0.2) once per group
    assert tot["gw_hp_ms"] == pytest.approx(tot["fp8_ms"] - 7 * (0.5 + 0.04 - 1) - groups * 0.2)


def test_fp8_bench_cpu_dry_run(tmp_path, capsys):
    """gpu_all part fp8_ops, at tiny sizes on the CPU (interpreter, emulated matmuls): every piece of every
    projection is timed and the summary line comes last (no timing is judged)."""
    import json

    bench = _fp8_bench()
    assert bench.main(["--tiny", "--shapes", "llama8b", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("fp8 (cpu): llama8b layer (7 projections"), last
    data = json.loads((tmp_path / "fp8.json").read_text())["shapes"]["llama8b"]
    assert [p["projection"] for p in data["projections"]] == list(bench.PROJ)
    assert all(len(p["pieces"]) == 12 and all(v["ms"] > 0 for v in p["pieces"].values()) for p in data["projections"])
    assert data["layer"]["fp8_ms"] > 0 and (tmp_path / "fp8.txt").read_text().strip().splitlines()[-1] == last


@pytest.mark.parametrize("recipe", list(fp8op.RECIPES))
@pytest.mark.parametrize("where", ["x", "w", "dy"])
def test_a_nan_in_any_operand_reaches_the_outputs_it_feeds(recipe, where):
    """A NaN in the input, the weight or the output gradient is never quantised into a finite value:
    every output it feeds is NaN (a diverging run must show), the others stay finite.  The row
    kernels count a NaN as an infinite amax (scale 0, infinite dequantisation factor) and their
    clamps keep NaN; the column amax's atomic max sees +inf."""
    k, n, m = 64, 48, 37
    mod = kernel(recipe, k, n, bias=False)
    x, w, dy = data(m, k, n, seed=4)
    {"x": x, "w": w, "dy": dy}[where][3, 5] = float("nan")
    y = mod.fp8_linear_forward(x, w, None)
    dx, dw, _ = mod.fp8_linear_backward(dy, x, w, True, True, False)
    nan = {"x": [(y, (3, slice(None))), (dw, (slice(None), 5))],          # token 3's outputs, input feature 5's dW
           "w": [(y, (slice(None), 3)), (dx, (slice(None), 5))],          # output feature 3, dx's column 5
           "dy": [(dx, (3, slice(None))), (dw, (5, slice(None)))]}[where]
    for t, at in nan:
        assert t[at].isnan().all(), (where, at)
    if recipe.startswith("rowwise"):     # per-row scales: the NaN reaches only what it feeds
        for t, at in nan:
            t[at] = 0.0
        for t in (y, dx, dw):
            assert torch.isfinite(t).all(), where
    if recipe.startswith("rowwise"):
        t = torch.randn(6, 80)
        t[2, 7] = float("nan")
        for fp8 in (mod.E4M3, mod.E5M2):
            q, inv = mod.quant_rows(t, fp8)
            assert q[2, 7].float().isnan() and torch.isinf(inv[2]).all() and torch.isfinite(inv[[0, 1, 3, 4, 5]]).all()
            qt, invt = mod.quant_cols_t(t, fp8, 16)
            assert qt[7, 2].float().isnan() and torch.isinf(invt[7]).all()
