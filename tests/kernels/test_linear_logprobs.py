"""fused_linear_logprobs: per-token statistics and their gradients against float64.

The reference materialises the (tokens, vocab) logits in float64 from the same (already rounded)
hidden states and weight.  The fused path rounds each chunk's logits to the weight dtype (as the
LM head does) and, in the backward, d/dlogits to it before the two gradient matmuls: a few
roundings of that dtype, within the helpers' TOL.  Chunks are chosen so they do not divide the
token count (a ragged last chunk), and every case has ignored targets.
"""

import pytest
import torch

from patchdsl.codegen import KernelKey, render
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op

from .helpers import DEVICE, ON_GPU, TORCH_DTYPES, assert_close, kernel_for, sizes

OP = "fused_linear_logprobs"
IGN = -100


def facts(vocab, hidden, bias=False):
    return {"vocab": vocab, "hidden": hidden, "bias": bias, "softcap": None, "logits_scaling": None, "tied": False}


def kernels(vocab, hidden, dtype, bias=False, **flags):
    return kernel_for(OP, "CausalLM", facts(vocab, hidden, bias), dtype, flags)


def make(shape, hidden, vocab, dtype, bias, seed, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    h = torch.randn(*shape, hidden, generator=g).to(dt).to(DEVICE)
    w = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)).to(dt).to(DEVICE)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dt).to(DEVICE) if bias else None
    y = torch.randint(0, vocab, shape, generator=g)
    y.view(-1)[::ignore_every] = IGN
    return h, w, b, y.to(DEVICE), g


def reference(h, w, b, y, temperature=1.0):
    """float64 (logprob, entropy, lse, mean, log_sum_sq, is_top1), 0 where y is ignored."""
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    z = z / temperature
    ls = z.log_softmax(-1)
    m = y != IGN
    yc = y.clamp(min=0)
    lp = ls.gather(-1, yc[..., None])[..., 0]
    ent = -(ls.exp() * ls).sum(-1)
    top1 = (z.argmax(-1) == yc) & m
    stats = [lp, ent, z.logsumexp(-1), z.mean(-1), (2 * ls).logsumexp(-1)]
    return [torch.where(m, s, torch.zeros_like(s)) for s in stats] + [top1]


def run(mod, h, w, b, y, g, temperature=1.0, use=(True, True, True)):
    """Values and (grad_h, grad_w, grad_b) of sum(g_lp*lp + g_ent*ent + g_lse*lse) over the outputs in ``use``."""
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if b is not None else None
    out = mod.linear_logprobs(hs, ws, bs, y, temperature)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    br = b.double().requires_grad_() if b is not None else None
    ref = reference(hr, wr, br, y, temperature)
    ups = [torch.randn(y.shape, generator=g, dtype=torch.float64) for _ in range(3)]
    tot = sum((o.double() * u.to(DEVICE)).sum() for o, u, k in zip(out[:3], ups, use) if k)
    tot_ref = sum((r * u.to(DEVICE)).sum() for r, u, k in zip(ref[:3], ups, use) if k)
    tot.backward()
    tot_ref.backward()
    grads = (hs.grad, ws.grad, bs.grad if bs is not None else None)
    rgrads = (hr.grad, wr.grad, br.grad if br is not None else None)
    return out, ref, grads, rgrads


def check(out, ref, grads, rgrads, dtype, y):
    m = y != IGN
    for name, o, r in zip(("logprob", "entropy", "lse", "mean_logit", "log_sum_sq"), out[:5], ref[:5]):
        assert o.shape == y.shape and o.dtype == torch.float32, name
        assert_close(o, r, dtype, name)
        assert torch.count_nonzero(o[~m]) == 0, f"{name} is not 0 at ignored targets"
    if dtype == "fp32":      # rounding the logits to bf16 may flip near-ties
        assert torch.equal(out[5].cpu(), ref[5].cpu())
    for name, gv, gr in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, rgrads):
        if gr is not None:
            assert_close(gv, gr, dtype, name)
    assert torch.count_nonzero(grads[0][~m]) == 0, "ignored targets got a hidden-state gradient"


# (token shape, hidden, vocab, bias, flags, temperature)
CASES = sizes(
    cpu=[((2, 13), 32, 300, True, {"chunk": 7}, 1.0),               # one block per row, 4 chunks, ragged
         ((19,), 48, 200, False, {"block": 64, "chunk": 8}, 0.7),    # looped rows with a tail
         ((3, 6), 64, 256, True, {"block": 64, "chunk": 5}, 1.3),    # looped rows, no tail
         ((11,), 32, 100, False, {}, 2.0)],                          # one chunk of 16 (interpreter auto)
    gpu=[((4, 1024), 1024, 151936, False, {}, 1.0), ((2, 777), 896, 32000, True, {"chunk": 300}, 0.7),
         ((1000,), 2048, 128256, False, {}, 1.3)],
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape,hidden,vocab,bias,flags,temperature", CASES)
def test_values_and_gradients(shape, hidden, vocab, bias, flags, temperature, dtype):
    h, w, b, y, g = make(shape, hidden, vocab, dtype, bias, seed=hidden + vocab)
    mod = kernels(vocab, hidden, dtype, bias=bias, **flags)
    out, ref, grads, rgrads = run(mod, h, w, b, y, g, temperature)
    check(out, ref, grads, rgrads, dtype, y)
    assert grads[0].dtype == h.dtype and grads[1].dtype == w.dtype


@pytest.mark.parametrize("use", [(True, False, False), (False, True, False), (False, False, True), (True, True, False)],
                         ids=["logprob", "entropy", "lse", "logprob+entropy"])
def test_any_subset_of_outputs_carries_its_gradient(use):
    """The backward specialises on which outputs got a gradient (the others are None)."""
    h, w, b, y, g = make((23,), 32, 150, "fp32", True, seed=3)
    out, ref, grads, rgrads = run(kernels(150, 32, "fp32", bias=True, chunk=9), h, w, b, y, g, 0.9, use)
    check(out, ref, grads, rgrads, "fp32", y)


def test_frozen_head_and_no_grad():
    h, w, b, y, g = make((20,), 32, 120, "fp32", False, seed=6)
    mod = kernels(120, 32, "fp32")
    hs = h.clone().requires_grad_()
    mod.linear_logprobs(hs, w, None, y)[0].sum().backward()       # frozen lm_head: only grad_h
    hr = h.double().requires_grad_()
    reference(hr, w, None, y)[0].sum().backward()
    assert_close(hs.grad, hr.grad, "fp32", "grad_hidden")
    with torch.no_grad():
        out = mod.linear_logprobs(h.requires_grad_(), w, None, y)
    assert not out[0].requires_grad
    assert_close(out[0], reference(h, w, None, y)[0], "fp32", "logprob")


def test_all_ignored_gives_zeros_and_zero_grads():
    h, w, b, y, g = make((9,), 32, 100, "bf16", False, seed=8)
    y[:] = IGN
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = kernels(100, 32, "bf16").linear_logprobs(hs, ws, None, y)
    (out[0].sum() + out[1].sum()).backward()
    assert all(torch.count_nonzero(o) == 0 for o in out)
    assert torch.count_nonzero(hs.grad) == 0 and torch.count_nonzero(ws.grad) == 0


def test_target_count_mismatch_raises():
    h, w, b, y, g = make((10,), 32, 100, "fp32", False, seed=1)
    with pytest.raises(ValueError, match="targets"):
        kernels(100, 32, "fp32").linear_logprobs(h, w, None, y[:9])


def test_custom_ops_opcheck_trace_and_match_eager():
    """The torch.compile door: both ops pass opcheck (bias, temperature, a ragged chunk), make_fx
    traces the entry to the two opaque ops (no Triton launch in the graph), and the custom-op path
    gives the eager path's values and gradients."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from patchdsl.kernel_support import custom_ops

    h, w, b, y, g = make((2, 5), 32, 90, "fp32", True, seed=11, ignore_every=3)
    mod = kernels(90, 32, "fp32", bias=True, chunk=4)
    fwd, bwd = mod.CUSTOM_OPS
    args = (h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(), y, 1 / 0.8)
    assert all(v == "SUCCESS" for v in torch.library.opcheck(fwd, args).values())
    stats = fwd(*(a.detach() if torch.is_tensor(a) else a for a in args))
    g_stats = torch.randn(stats.shape, generator=g).to(DEVICE)
    for needs in ((True, True, True), (True, False, False), (False, True, True)):
        assert all(v == "SUCCESS" for v in torch.library.opcheck(bwd, (h, w, b, y, stats, g_stats, 1 / 0.8, *needs)).values())

    def entry(h, w, b, y):
        return mod.linear_logprobs(h, w, b, y, 0.8)[:3]

    with custom_ops.use_custom_ops():
        gm = make_fx(entry, tracing_mode="fake")(h, w, b, y)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "patchdsl" in str(n.target)]
    assert len(called) == 1 and called[0].endswith("_fwd.default"), called

    ups = [torch.randn(y.shape, generator=g).to(DEVICE) for _ in range(3)]
    results = []
    for forced in (False, True):
        ins = [t.clone().requires_grad_() for t in (h, w, b)]
        if forced:
            with custom_ops.use_custom_ops():
                out = mod.linear_logprobs(*ins, y, 0.8)
        else:
            out = mod.linear_logprobs(*ins, y, 0.8)
        sum((o * u).sum() for o, u in zip(out[:3], ups)).backward()
        results.append([o.detach() for o in out] + [t.grad for t in ins])
    for a, e in zip(results[1], results[0]):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


MiB = 2**20


def memory_ledger(n, hidden, vocab, chunk, accumulate, w_bytes=2, h_bytes=2):
    """What forward + backward of ``linear_logprobs`` holds at its peak, beyond its inputs: the last
    chunk of the backward (``linear_logprobs_backward``), where all of these are alive together."""
    items = {
        "chunk logits buffer (chunk x vocab, weight dtype)": min(chunk, n) * vocab * w_bytes,
        "grad_hidden (tokens x hidden)": n * hidden * h_bytes,
        "grad_weight (vocab x hidden, weight dtype)": vocab * hidden * w_bytes,
        "statistics saved by the forward (6 x tokens fp32)": 6 * n * 4,
        "upstream logprob/entropy gradients made contiguous (2 x tokens fp32)": 2 * n * 4,
    }
    if accumulate == "fp32" and w_bytes != 4:    # the fp32 accumulator and, at the end, its cast
        items["grad_weight fp32 accumulator (vocab x hidden)"] = vocab * hidden * 4
    return items


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="device memory accounting needs CUDA")
def test_extra_memory_is_one_chunk_of_logits():
    """The peak beyond the inputs is exactly :func:`memory_ledger` (never the whole logits), within
    the caching allocator's rounding: a block is rounded up to 512 bytes, and a large block is not
    split when less than 1 MiB would remain, so up to 1 MiB per allocation.

    Not the op's: cuBLAS keeps one workspace per (thread, stream) once a matmul ran there (32 MiB
    each on Hopper), and the forward runs on the calling thread while the backward runs on the
    autograd engine's device thread.  An earlier version of this test counted both (64 MiB over
    its bound on the H200); a warm-up call (two chunks) allocates them before the measurement."""
    n, hidden, vocab = 16384, 1024, 151936
    h, w, b, y, g = make((n,), hidden, vocab, "bf16", False, seed=1)
    mod = kernels(vocab, hidden, "bf16")
    _, p, _ = _source(vocab, hidden, target="cuda")
    assert p["chunk"] == mod.CHUNK
    ws = w.clone().requires_grad_()
    k = mod.CHUNK + 8                                         # warm-up (two chunks: every matmul call site)
    hw = h[:k].clone().requires_grad_()
    lp, ent = mod.linear_logprobs(hw, ws, None, y[:k])[:2]
    (lp.sum() - 0.01 * ent.sum()).backward()
    ws.grad = None
    del hw, lp, ent
    torch.cuda.synchronize()
    hs = h.clone().requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = mod.linear_logprobs(hs, ws, None, y)[:2]
    (lp.sum() - 0.01 * ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    ledger = memory_ledger(n, hidden, vocab, mod.CHUNK, p["accumulate"])
    want = sum(ledger.values())
    rounding = (len(ledger) + 2) * MiB           # + the two 0-d sums of the loss
    table = "; ".join(f"{k} {v / MiB:.1f} MiB" for k, v in ledger.items())
    assert want <= extra <= want + rounding, (f"extra peak {extra / MiB:.1f} MiB, ledger {want / MiB:.1f} MiB "
                                              f"(+{rounding / MiB:.0f} MiB rounding): {table}")
    assert ledger["chunk logits buffer (chunk x vocab, weight dtype)"] < n * vocab * 2 / 4    # never the logits


# ---------------------------------------------------------------- specialisation and naming
def _source(vocab, hidden, target="interpreter", dtype="bf16", bias=False, **flags):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(vocab, hidden, bias)}, dtype=dtype)
    p = op.key_params(info, f, dtype, target)
    return render(KernelKey.for_op(op, p)), p, op.kernel_name(p)


def test_specialisation_and_name():
    src, p, name = _source(151936, 1024, target="cuda")
    assert p["chunk"] == 2048 and p["accumulate"] == "weight" and p["n_tiles"] == 19
    assert name == "fused_linear_logprobs_bf16_h1024_v151936_c2048_accweight_b8192_cuda"
    assert "for start in range(BLOCK, VOCAB, BLOCK)" in src and "mask=msk" in src
    small, p, _ = _source(1024, 64, bias=True)
    assert p["n_tiles"] == 1 and "torch.addmm(b, h2[s:e]" in small
    assert "for start in range(BLOCK, VOCAB, BLOCK)" not in small
    fwd = small[small.index("def logprob_fwd_"):small.index("def logprob_bwd_")]
    assert "mask=" not in fwd                      # the row is exactly one block: no masks
    assert "acc.addmm_(dl.t().float(), hc.float())" in small         # fp32 accumulation of grad_W


def test_check_refuses_softcapped_and_foreign_heads():
    op = get_op(OP)
    f = op.default_flags()
    lin = torch.nn.Linear(32, 700, bias=False)
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts(700, 32)})
    assert op.check(lin, info, f) is None
    assert "not the causal LM's lm_head" in op.check(torch.nn.Linear(32, 600), info, f)
    gemma = ModuleInfo("lm_head", "Linear", (), {"CausalLM": dict(facts(700, 32), softcap=30.0)})
    assert "softcapping" in op.check(lin, gemma, f)
    with pytest.raises(Exception, match="temperature"):
        op.flag("temperature").coerce(0.0)
