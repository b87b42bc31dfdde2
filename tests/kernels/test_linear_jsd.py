"""fused_linear_jsd: the distillation loss and its gradients against float64, and against TRL.

The reference materialises both (tokens, vocab) logits in float64 from the same (already rounded)
hidden states and weights and evaluates the generalised JSD with TRL's formula written out (beta=0
forward KL(teacher || student), beta=1 reverse KL, else beta KL(t || m) + (1 - beta) KL(s || m),
m = beta t + (1 - beta) s).  Chunks do not divide the token count, every case has ignored labels,
and the teacher's hidden size differs from the student's.
"""


import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.kernel_support import custom_ops
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from .helpers import (DEVICE, ON_GPU, TORCH_DTYPES, assert_close, assert_kernel_globals_constexpr, gjsd_per_token,
                      kernel_for, sizes)

OP = "fused_linear_jsd"
IGN = -100


def facts(vocab, hidden, bias=False):
    return {"vocab": vocab, "hidden": hidden, "bias": bias, "softcap": None, "logits_scaling": None, "tied": False}


def kernels(vocab, hidden, dtype, bias=False, **flags):
    return kernel_for(OP, "CausalLM", facts(vocab, hidden, bias), dtype, flags)


def make(n, hidden, t_hidden, vocab, dtype, bias, seed, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    hs = torch.randn(*n, hidden, generator=g).to(dt).to(DEVICE)
    ws = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(dt).to(DEVICE)
    bs = (torch.randn(vocab, generator=g) * 0.5).to(dt).to(DEVICE) if bias else None
    ht = torch.randn(*n, t_hidden, generator=g).to(dt).to(DEVICE)
    wt = (torch.randn(vocab, t_hidden, generator=g) * (2.0 / t_hidden ** 0.5)).to(dt).to(DEVICE)
    y = torch.randint(0, vocab, n, generator=g)
    y.view(-1)[1::ignore_every] = IGN
    return hs, ws, bs, ht, wt, y.to(DEVICE)


def reference(hs, ws, bs, ht, wt, y, beta, temperature, num_items=None):
    """float64 generalised JSD, sum over non-ignored tokens / num_items (default: their count)."""
    zs = hs.double() @ ws.double().T
    if bs is not None:
        zs = zs + bs.double()
    zt = ht.double() @ wt.double().T
    s = (zs / temperature).log_softmax(-1)
    t = (zt / temperature).log_softmax(-1)
    jsd = gjsd_per_token(s, t, beta)
    mask = y != IGN
    den = mask.sum().clamp(min=1) if num_items is None else num_items
    return jsd[mask].sum() / den


def run(mod, hs, ws, bs, ht, wt, y, beta, temperature, num_items=None):
    a = hs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    b = bs.clone().requires_grad_() if bs is not None else None
    loss = mod.linear_jsd(a, w, b, ht, wt, None, y, num_items, temperature)
    ar, wr = hs.double().requires_grad_(), ws.double().requires_grad_()
    br = bs.double().requires_grad_() if bs is not None else None
    ref = reference(ar, wr, br, ht, wt, y, beta, temperature, num_items)
    g = 1.7                                        # grad_output != 1: the backward's scaling runs
    (loss * g).backward()
    (ref * g).backward()
    return loss, ref, (a.grad, w.grad, b.grad if b is not None else None), (ar.grad, wr.grad, br.grad if br is not None else None)


# (token shape, student hidden, teacher hidden, vocab, bias, flags, beta, temperature)
CASES = sizes(
    cpu=[((2, 9), 32, 48, 300, False, {"chunk": 7}, 0.5, 1.0),                 # one block per row, ragged chunks
         ((19,), 16, 24, 200, True, {"block": 64, "chunk": 8}, 0.0, 2.0),      # looped rows with a tail, forward KL
         ((3, 5), 32, 16, 256, False, {"block": 64, "chunk": 4}, 1.0, 0.7),    # looped rows, no tail, reverse KL
         ((13,), 16, 32, 100, False, {"chunk": 5}, 0.1, 1.5)],                 # a non-trivial beta
    gpu=[((4, 1024), 1024, 2048, 151936, False, {}, 0.5, 1.0), ((2, 777), 896, 1024, 32000, True, {"chunk": 300}, 0.0, 2.0),
         ((1000,), 2048, 1024, 128256, False, {}, 1.0, 0.7), ((1500,), 1024, 2048, 151936, False, {"chunk": 512}, 0.25, 1.3)],
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape,hidden,t_hidden,vocab,bias,flags,beta,temperature", CASES)
def test_values_and_gradients(shape, hidden, t_hidden, vocab, bias, flags, beta, temperature, dtype):
    hs, ws, bs, ht, wt, y = make(shape, hidden, t_hidden, vocab, dtype, bias, seed=hidden + vocab)
    mod = kernels(vocab, hidden, dtype, bias=bias, beta=beta, **flags)
    loss, ref, grads, rgrads = run(mod, hs, ws, bs, ht, wt, y, beta, temperature)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref, dtype, "loss")
    for name, gv, gr in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, rgrads):
        if gr is not None:
            assert_close(gv, gr, dtype, name, factor=2.0 if dtype == "bf16" else 1.0)
    assert grads[0].dtype == hs.dtype and grads[1].dtype == ws.dtype
    m = y != IGN
    assert torch.count_nonzero(grads[0][~m]) == 0, "ignored tokens got a hidden-state gradient"


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
def test_equals_trl_generalized_jsd_loss(beta):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (reduction batchmean, labels as the mask), in float64
    on the logits, gives the fused loss and its gradients; num_items_in_batch divides as TRL's does."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    hs, ws, _, ht, wt, y = make((2, 7), 16, 24, 90, "fp32", False, seed=5)
    mod = kernels(90, 16, "fp32", beta=beta, chunk=5)
    for num_items in (None, torch.tensor(17.0)):
        a, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss = mod.linear_jsd(a, w, None, ht, wt, None, y, num_items, 2.0)
        loss.backward()
        ar, wr = hs.double().requires_grad_(), ws.double().requires_grad_()
        trl = gkd.GKDTrainer.generalized_jsd_loss(ar @ wr.T, ht.double() @ wt.double().T, labels=y, beta=beta,
                                                  temperature=2.0, num_items_in_batch=num_items)
        trl.backward()
        assert abs(loss.item() - trl.item()) <= 1e-5 * abs(trl.item()) + 1e-7, (beta, loss.item(), trl.item())
        assert_close(a.grad, ar.grad, "fp32", "grad_hidden")
        assert_close(w.grad, wr.grad, "fp32", "grad_weight")


def test_without_labels_and_without_grad():
    """labels=None: every token counts; no grad mode: the forward only, a plain value."""
    hs, ws, _, ht, wt, y = make((11,), 16, 16, 80, "fp32", False, seed=9)
    mod = kernels(80, 16, "fp32", beta=0.5, chunk=4)
    with torch.no_grad():
        loss = mod.linear_jsd(hs.requires_grad_(), ws, None, ht, wt, None, None, None, 1.0)
    assert not loss.requires_grad
    assert_close(loss, reference(hs, ws, None, ht, wt, torch.zeros_like(y), 0.5, 1.0), "fp32", "loss")


def test_frozen_head_gives_only_grad_hidden_and_teacher_gets_none():
    hs, ws, _, ht, wt, y = make((10,), 16, 24, 70, "fp32", False, seed=2)
    mod = kernels(70, 16, "fp32", beta=1.0, chunk=3)
    a = hs.clone().requires_grad_()
    ht_g, wt_g = ht.clone().requires_grad_(), wt.clone().requires_grad_()
    mod.linear_jsd(a, ws, None, ht_g, wt_g, None, y, None, 1.0).backward()
    ar = hs.double().requires_grad_()
    reference(ar, ws, None, ht, wt, y, 1.0, 1.0).backward()
    assert_close(a.grad, ar.grad, "fp32", "grad_hidden")
    assert ht_g.grad is None and wt_g.grad is None


def test_all_ignored_gives_zero_loss_and_zero_grads():
    hs, ws, _, ht, wt, y = make((9,), 16, 16, 60, "bf16", False, seed=8)
    y[:] = IGN
    a, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    loss = kernels(60, 16, "bf16", beta=0.5).linear_jsd(a, w, None, ht, wt, None, y)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(w.grad) == 0


# ---------------------------------------------------------------- cases that must fail
BAD = [
    ("vocab", lambda hs, ws, ht, wt, y: (hs, ws, ht, wt[:-3], y), "vocab mismatch: the teacher head has 57 outputs"),
    ("teacher hidden", lambda hs, ws, ht, wt, y: (hs, ws, ht[..., :12], wt, y),
     "teacher hidden states have size 12 .* the teacher head expects 24"),
    ("student hidden", lambda hs, ws, ht, wt, y: (hs[..., :8], ws, ht, wt, y), "student hidden states have size 8"),
    ("tokens", lambda hs, ws, ht, wt, y: (hs, ws, ht[:5], wt, y), r"token dimensions must match"),
    ("labels", lambda hs, ws, ht, wt, y: (hs, ws, ht, wt, y[:4]), r"7 tokens but 4 labels"),
]


@pytest.mark.parametrize("what,edit,message", BAD, ids=[b[0] for b in BAD])
def test_shape_errors_say_what_was_expected(what, edit, message):
    hs, ws, _, ht, wt, y = make((7,), 16, 24, 60, "fp32", False, seed=4)
    mod = kernels(60, 16, "fp32")
    args = edit(hs, ws, ht, wt, y)
    with pytest.raises(ValueError, match=message):
        mod.linear_jsd(args[0], args[1], None, args[2], args[3], None, args[4])


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_beta_outside_unit_interval_is_refused(beta):
    """A spec error located at the flag, saying the range."""
    import patchdsl
    from patchdsl.planning.check import check_spec

    with pytest.raises(Exception, match=r"1:37: error: flag 'beta' must be (>= 0.0|<= 1.0)") as e:
        check_spec(patchdsl.load_spec(f"lm_head: Linear -> fused_linear_jsd(beta={beta})\n"))
    assert "^" in str(e.value)


# ---------------------------------------------------------------- torch.compile door
def test_custom_op_passes_opcheck_and_matches_eager():
    hs, ws, bs, ht, wt, y = make((9,), 16, 24, 70, "fp32", True, seed=11)
    mod = kernels(70, 16, "fp32", bias=True, beta=0.5, chunk=4)
    op = mod.CUSTOM_OPS[0]
    args = (hs.clone().requires_grad_(), ws.clone().requires_grad_(), bs.clone().requires_grad_(), ht, wt, None, y,
            torch.tensor(6.0), 0.8, True, True, True)
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    a, w, b = (t.clone().requires_grad_() for t in (hs, ws, bs))
    with custom_ops.use_custom_ops():
        loss = mod.linear_jsd(a, w, b, ht, wt, None, y, 6, 1.25)
    (2 * loss).backward()
    a2, w2, b2 = (t.clone().requires_grad_() for t in (hs, ws, bs))
    loss2 = mod.linear_jsd(a2, w2, b2, ht, wt, None, y, 6, 1.25)
    (2 * loss2).backward()
    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=1e-7)
    for g1, g2 in ((a.grad, a2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- specialisation and naming
def _source(vocab, hidden, target="interpreter", dtype="bf16", **flags):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(vocab, hidden)}, dtype=dtype)
    p = op.key_params(info, f, dtype, target)
    return render(KernelKey.for_op(op, p)), p, op.kernel_name(p)


def test_specialisation_and_name():
    src, p, name = _source(151936, 1024, target="cuda", beta=0.5)
    assert p["chunk"] == 2048 and p["n_tiles"] == 19
    assert name == "fused_linear_jsd_bf16_h1024_v151936_beta0p5_c2048_accweight_b8192_cuda"
    assert "LOG_BETA = tl.constexpr(" in src and "# pass 3" in src
    fwd_kl, _, name0 = _source(1024, 64, beta=0.0)
    assert "LOG_BETA" not in fwd_kl and "# pass 3" not in fwd_kl and "(ps - pt) * g_scale" in fwd_kl
    assert name0.startswith("fused_linear_jsd_bf16_h64_v1024_beta0_")
    rev_kl, _, _ = _source(1024, 64, beta=1.0)
    assert "LOG_BETA" not in rev_kl and "# pass 3" in rev_kl and "term = ps * (ls - lt)" in rev_kl
    for beta in (0.0, 0.5, 1.0):          # compiled Triton reads module globals only as constexpr
        assert_kernel_globals_constexpr(kernels(100, 16, "fp32", beta=beta), min_kernels=2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="device memory accounting needs CUDA")
def test_extra_memory_is_one_chunk_of_both_logits():
    n, hidden, t_hidden, vocab = 4096, 1024, 2048, 151936
    hs, ws, _, ht, wt, y = make((n,), hidden, t_hidden, vocab, "bf16", False, seed=1)
    mod = kernels(vocab, hidden, "bf16", beta=0.5)
    a, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    # Not the op's: cuBLAS keeps a workspace per (thread, stream) once a matmul ran there (32 MiB on Hopper;
    # the backward runs on autograd's thread). A two-chunk warm-up allocates them before the measurement
    # (the H200 measured 1525 MiB without it: the ledger below plus one workspace).
    k = mod.CHUNK + 8
    mod.linear_jsd(a[:k].detach().clone().requires_grad_(), w, None, ht[:k], wt, None, y[:k]).backward()
    w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mod.linear_jsd(a, w, None, ht, wt, None, y).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = a.numel() * 2 + w.numel() * 2     # grad_h and grad_W, bf16, computed in the forward
    # the ledger at the peak: both gradients and one chunk each of student and teacher logits (bf16)
    assert extra <= grads + 2 * mod.CHUNK * vocab * 2 + 16 * 2**20, f"extra peak {extra / 2**20:.0f} MiB"
