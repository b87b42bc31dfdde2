"""fused_linear_cross_entropy: loss and grad_hidden / grad_weight / grad_bias against float64.

The float64 reference materialises the logits from the same (already rounded) hidden states
and weight.  The fused path rounds the chunk's logits to the weight dtype (as the LM head does)
and d(loss)/d(logits) to it before the two gradient matmuls, so its gradient error is a few
roundings of that dtype: within the helpers' TOL (4 u).  On the interpreter a chunk is 16 tokens,
so the test shapes span several chunks and a ragged last one.
"""

import pytest
import torch
import torch.nn.functional as F

from patchdsl.codegen import KernelKey, render
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.linear_cross_entropy import CHUNK_BUDGET
from patchdsl.ops.registry import get_op

from .helpers import ce_reference, rel_err, DEVICE, ON_GPU, TORCH_DTYPES, TOL, assert_close, kernel_for, sizes

OP = "fused_linear_cross_entropy"


def facts(vocab, hidden, bias=False, softcap=None, logits_scaling=None):
    return {"vocab": vocab, "hidden": hidden, "bias": bias, "softcap": softcap,
            "logits_scaling": logits_scaling, "tied": False}


def kernels(n_vocab, hidden, dtype, bias=False, softcap=None, logits_scaling=None, **flags):
    return kernel_for(OP, "CausalLM", facts(n_vocab, hidden, bias, softcap, logits_scaling), dtype, flags)


def make(n, hidden, n_vocab, dtype, bias, seed, ignore=(3,)):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    h = torch.randn(n, hidden, generator=g).to(dt).to(DEVICE)
    w = (torch.randn(n_vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(dt).to(DEVICE)
    b = (torch.randn(n_vocab, generator=g) * 0.5).to(dt).to(DEVICE) if bias else None
    y = torch.randint(0, n_vocab, (n,), generator=g)
    for r in ignore:
        if r < n:
            y[r] = -100
    return h, w, b, y.to(DEVICE), g


def reference(h, w, b, y, label_smoothing=0.0, softcap=None, z_loss=0.0, reduction="mean", num_items=None,
              logits_scaling=None):
    x = h @ w.T
    if b is not None:
        x = x + b
    if logits_scaling:
        x = x / logits_scaling
    return ce_reference(x, y, label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                        reduction=reduction, num_items=num_items)


def run_both(mod, h, w, b, y, g, ref_kw=None, num_items=None, grad_output=None):
    ref_kw = ref_kw or {}
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if b is not None else None
    loss = mod.linear_cross_entropy(hs, ws, bs, y, num_items)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    br = b.double().requires_grad_() if b is not None else None
    ref = reference(hr, wr, br, y, num_items=num_items, **ref_kw)
    if grad_output is None:
        grad_output = (torch.tensor(0.7, dtype=torch.float64) if ref.dim() == 0
                       else torch.randn(ref.shape, generator=g, dtype=torch.float64))
    go = grad_output.to(DEVICE)
    (ref * go).sum().backward()
    (loss * go.float()).sum().backward()
    return (loss, hs.grad, ws.grad, bs.grad if bs is not None else None), (ref, hr.grad, wr.grad,
                                                                            br.grad if br is not None else None)


def torch_path(h, w, b, y, grad_output):
    """HF's LM head + loss in the inputs' dtype: logits = h @ W.T (+ b), cross entropy in fp32."""
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if b is not None else None
    loss = F.cross_entropy(F.linear(hs, ws, bs).float(), y, ignore_index=-100)
    (loss * grad_output.to(loss.device).float()).backward()
    return loss, hs.grad, ws.grad, bs.grad if bs is not None else None


def check(out, ref, dtype, loss_tol=None, peer=None):
    loss, gh, gw, gb = out
    rl, rh, rw, rb = ref
    pl, ph, pw, pb = peer if peer is not None else (None,) * 4
    # the loss sees logits rounded to the weight dtype (as the LM head's output is)
    assert_close(loss, rl, dtype, "loss", factor=loss_tol if loss_tol else 0.25, peer=pl)
    assert_close(gh, rh, dtype, "grad_hidden", peer=ph)
    assert_close(gw, rw, dtype, "grad_weight", peer=pw)
    if rb is not None:
        assert_close(gb, rb, dtype, "grad_bias", peer=pb)


SHAPES = sizes(
    cpu=[(40, 64, 1500, False), (37, 48, 1000, True), (1, 32, 3000, False), (20, 40, 1024, True)],
    gpu=[(4096, 1024, 151936, False), (2048, 2048, 128256, True), (1, 1024, 151936, False), (1000, 896, 32000, True)],
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n,hidden,n_vocab,bias", SHAPES)
def test_forward_backward(n, hidden, n_vocab, bias, dtype):
    h, w, b, y, g = make(n, hidden, n_vocab, dtype, bias, seed=n + hidden + n_vocab)
    mod = kernels(n_vocab, hidden, dtype, bias=bias)
    go = torch.tensor(0.7, dtype=torch.float64)
    out, ref = run_both(mod, h, w, b, y, g, grad_output=go)
    # fp16: also allowed twice PyTorch's own fp16 error (helpers: fp16 underflow at real sizes)
    check(out, ref, dtype, peer=torch_path(h, w, b, y, go) if dtype == "fp16" else None)
    assert out[1].dtype == h.dtype and out[2].dtype == w.dtype


FLAG_SETS = [
    ({"label_smoothing": 0.1}, {}),
    ({"z_loss": 1e-3}, {}),
    ({"reduction": "sum"}, {}),
    ({"reduction": "none"}, {}),
    ({"accumulate": "weight"}, {}),
    ({"accumulate": "fp32"}, {}),
    ({"chunk": 7}, {}),
    ({"programs_per_sm": 1, "block": 256}, {}),
    ({}, {"softcap": 30.0}),
    ({}, {"logits_scaling": 4.0}),
    ({"label_smoothing": 0.05, "z_loss": 1e-4, "reduction": "sum"}, {"softcap": 20.0}),
]


@pytest.mark.parametrize("flags,model", FLAG_SETS,
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_modes(flags, model, dtype):
    n, hidden, n_vocab = sizes(cpu=[(35, 32, 1500)], gpu=[(1024, 1024, 151936)])[0]
    h, w, b, y, g = make(n, hidden, n_vocab, dtype, True, seed=21)
    mod = kernels(n_vocab, hidden, dtype, bias=True, **model, **flags)
    ref_kw = {k: v for k, v in flags.items() if k in ("label_smoothing", "z_loss", "reduction")}
    ref_kw.update(model)
    out, ref = run_both(mod, h, w, b, y, g, ref_kw)
    check(out, ref, dtype)
    assert out[0].shape == ref[0].shape


@pytest.mark.parametrize("kind", ["tensor", "int"])
def test_num_items_in_batch(kind):
    n, hidden, n_vocab = sizes(cpu=[(30, 32, 1000)], gpu=[(2048, 1024, 151936)])[0]
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", False, seed=4, ignore=(0, 5, 9))
    num = torch.tensor(n + 11, device=DEVICE) if kind == "tensor" else n + 11
    out, ref = run_both(kernels(n_vocab, hidden, "fp32"), h, w, b, y, g, num_items=num)
    check(out, ref, "fp32")


def test_all_ignored_gives_nan_loss_and_zero_grads():
    n, hidden, n_vocab = 20, 32, 1000
    h, w, b, y, g = make(n, hidden, n_vocab, "bf16", False, seed=8)
    y[:] = -100
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = kernels(n_vocab, hidden, "bf16").linear_cross_entropy(hs, ws, None, y)
    loss.backward()
    assert torch.isnan(loss)                 # HF: mean over zero tokens = 0 / 0
    assert torch.count_nonzero(hs.grad) == 0 and torch.count_nonzero(ws.grad) == 0


def test_grad_output_one_skips_scaling_and_other_values_scale():
    n, hidden, n_vocab = 24, 32, 1000
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", True, seed=5)
    mod = kernels(n_vocab, hidden, "fp32", bias=True)
    grads = []
    for s in (1.0, 0.5, 0.0):
        hs, ws, bs = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        (mod.linear_cross_entropy(hs, ws, bs, y) * s).backward()
        grads.append((hs.grad, ws.grad, bs.grad))
    for a, c in zip(grads[0], grads[1]):
        assert torch.allclose(c, a * 0.5, rtol=1e-6, atol=0)
    assert all(torch.count_nonzero(t) == 0 for t in grads[2])


def test_frozen_weight_and_frozen_hidden():
    n, hidden, n_vocab = 20, 32, 1000
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", False, seed=6)
    mod = kernels(n_vocab, hidden, "fp32")
    hs = h.clone().requires_grad_()
    mod.linear_cross_entropy(hs, w, None, y).backward()          # frozen lm_head (e.g. LoRA elsewhere)
    hr = h.double().requires_grad_()
    reference(hr, w.double(), None, y).backward()
    assert_close(hs.grad, hr.grad, "fp32", "grad_hidden")
    ws = w.clone().requires_grad_()
    mod.linear_cross_entropy(h, ws, None, y).backward()          # only the head trains
    wr = w.double().requires_grad_()
    reference(h.double(), wr, None, y).backward()
    assert_close(ws.grad, wr.grad, "fp32", "grad_weight")
    _, gh, gw, gb = mod.linear_cross_entropy_forward(h, w, None, y, need_h=False, need_w=True, need_b=False)
    assert gh is None and gw is not None and gb is None


def test_no_grad_is_loss_only():
    n, hidden, n_vocab = 20, 32, 1000
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", False, seed=7)
    mod = kernels(n_vocab, hidden, "fp32")
    with torch.no_grad():
        loss = mod.linear_cross_entropy(h.requires_grad_(), w, None, y)
    assert not loss.requires_grad
    assert_close(loss, reference(h.double(), w.double(), None, y), "fp32", "loss")


def test_hidden_in_another_dtype_is_cast_to_the_weight_dtype():
    """Hidden states in fp32 with a bf16 head (what autocast-free mixed setups give)."""
    n, hidden, n_vocab = 20, 32, 1000
    h, w, b, y, g = make(n, hidden, n_vocab, "bf16", False, seed=9)
    h32 = h.float().requires_grad_()
    loss = kernels(n_vocab, hidden, "bf16").linear_cross_entropy(h32, w, None, y)
    loss.backward()
    assert h32.grad.dtype == torch.float32
    hr = h.double().requires_grad_()
    reference(hr, w.double(), None, y).backward()
    assert_close(h32.grad, hr.grad, "bf16", "grad_hidden")


def test_label_count_mismatch_raises():
    h, w, b, y, g = make(10, 32, 700, "fp32", False, seed=1)
    with pytest.raises(ValueError, match="labels"):
        kernels(700, 32, "fp32").linear_cross_entropy(h, w, None, y[:9])


@pytest.mark.skipif(not ON_GPU, reason="device memory accounting needs CUDA")
def test_extra_memory_is_one_chunk_of_logits():
    n, hidden, n_vocab = 16384, 1024, 151936
    h, w, b, y, g = make(n, hidden, n_vocab, "bf16", False, seed=1)
    mod = kernels(n_vocab, hidden, "bf16")
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    ws.grad = torch.zeros_like(ws)
    hs.grad = torch.zeros_like(hs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = mod.linear_cross_entropy(hs, ws, None, y)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # the gradients themselves (grad_hidden + grad_weight, already allocated above, are produced
    # as new tensors then accumulated): allow them once, plus one chunk's logits and 16 MiB.
    grads = hs.numel() * 2 + ws.numel() * 2
    chunk_logits = mod.CHUNK * n_vocab * 2
    assert mod.CHUNK == 2048
    assert extra <= grads + chunk_logits + 16 * 2**20, f"extra peak {extra / 2**20:.0f} MiB"


# ---------------------------------------------------------------- specialisation and naming
def _source(n_vocab, hidden, target="interpreter", dtype="bf16", bias=False, **flags):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(n_vocab, hidden, bias)}, dtype=dtype)
    p = op.key_params(info, f, dtype, target)
    return render(KernelKey.for_op(op, p)), p


def test_auto_chunk_is_a_power_of_two_within_the_budget_on_gpu():
    _, p = _source(151936, 1024, target="cuda")
    assert p["chunk"] == 2048 and p["chunk"] * 151936 * 2 <= CHUNK_BUDGET < 2 * p["chunk"] * 151936 * 2
    assert p["accumulate"] == "weight"          # an fp32 copy of grad_weight would be 594 MiB
    _, small = _source(32000, 512, target="cuda")
    assert small["accumulate"] == "fp32" and small["chunk"] == 8192      # capped
    _, p32 = _source(151936, 1024, target="cuda", dtype="fp32")
    assert p32["chunk"] == 1024
    _, gemma = _source(262144, 1152, target="cuda")
    assert gemma["chunk"] == 1024
    assert _source(1500, 64, chunk=100)[1]["chunk"] == 100


def test_specialisation_changes_the_code():
    plain, _ = _source(1024, 64)
    assert "torch.mm(hc, wt, out=lc)" in plain and "addmm(b" not in plain
    row = plain[plain.index("def ce_row_"):plain.index("def ce_fwd_")]
    assert "for start in range" not in row and "mask=" not in row
    biased, _ = _source(3000, 64, bias=True)
    assert "torch.addmm(b, hc, wt, out=lc)" in biased and "gb +=" in biased
    assert "for start in range(BLOCK, VOCAB, BLOCK)" in biased
    fp32acc, _ = _source(3000, 64, target="cuda", accumulate="fp32")
    assert "out_dtype=torch.float32" in fp32acc
    wacc, _ = _source(3000, 64, target="cuda", accumulate="weight")
    assert "out_dtype" not in wacc and "acc.addmm_(dl.t(), hc)" in wacc
    none, _ = _source(3000, 64, reduction="none")
    assert "linear_cross_entropy_recompute(h, w, b, labels, grad_output" in none
    assert "ctx.grads" not in none


def test_kernel_name():
    _, p = _source(151936, 1024, target="cuda")
    name = get_op(OP).kernel_name(p)
    assert name.startswith("fused_linear_cross_entropy_bf16_h1024_v151936_mean_c")
    assert name.endswith("_accweight_cuda")


def test_check_refuses_mismatches():
    op = get_op(OP)
    f = op.default_flags()
    lin = torch.nn.Linear(32, 700, bias=False)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(700, 32)})
    assert op.check(lin, info, f) is None
    assert "not the causal LM's lm_head" in op.check(torch.nn.Linear(32, 600), info, f)
    bare = ModuleInfo("head", "Linear", (), {"Linear": {"in_features": 32, "out_features": 700, "bias": False}})
    assert "no enclosing causal LM" in op.check(lin, bare, f)
    gemma = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(700, 32, softcap=30.0)})
    assert op.check(lin, gemma, f) is None
    assert "softcap" in op.check(lin, gemma, dict(f, softcap=None))
    assert "softcap" in op.check(lin, info, dict(f, softcap=15.0))


# ---------------------------------------------------------------- mode=fused (logits never in memory)
# Interpreter tiles are 32 tokens x 32 vocab x 16 hidden with bands of 2 vocab tiles and 3 "SMs",
# so 40 tokens x 200 vocab leave a ragged token block, a ragged last vocab tile, a ragged last band
# (200 = 3 x 64 + 8) and a forward split into 3 vocab ranges; hidden 24 leaves a ragged K step.
FUSED_SHAPES = sizes(
    cpu=[(40, 32, 200, False), (37, 24, 200, True), (1, 32, 200, False), (64, 48, 96, True)],
    gpu=[(4096, 1024, 151936, False), (1000, 896, 32000, True), (1, 1024, 151936, False), (3000, 2304, 256000, False)],
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,hidden,n_vocab,bias", FUSED_SHAPES)
def test_fused_forward_backward(n, hidden, n_vocab, bias, dtype):
    h, w, b, y, g = make(n, hidden, n_vocab, dtype, bias, seed=n + hidden + n_vocab + 1)
    mod = kernels(n_vocab, hidden, dtype, bias=bias, mode="fused")
    assert "lce_stats" in vars(mod) and "ce_fwd_" not in "".join(vars(mod))
    out, ref = run_both(mod, h, w, b, y, g, grad_output=torch.tensor(0.7, dtype=torch.float64))
    check(out, ref, dtype)
    assert out[1].dtype == h.dtype and out[2].dtype == w.dtype


FUSED_FLAG_SETS = [
    ({"label_smoothing": 0.1}, {}),
    ({"z_loss": 1e-3}, {}),
    ({"reduction": "sum"}, {}),
    ({"reduction": "none"}, {}),
    ({"band": 40}, {}),                      # rounded down to one 32-column tile: 7 bands
    ({"ignore_index": 7}, {}),
    ({}, {"softcap": 30.0}),
    ({}, {"logits_scaling": 4.0}),
    ({"label_smoothing": 0.05, "z_loss": 1e-4, "reduction": "sum"}, {"softcap": 20.0}),
]


@pytest.mark.parametrize("flags,model", FUSED_FLAG_SETS,
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_modes(flags, model, dtype):
    n, hidden, n_vocab = sizes(cpu=[(35, 32, 200)], gpu=[(1024, 1024, 151936)])[0]
    ignore = flags.get("ignore_index", -100)
    h, w, b, y, g = make(n, hidden, n_vocab, dtype, True, seed=22)
    if ignore != -100:
        y[y == -100] = 11
        y[[2, 9]] = ignore                     # the ignored label is a real class id here
    mod = kernels(n_vocab, hidden, dtype, bias=True, mode="fused", **model, **flags)
    ref_kw = {k: v for k, v in flags.items() if k in ("label_smoothing", "z_loss", "reduction")}
    ref_kw.update(model)
    if ignore != -100:
        keep = y != ignore
        hr, wr, br = h.double().requires_grad_(), w.double().requires_grad_(), b.double().requires_grad_()
        ref = reference(hr[keep], wr, br, y[keep], **ref_kw)
        ref.backward()
        hs, ws, bs = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        loss = mod.linear_cross_entropy(hs, ws, bs, y)
        loss.backward()
        check((loss, hs.grad, ws.grad, bs.grad), (ref, hr.grad, wr.grad, br.grad), dtype)
        assert torch.count_nonzero(hs.grad[~keep]) == 0
        return
    out, ref = run_both(mod, h, w, b, y, g, ref_kw)
    check(out, ref, dtype)
    assert out[0].shape == ref[0].shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_matches_chunked(reduction):
    """Both modes of the op on the same inputs: losses and gradients agree to fp32 rounding."""
    n, hidden, n_vocab = sizes(cpu=[(40, 32, 200)], gpu=[(2048, 1024, 151936)])[0]
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", True, seed=31, ignore=(0, 17))
    go = torch.randn((n,) if reduction == "none" else (), generator=g).to(DEVICE)
    res = []
    for mode in ("chunked", "fused"):
        mod = kernels(n_vocab, hidden, "fp32", bias=True, mode=mode, reduction=reduction)
        hs, ws, bs = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        loss = mod.linear_cross_entropy(hs, ws, bs, y, n + 3 if reduction == "mean" else None)
        (loss * go).sum().backward()
        res.append((loss, hs.grad, ws.grad, bs.grad))
    for what, a, c in zip(("loss", "grad_h", "grad_w", "grad_b"), *res):
        assert_close(c, a, "fp32", f"fused vs chunked {what}")


def test_fused_grad_output_scales_without_a_second_pass():
    n, hidden, n_vocab = 24, 32, 200
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", True, seed=5)
    mod = kernels(n_vocab, hidden, "fp32", bias=True, mode="fused")
    grads = []
    for s in (1.0, -2.5, 0.0):
        hs, ws, bs = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        (mod.linear_cross_entropy(hs, ws, bs, y) * s).backward()
        grads.append((hs.grad, ws.grad, bs.grad))
    for a, c in zip(grads[0], grads[1]):
        assert rel_err(c, a * -2.5) < 1e-6         # scaled inside the band kernel: fp32 rounding only
    assert all(torch.count_nonzero(t) == 0 for t in grads[2])
    # the backward can run twice (retain_graph): nothing is consumed in place
    hs = h.clone().requires_grad_()
    loss = mod.linear_cross_entropy(hs, w, b, y)
    loss.backward(retain_graph=True)
    first = hs.grad.clone()
    loss.backward()
    assert rel_err(hs.grad, 2 * first) < 1e-6


def test_fused_all_ignored_frozen_weight_and_no_grad():
    n, hidden, n_vocab = 20, 32, 200
    h, w, b, y, g = make(n, hidden, n_vocab, "bf16", False, seed=8)
    mod = kernels(n_vocab, hidden, "bf16", mode="fused")
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    yi = torch.full_like(y, -100)
    loss = mod.linear_cross_entropy(hs, ws, None, yi)
    loss.backward()
    assert torch.isnan(loss) and torch.count_nonzero(hs.grad) == 0 and torch.count_nonzero(ws.grad) == 0
    hs = h.clone().requires_grad_()
    mod.linear_cross_entropy(hs, w, None, y).backward()          # frozen head: grad_W never computed
    hr = h.double().requires_grad_()
    reference(hr, w.double(), None, y).backward()
    assert_close(hs.grad, hr.grad, "bf16", "grad_hidden")
    _, gh, gw, gb = mod.linear_cross_entropy_forward(h, w, None, y, need_h=False, need_w=True, need_b=False)
    assert gh is None and gw is not None and gb is None
    with torch.no_grad():
        nl = mod.linear_cross_entropy(h.requires_grad_(), w, None, y)
    assert not nl.requires_grad
    assert_close(nl, reference(h.double(), w.double(), None, y), "bf16", "loss", factor=0.25)
    empty = mod.linear_cross_entropy(h[:0].clone().requires_grad_(), ws, None, y[:0])
    empty.backward()                                           # no tokens: NaN (0 / 0, as HF), no kernel launched
    assert torch.isnan(empty)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_under_custom_ops_matches_eager(reduction):
    """The torch.library door (what torch.compile calls) gives the eager door's values."""
    from patchdsl.kernel_support import custom_ops
    n, hidden, n_vocab = 30, 32, 200
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", True, seed=12)
    mod = kernels(n_vocab, hidden, "fp32", bias=True, mode="fused", reduction=reduction)
    go = torch.randn((n,) if reduction == "none" else (), generator=g)
    res = []
    for door in ("eager", "ops"):
        hs, ws, bs = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        if door == "ops":
            with custom_ops.use_custom_ops():
                loss = mod.linear_cross_entropy(hs, ws, bs, y, torch.tensor(n + 2))
        else:
            loss = mod.linear_cross_entropy(hs, ws, bs, y, torch.tensor(n + 2))
        (loss * go).sum().backward()
        res.append((loss, hs.grad, ws.grad, bs.grad))
    for a, c in zip(*res):
        assert rel_err(c, a) < 1e-6


def test_fused_band_and_split_sizes():
    _, p = _source(151936, 1024, target="cuda", mode="fused")
    assert p["mode"] == "fused" and p["fwd_tile"] == "m128n256k64w8s3" and p["band"] == 0
    name = get_op(OP).kernel_name(p)
    assert name.endswith("_fused_m128n256k64w8s3_m128n256k64w8s3_cuda") and "_c2048" not in name
    src, _ = _source(151936, 1024, target="cuda", mode="fused")
    assert "def lce_stats" in src and "ce_fwd_" not in src and "out_dtype=torch.float32" in src
    assert "a.to(tl.float32)" not in src                  # the interpreter workaround stays off the GPU path
    h, w, b, y, g = make(4, 32, 200, "fp32", False, seed=1)
    mod = kernels(200, 32, "fp32", mode="fused")
    assert mod.band_columns(40) == 64                     # interpreter: 2 tiles of 32
    assert mod._splits(2, 7, 3) == (3, 3)                 # 2 token blocks x 3 splits fill 3 "SMs" twice
    assert mod._splits(128, 594, 132) == (594, 1)         # Qwen3 head, 16384 tokens: one wave already
    assert mod._splits(64, 594, 132)[1] == 2              # Gemma-2 head, 8192 tokens: half the SMs idle otherwise
    auto = kernels(200, 32, "fp32", mode="fused", band=100)
    assert auto.band_columns(40) == 96
    # the cuda module's band at the Qwen3 head keeps the backward's extra memory within 64 MiB:
    # band + fp32 grad_h - the bf16 grad_h the caller keeps + logsumexp
    from patchdsl.codegen import load_kernel
    gpu_mod = load_kernel(KernelKey.make(get_op(OP).name, get_op(OP).template, name, p))
    n = 16384
    band = gpu_mod.band_columns(n)
    assert band == 768 and band * n * 2 + n * 1024 * (4 - 2) + n * 4 <= 64 * 2**20 - 2**20
    assert gpu_mod.band_columns(8) == 151936 // 256 * 256 + 256        # few tokens: one band
    assert gpu_mod.band_columns(10**6) == 512                          # budget exhausted: 2 tiles


def test_fused_source_is_specialised():
    plain, _ = _source(200, 32, mode="fused")
    assert "libdevice" not in plain and "SMOOTHING" not in plain and "tl.load(B +" not in plain
    assert "a.to(tl.float32)" in plain                    # interpreter: no bf16 tl.dot
    capped, _ = _source(200, 32, target="cuda", mode="fused", label_smoothing=0.1, softcap=30.0, bias=True)
    assert "libdevice.tanh" in capped and "sz +=" in capped and "tl.load(B +" in capped
    fp32, _ = _source(200, 32, target="cuda", dtype="fp32", mode="fused")
    assert 'input_precision="ieee"' in fp32 and "m64n64k32w4s3" in fp32
    flat, fp = _source(200, 32, target="cuda", mode="fused", flatten=True)
    assert "tl.range(n_lo, n_hi, BLOCK_N, flatten=True)" in flat and "flatten=True" not in capped
    assert get_op(OP).kernel_name(fp).endswith("_fused_m128n256k64w8s3f_m128n256k64w8s3_cuda")
    interp, _ = _source(200, 32, mode="fused", flatten=True)
    assert "flatten=True" not in interp                  # the interpreter runs the plain nested loops


@pytest.mark.parametrize("flags,word", [
    ({"mode": "fused", "chunk": 256}, "chunk=256 only apply to mode=chunked"),
    ({"mode": "fused", "accumulate": "fp32", "block": 1024}, "accumulate=fp32, block=1024 only apply to mode=chunked"),
    ({"tile": "m128n128k64w8s4"}, "tile=m128n128k64w8s4 only apply to mode=fused"),
    ({"mode": "chunked", "band": 512}, "band=512 only apply to mode=fused"),
    ({"flatten": True}, "flatten=True only apply to mode=fused"),
])
def test_mode_flags_of_the_other_mode_are_refused(flags, word):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    assert word in op.validate(f)
    assert op.validate(dict(op.default_flags(), mode="fused", tile="m64n128k64w4s4", band=2048)) is None
    assert op.validate(dict(op.default_flags(), mode="chunked", chunk=256)) is None


def test_mode_conflict_is_a_located_plan_error():
    from patchdsl import SpecError, load_spec, plan
    from tests.families import tiny_model
    spec = "dtype fp32\nlm_head: Linear -> fused_linear_cross_entropy(mode=fused, chunk=64)\n"
    with pytest.raises(SpecError) as e:
        plan(load_spec(spec), tiny_model("llama"))
    text = str(e.value)
    assert ":2:" in text and "chunk=64 only apply to mode=chunked" in text


@pytest.mark.skipif(not ON_GPU, reason="device memory accounting needs CUDA")
def test_fused_extra_memory_at_most_64_mib():
    n, hidden, n_vocab = 16384, 1024, 151936
    h, w, b, y, g = make(n, hidden, n_vocab, "bf16", False, seed=1)
    mod = kernels(n_vocab, hidden, "bf16", mode="fused")
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = mod.linear_cross_entropy(hs, ws, None, y)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - (hs.numel() * 2 + ws.numel() * 2)
    assert extra <= 64 * 2**20, f"extra peak {extra / 2**20:.1f} MiB"


def test_unknown_tile_is_refused():
    op = get_op(OP)
    why = op.validate(dict(op.default_flags(), mode="fused", tile="m999"))
    assert "tile='m999' is not a known tile" in why and "m128n256k64w8s3" in why


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_fused_custom_ops_pass_opcheck(reduction):
    """Schema, fake tensors and the autograd registration of both fused ops (the llama run of
    tests/training/test_compile.py checks reduction=mean as a patched model calls them)."""
    n, hidden, n_vocab = 12, 32, 96
    h, w, b, y, g = make(n, hidden, n_vocab, "fp32", True, seed=13)
    mod = kernels(n_vocab, hidden, "fp32", bias=True, mode="fused", reduction=reduction)
    args = (h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(), y, None)
    res = torch.library.opcheck(mod.linear_cross_entropy_forward_op, args)
    assert all(v == "SUCCESS" for v in res.values()), res
    _, lse = mod.linear_cross_entropy_stats(h, w, b, y)
    go = torch.randn((n,) if reduction == "none" else (), generator=g)
    res = torch.library.opcheck(mod.linear_cross_entropy_grads_op, (h, w, b, y, lse, go, None, True, True, True))
    assert all(v == "SUCCESS" for v in res.values()), res
