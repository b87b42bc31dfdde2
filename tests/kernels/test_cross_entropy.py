"""fused_cross_entropy: forward and backward against a float64 reference, specialisation, refusals.

The reference is plain torch in float64 on the same (already rounded) logits.  HF's behaviour
over a batch whose labels are all ignore_index is a NaN loss (0 / 0); the fused kernel returns 0
and zero gradients instead (documented in the generated module and in loss_path).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from patchdsl.codegen import KernelKey, render
from patchdsl.ops.base import FlagTypeError
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from .helpers import ce_reference as reference, DEVICE, TORCH_DTYPES, TOL, assert_close, kernel_for, rel_err, sizes

OP = "fused_cross_entropy"
LOSS_TOL = 2e-6      # the loss is fp32 math on the given logits in every dtype


def facts(vocab, softcap=None):
    return {"vocab": vocab, "hidden": 16, "bias": False, "softcap": softcap, "logits_scaling": None, "tied": False}


def kernels(vocab, dtype, **flags):
    return kernel_for(OP, "CausalLM", facts(vocab), dtype, flags)


def inputs(rows, vocab, dtype, seed, ignore_rows=(), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * scale).to(TORCH_DTYPES[dtype]).to(DEVICE)
    y = torch.randint(0, vocab, (rows,), generator=g)
    for r in ignore_rows:
        if r < rows:
            y[r] = -100
    return x, y.to(DEVICE), g


SHAPES = sizes(
    cpu=[(6, 1000), (1, 1500), (5, 3000), (4, 1024), (3, 700)],
    gpu=[(2048, 151936), (4096, 32000), (1, 128256), (1000, 50257), (64, 1024)],
)
FLAG_SETS = [
    {},
    {"label_smoothing": 0.1},
    {"softcap": 30.0},
    {"z_loss": 1e-3},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.05, "softcap": 20.0, "z_loss": 1e-4, "reduction": "sum"},
    {"programs_per_sm": 1},
    {"block": 256, "softcap": 30.0, "reduction": "none"},
]


def _grad_output(ref, g):
    if ref.dim() == 0:
        return torch.tensor(1.7, dtype=torch.float64)
    return torch.randn(ref.shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_forward_backward_default(rows, vocab, dtype):
    x, y, g = inputs(rows, vocab, dtype, seed=rows * 7 + vocab, ignore_rows=(1,))
    mod = kernels(vocab, dtype)
    xs = x.clone().requires_grad_()
    loss = mod.cross_entropy(xs, y)
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, y)
    go = _grad_output(ref, g).to(DEVICE)
    (ref * go).sum().backward()
    (loss * go.float()).sum().backward()
    assert_close(loss, ref, "fp32", "loss", factor=LOSS_TOL / TOL["fp32"])
    peer = None
    if dtype == "fp16":          # what HF's loss gives in fp16 (helpers: fp16 underflow)
        xp = x.clone().requires_grad_()
        (F.cross_entropy(xp.float(), y, ignore_index=-100) * go.float()).backward()
        peer = xp.grad
    assert_close(xs.grad, xr.grad, dtype, "dlogits", peer=peer)
    assert xs.grad.dtype == x.dtype
    assert torch.equal(xs.detach(), x), "the caller's logits were modified"


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_modes(flags, dtype):
    rows, vocab = sizes(cpu=[(5, 1500)], gpu=[(512, 151936)])[0]
    x, y, g = inputs(rows, vocab, dtype, seed=3, ignore_rows=(2,))
    mod = kernels(vocab, dtype, **flags)
    xs = x.clone().requires_grad_()
    loss = mod.cross_entropy(xs, y)
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, y, **{k: v for k, v in flags.items() if k not in ("block", "programs_per_sm")})
    assert loss.shape == ref.shape
    go = _grad_output(ref, g).to(DEVICE)
    (ref * go).sum().backward()
    (loss * go.float()).sum().backward()
    assert_close(loss, ref, "fp32", "loss", factor=LOSS_TOL / TOL["fp32"])
    assert_close(xs.grad, xr.grad, dtype, "dlogits")
    # the rows whose label is ignored get exactly zero gradient
    assert torch.count_nonzero(xs.grad[2].float()) == 0


@pytest.mark.parametrize("num_items", ["tensor", "int"])
def test_num_items_in_batch(num_items):
    rows, vocab = sizes(cpu=[(6, 1000)], gpu=[(1024, 151936)])[0]
    x, y, g = inputs(rows, vocab, "fp32", seed=11, ignore_rows=(0, 3))
    n = torch.tensor(17, device=DEVICE) if num_items == "tensor" else 17
    mod = kernels(vocab, "fp32")
    xs = x.clone().requires_grad_()
    loss = mod.cross_entropy(xs, y, n)
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, y, num_items=n)
    ref.backward()
    loss.backward()
    assert_close(loss, ref, "fp32", "loss")
    assert_close(xs.grad, xr.grad, "fp32", "dlogits")
    # HF's fixed_cross_entropy: sum / num_items_in_batch
    hf = torch.nn.functional.cross_entropy(x.double(), y, ignore_index=-100, reduction="sum") / 17
    assert abs(loss.item() - hf.item()) <= 1e-5 * abs(hf.item())


def test_all_rows_ignored_gives_nan_as_hf():
    vocab = sizes(cpu=[1500], gpu=[151936])[0]
    x, y, _ = inputs(3, vocab, "bf16", seed=5)
    y[:] = -100
    xs = x.clone().requires_grad_()
    loss = kernels(vocab, "bf16").cross_entropy(xs, y)
    loss.backward()
    xr = x.float().requires_grad_()
    hf = torch.nn.functional.cross_entropy(xr, y, ignore_index=-100)
    hf.backward()
    assert torch.isnan(loss) and torch.isnan(hf)           # 0 / 0, as HF's mean
    assert torch.count_nonzero(xs.grad) == 0 and torch.count_nonzero(xr.grad) == 0


def test_grad_output_one_and_other_values():
    """grad_output == 1 skips the scaling kernel on the device; any other value scales."""
    vocab = sizes(cpu=[1000], gpu=[151936])[0]
    x, y, _ = inputs(4, vocab, "fp32", seed=9)
    mod = kernels(vocab, "fp32")
    a = x.clone().requires_grad_()
    mod.cross_entropy(a, y).backward()
    b = x.clone().requires_grad_()
    (mod.cross_entropy(b, y) * 0.25).backward()
    c = x.clone().requires_grad_()
    (mod.cross_entropy(c, y) * 0.0).backward()
    assert torch.allclose(b.grad, a.grad * 0.25, rtol=1e-6, atol=0)
    assert torch.count_nonzero(c.grad) == 0
    xr = x.double().requires_grad_()
    reference(xr, y).backward()
    assert rel_err(a.grad, xr.grad) <= TOL["fp32"]


def test_no_grad_computes_loss_only():
    vocab = 1000
    x, y, _ = inputs(3, vocab, "fp32", seed=1)
    mod = kernels(vocab, "fp32")
    with torch.no_grad():
        loss = mod.cross_entropy(x.clone().requires_grad_(), y)
    assert not loss.requires_grad
    _, dx = mod.cross_entropy_forward(x, y, compute_grad=False)
    assert dx is None
    assert_close(loss, reference(x, y), "fp32", "loss")


def test_accepts_batched_logits_and_noncontiguous():
    vocab = 700
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, vocab + 5, generator=g)[..., :vocab].to(DEVICE)       # non-contiguous rows
    y = torch.randint(0, vocab, (2, 3), generator=g).to(DEVICE)
    xs = x.clone().requires_grad_()
    loss = kernels(vocab, "fp32").cross_entropy(xs, y)
    loss.backward()
    xr = x.double().requires_grad_()
    reference(xr.reshape(-1, vocab), y.reshape(-1)).backward()
    assert xs.grad.shape == x.shape
    assert_close(xs.grad, xr.grad, "fp32", "dlogits")


def test_label_count_mismatch_raises():
    x, y, _ = inputs(4, 700, "fp32", seed=1)
    with pytest.raises(ValueError, match="labels"):
        kernels(700, "fp32").cross_entropy(x, y[:3])


# ---------------------------------------------------------------- specialisation
def _source(vocab, target="interpreter", dtype="bf16", **flags):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(vocab)}, dtype=dtype)
    params = op.key_params(info, f, dtype, target)
    return render(KernelKey.for_op(op, params)), params


def _row_fn(src):
    return src[src.index("def ce_row_"):src.index("def ce_fwd_")]


def test_single_block_power_of_two_has_no_loop_and_no_mask():
    src, p = _source(1024)
    row = _row_fn(src)
    assert p["single_pass"] and p["BLOCK"] == 1024
    assert "for start in range" not in row and "mask=" not in row


def test_single_block_non_power_of_two_masks_tail_without_loop():
    row = _row_fn(_source(1000)[0])
    assert "for start in range" not in row and "mask=msk" in row


def test_long_row_loops_online_logsumexp():
    src, p = _source(3000)
    row = _row_fn(src)
    assert not p["single_pass"] and p["n_tiles"] == 3
    assert "for start in range(BLOCK, VOCAB, BLOCK)" in row and "m_new = tl.maximum" in row
    # gpu: 151936 loops with the GPU block; 16384 is one pass there
    assert not _source(151936, target="cuda")[1]["single_pass"]
    assert _source(16384, target="cuda")[1]["single_pass"]


def test_persistent_grid_variant():
    per = _source(3000, programs_per_sm=1)[0]
    assert "for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0))" in per
    flat = _source(3000, programs_per_sm=0)[0]
    assert "tl.num_programs" not in flat[flat.index("def ce_fwd_"):flat.index("def _n_sms")]
    assert _source(151936, target="cuda")[1]["programs_per_sm"] == 0     # long rows on the GPU too
    assert _source(4096, target="cuda")[1]["programs_per_sm"] == 0      # one pass, one program per row


def test_modes_are_compiled_in():
    plain = _row_fn(_source(1500)[0])
    assert "SOFTCAP" not in plain and "SMOOTHING" not in plain and "Z_LOSS" not in plain
    capped = _row_fn(_source(1500, softcap=30.0)[0])
    assert "SOFTCAP" in capped and "tl.sigmoid" in capped and "libdevice" not in capped
    assert "libdevice.tanh" in _row_fn(_source(1500, target="cuda", softcap=30.0)[0])
    assert "SMOOTHING" in _row_fn(_source(1500, label_smoothing=0.1)[0])
    assert "Z_LOSS" in _row_fn(_source(1500, z_loss=1e-4)[0])
    mean, _ = _source(1500)
    none, _ = _source(1500, reduction="none")
    assert "count.reciprocal()" in mean and "count.reciprocal()" not in none
    assert "IGNORE_INDEX = tl.constexpr(-1)" in _source(1500, ignore_index=-1)[0]


def test_kernel_name_says_what_it_is_for():
    _, p = _source(151936, target="cuda", softcap=30.0, label_smoothing=0.1)
    name = get_op(OP).kernel_name(p)
    assert name == "fused_cross_entropy_bf16_v151936_mean_softcap30_ls0p1_cuda"


def test_every_kernel_global_is_constexpr():
    """Triton (3.x on the GPU) refuses non-constexpr globals inside @jit functions."""
    src, _ = _source(3000, target="cuda", softcap=30.0, label_smoothing=0.1, z_loss=1e-4)
    for name in ("VOCAB", "BLOCK", "IGNORE_INDEX", "SOFTCAP", "SMOOTHING", "Z_LOSS"):
        assert f"{name} = tl.constexpr(" in src, name


# ---------------------------------------------------------------- flags and refusals
def test_flags_are_typed():
    op = get_op(OP)
    assert op.flag("reduction").coerce("sum") == "sum"
    with pytest.raises(FlagTypeError):
        op.flag("reduction").coerce("avg")
    with pytest.raises(FlagTypeError):
        op.flag("label_smoothing").coerce(1.5)
    assert op.flag("softcap").coerce(None) is None and op.flag("softcap").coerce("auto") == "auto"
    with pytest.raises(FlagTypeError):
        op.flag("ignore_index").coerce(1.5)


def test_check_refuses_without_causal_lm_and_double_softcap():
    op = get_op(OP)
    lin = torch.nn.Linear(16, 700, bias=False)
    bare = ModuleInfo("head", "Linear", (), {"Linear": {"in_features": 16, "out_features": 700, "bias": False}})
    assert "no enclosing causal LM" in op.check(lin, bare, op.default_flags())
    gemma = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(700, softcap=30.0)})
    f = op.default_flags()
    assert op.check(lin, gemma, f) is None
    f["softcap"] = 30.0
    assert "twice" in op.check(lin, gemma, f)
    assert op.check(torch.nn.Embedding(700, 16), ModuleInfo("x", "E", (), {"CausalLM": facts(700)}),
                    op.default_flags()) is not None


# ---------------------------------------------------------------- the GPU path compiles
CUDA_COMPILE = textwrap.dedent("""
    import importlib.util, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from patchdsl.codegen import KernelKey, render
    from patchdsl.model.info import ModuleInfo
    from patchdsl.ops.registry import get_op

    PT = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
    target = GPUTarget("cuda", 90, 32)
    n = 0
    for opname, vocab, dtype, flags, facts in [
        ("fused_cross_entropy", 151936, "bf16", {}, {}),
        ("fused_cross_entropy", 151936, "fp16", {"label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0,
                                                  "programs_per_sm": 0}, {}),
        ("fused_cross_entropy", 4096, "fp32", {"reduction": "none"}, {}),
        ("fused_cross_entropy", 1000, "bf16", {"ignore_index": -1}, {}),
        ("fused_linear_cross_entropy", 151936, "bf16", {}, {"softcap": 30.0, "logits_scaling": 4.0}),
        ("fused_linear_cross_entropy", 32000, "fp32", {"label_smoothing": 0.1}, {}),
        ("fused_linear_cross_entropy", 151936, "bf16", {"check_labels": False}, {"logit_multiplier": 0.5}),
    ]:
        op = get_op(opname)
        f = op.default_flags()
        f.update(flags)
        fa = {"vocab": vocab, "hidden": 1024, "bias": True, "softcap": None, "logits_scaling": None, "tied": False}
        fa.update(facts)
        p = op.key_params(ModuleInfo("lm_head", "Linear", (), {"CausalLM": fa}, dtype=dtype), f, dtype, "cuda")
        path = os.path.join(sys.argv[1], op.kernel_name(p) + ".py")
        open(path, "w").write(render(KernelKey.for_op(op, p)))
        spec = importlib.util.spec_from_file_location(op.kernel_name(p), path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        sig = {"X": PT[dtype], "stride_x": "i64", "DX": PT[dtype], "stride_dx": "i64", "Y": "*i64",
               "LOSS": "*fp32", "SCALE": "*fp32", "scale_stride": "i32", "OK": "*i32", "n_rows": "i32",
               "COMPUTE_GRAD": "constexpr"}
        for grad in (True, False):
            triton.compile(ASTSource(getattr(m, "ce_fwd_" + p["tag"]), sig, constexprs={"COMPUTE_GRAD": grad}),
                           target=target, options={"num_warps": p["num_warps"]})
            n += 1
    triton.compile(ASTSource(m.scale_unless_one, {"X": "*bf16", "G": "*fp32", "n": "i64", "SCALE_BLOCK": "constexpr"},
                             constexprs={"SCALE_BLOCK": 4096}), target=target)
    triton.compile(ASTSource(m.scale_rows, {"X": "*bf16", "stride_x": "i32", "G": "*fp32", "n_cols": "i32",
                                            "SCALE_BLOCK": "constexpr"}, constexprs={"SCALE_BLOCK": 4096}), target=target)
    print("compiled", n + 2)
""")


def test_cuda_variants_compile_for_sm90(tmp_path):
    """The interpreter accepts code the GPU compiler rejects (non-constexpr globals, loop-carried
    values changing type, int arguments used as tensors): compile the cuda-target kernels for
    sm_90 with Triton's own compiler (no GPU needed; ptxas ships with the triton wheel)."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", CUDA_COMPILE, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas in this triton installation")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled 16" in r.stdout


# ---------------------------------------------------------------- label values, as torch's cross_entropy
# Every kernel that reads class labels (patchdsl/kernel_support/labels.py): each case must give what
# F.cross_entropy gives on the same logits: the same exception class, or the same value / NaN / inf.
LABEL_VOCAB, LABEL_HIDDEN = 300, 32
LABEL_KERNELS = {
    "ce": ("fused_cross_entropy", {}),
    "ce_looped": ("fused_cross_entropy", {"block": 128}),       # the target's logit read by address
    "lce_chunked": ("fused_linear_cross_entropy", {}),
    "lce_fused": ("fused_linear_cross_entropy", {"mode": "fused"}),
    "logprobs": ("fused_linear_logprobs", {}),
}
V = LABEL_VOCAB
LABEL_CASES = {                       # labels of 5 tokens (or their dtype), num_items_in_batch
    "in_range": ([1, 7, 299, 0, 42], None),
    "ignored": ([1, -100, 5, -100, 2], None),
    "minus_one": ([1, -1, 5, 6, 2], None),
    "vocab": ([1, V, 5, 6, 2], None),
    "vocab_plus_5": ([V + 5, 2, 5, 6, 2], None),
    "all_ignored": ([-100] * 5, None),
    "float": ("float32", None),
    "int32": ("int32", None),
    "num_items_0": ([1, 7, 299, 0, 42], 0),
}


def _label_run(name, op_name, flags, labels, num_items):
    torch.manual_seed(0)
    h = torch.randn(5, LABEL_HIDDEN, device=DEVICE)
    w = torch.randn(LABEL_VOCAB, LABEL_HIDDEN, device=DEVICE) * 0.3
    if op_name == "fused_cross_entropy":
        mod = kernels(LABEL_VOCAB, "fp32", **flags)
        return lambda: mod.cross_entropy(h @ w.T, labels, num_items)
    fa = {"vocab": LABEL_VOCAB, "hidden": LABEL_HIDDEN, "bias": False, "softcap": None, "logits_scaling": None,
          "tied": False}
    mod = kernel_for(op_name, "CausalLM", fa, "fp32", flags)
    if op_name == "fused_linear_logprobs":
        return lambda: mod.linear_logprobs(h, w, None, labels)[0].sum()
    return lambda: mod.linear_cross_entropy(h, w, None, labels, num_items)


def _outcome(fn):
    try:
        return fn()
    except Exception as e:                # the class is what is compared
        return type(e)


@pytest.mark.parametrize("case", list(LABEL_CASES))
@pytest.mark.parametrize("kern", list(LABEL_KERNELS))
def test_label_values_behave_as_torch_cross_entropy(kern, case):
    op_name, flags = LABEL_KERNELS[kern]
    spec, num_items = LABEL_CASES[case]
    if isinstance(spec, str):
        labels = torch.tensor([1, 7, 3, 0, 4], dtype=getattr(torch, spec), device=DEVICE)
    else:
        labels = torch.tensor(spec, device=DEVICE)
    if op_name == "fused_linear_logprobs" and (num_items is not None or case in ("all_ignored",)):
        pytest.skip("log-probs have no reduction")
    torch.manual_seed(0)
    h = torch.randn(5, LABEL_HIDDEN, device=DEVICE)
    w = torch.randn(LABEL_VOCAB, LABEL_HIDDEN, device=DEVICE) * 0.3

    def hf():
        z = (h @ w.T).double()
        if num_items is None:
            return F.cross_entropy(z, labels, ignore_index=-100)
        return F.cross_entropy(z, labels, ignore_index=-100, reduction="sum") / num_items

    want, got = _outcome(hf), _outcome(_label_run(kern, op_name, flags, labels, num_items))
    if isinstance(want, type):
        assert got is want, f"HF raises {want.__name__}, patchdsl gave {got!r}"
        return
    assert not isinstance(got, type), f"patchdsl raised {got.__name__} where HF gives {want}"
    if op_name == "fused_linear_logprobs":       # sum of log p(label) (0 where ignored), not a loss
        return
    if torch.isnan(want) or torch.isinf(want):
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want)), \
            (got, want)
    else:
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (got, want)


def test_label_check_off_is_a_variant_without_the_check():
    """check_labels=false (for measuring the check's cost): no flag, no assert, a distinct kernel."""
    src, p = _source(300, target="cuda")
    off, q = _source(300, target="cuda", check_labels=False)
    assert "check_flag(" in src and "tl.store(ok_ptr, 0)" in src
    assert "check_flag(" not in off and "tl.store(ok_ptr" not in off
    op = get_op(OP)
    assert op.kernel_name(q).endswith("_nocheck_cuda") and op.kernel_name(q) != op.kernel_name(p)
    y = torch.tensor([1, 300, 3], device=DEVICE)
    x = torch.randn(3, 300, device=DEVICE)
    assert torch.isfinite(kernels(300, "fp32", check_labels=False).cross_entropy(x, y))


@pytest.mark.skipif(DEVICE != "cuda", reason="the device-side assert needs a GPU")
def test_out_of_bounds_label_trips_a_device_assert_without_host_sync():
    """On the GPU the check is torch._assert_async on a flag the kernel clears: the call itself
    returns (no host sync); the next synchronisation fails with a device-side assert, as HF's
    F.cross_entropy does.  In a child process: a device-side assert ends the CUDA context."""
    child = textwrap.dedent('''
        import torch
        from tests.kernels.test_cross_entropy import kernels
        x = torch.randn(4, 300, device="cuda")
        mod = kernels(300, "fp32")
        ok = mod.cross_entropy(x, torch.tensor([1, 2, 3, -100], device="cuda"))
        torch.cuda.synchronize()
        loss = mod.cross_entropy(x, torch.tensor([1, 300, 3, 4], device="cuda"))
        print("RETURNED", flush=True)
        torch.cuda.synchronize()
        print("NO ASSERT", flush=True)
    ''')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=root, timeout=300)
    assert "RETURNED" in r.stdout and "NO ASSERT" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "device-side assert" in r.stderr or "Assertion" in r.stderr, r.stderr[-2000:]
