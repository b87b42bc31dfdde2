"""fused_mlp and the MLP kind: the plain (non-gated) MLP down(act(up(x))).

Kernel forward and backward against float64 (every activation, with and without the down bias,
both entry points), the kind's probe on MLPs built from transformers' own activation table, patched
modules against float64 (fwd + bwd) and against the eager module's dropout, what the op saves for
backward, the modules that must be refused (with the true reason), and tiny real families whose
suggested spec verifies.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import patchdsl
from patchdsl.model.kinds.mlp import MLP_ACTIVATIONS, mlp_probe
from patchdsl.model.reference import mlp_activation_reference
from patchdsl.syntax.errors import SpecError

from .helpers import DEVICE, TORCH_DTYPES, assert_close, assert_kernel_globals_constexpr, kernel_for, sizes

N_ROWS, INTER, HID = sizes([(7, 40, 24)], [(4096, 11008, 4096)])[0]   # 7 * 40: one flat block, masked tail


def _facts(act: str, inter: int = INTER, hidden: int = HID) -> dict:
    return {"up": "fc1", "down": "fc2", "hidden": hidden, "intermediate": inter, "up_bias": True,
            "down_bias": True, "conv1d": False, "activation": act, "act_class": None}


def _inputs(dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    h = (torch.randn(N_ROWS, INTER, generator=g) * 2).to(dt)        # relu / relu2: about half the values < 0
    w = (torch.randn(HID, INTER, generator=g) / INTER ** 0.5).to(dt)
    b = (torch.randn(HID, generator=g) * 0.3).to(dt) if bias else None
    dy = torch.randn(N_ROWS, HID, generator=g).to(dt)
    return [t.to(DEVICE) if t is not None else None for t in (h, w, b, dy)]


def _reference(h, w, b, dy, act):
    """(out, dh, dw, db) in float64 from the same (rounded) inputs."""
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    out = F.linear(mlp_activation_reference(act)(h64), w64, b64)
    out.backward(dy.double())
    return out, h64.grad, w64.grad, (b64.grad if b is not None else None)


CASES = [(act, bias, dtype) for act in MLP_ACTIVATIONS for bias in (True, False)
         for dtype in ("fp32",)] + [(act, True, "bf16") for act in ("gelu_tanh", "relu2")]


@pytest.mark.parametrize("act,bias,dtype", CASES, ids=[f"{a}-{'bias' if b else 'nobias'}-{d}" for a, b, d in CASES])
def test_down_path_matches_float64(act, bias, dtype):
    """mlp_down(h, W, b) = act(h) @ W^T + b: output, dh, dW and db against float64."""
    mod = kernel_for("fused_mlp", "MLP", _facts(act), dtype)
    assert_kernel_globals_constexpr(mod, 2)
    h, w, b, dy = _inputs(dtype, bias, seed=len(act) + bias)
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_()
    bk = b.clone().requires_grad_() if b is not None else None
    out = mod.mlp_down(hk, wk, bk)
    out.backward(dy)
    ref, dh, dw, db = _reference(h, w, b, dy, act)
    assert out.dtype == h.dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, f"{act} output")
    assert_close(hk.grad, dh, dtype, f"{act} dh")
    assert_close(wk.grad, dw, dtype, f"{act} dW")
    if bias:
        assert_close(bk.grad, db, dtype, f"{act} db")


@pytest.mark.parametrize("act", MLP_ACTIVATIONS)
def test_act_path_matches_float64(act):
    """mlp_act(h) alone (the down projection is then the module's own): act(h) and dh, on a
    non-contiguous (..., I) view."""
    mod = kernel_for("fused_mlp", "MLP", _facts(act), "fp32")
    h, _, _, _ = _inputs("fp32", False, seed=3)
    big = torch.randn(N_ROWS, 2 * INTER, device=DEVICE)
    big[:, ::2] = h
    hv = big[:, ::2].clone().t().contiguous().t().requires_grad_()      # a strided view of the same values
    assert not hv.is_contiguous()
    a = mod.mlp_act(hv)
    da = torch.randn_like(a)
    a.backward(da)
    h64 = h.double().requires_grad_()
    ref = mlp_activation_reference(act)(h64)
    ref.backward(da.double())
    assert_close(a, ref, "fp32", f"{act} act")
    assert_close(hv.grad, h64.grad, "fp32", f"{act} dh")


def test_a_wrong_width_is_refused():
    mod = kernel_for("fused_mlp", "MLP", _facts("relu"), "fp32")
    with pytest.raises(ValueError, match=rf"expected \(\.\.\., {INTER}\)"):
        mod.mlp_act(torch.zeros(2, INTER + 1, device=DEVICE))


# ------------------------------------------------------------------ the kind and the op on modules
class PlainMLP(nn.Module):
    """fc1 -> act -> fc2 [-> dropout], the shape of Phi's / OPT's MLPs (any activation given)."""

    def __init__(self, act, hidden=12, inter=20, bias=True, out_dropout=0.0, mid_dropout=0.0, names=("fc1", "fc2")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(hidden, inter, bias=bias))
        setattr(self, names[1], nn.Linear(inter, hidden, bias=bias))
        self.act = act
        self.mid = nn.Dropout(mid_dropout)
        self.dropout = nn.Dropout(out_dropout)

    def forward(self, x):
        up, down = (getattr(self, n) for n in self.names)
        return self.dropout(down(self.mid(self.act(up(x)))))


class ResidualDropoutMLP(PlainMLP):
    """StarCoder2's shape: ``F.dropout(c_proj(act(c_fc(x))), p=self.residual_dropout, training=...)``."""

    def __init__(self, act, p):
        super().__init__(act, names=("c_fc", "c_proj"))
        del self.dropout
        self.residual_dropout = p

    def forward(self, x):
        return F.dropout(self.c_proj(self.act(self.c_fc(x))), p=self.residual_dropout, training=self.training)


class Holder(nn.Module):
    """A model holding one MLP at ``mlp`` (a spec selects modules by path)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


class TwoArgMLP(PlainMLP):
    def forward(self, x, residual):             # Bloom / MPT: the residual comes in
        return super().forward(x) + residual


def _acts():
    from transformers.activations import ACT2FN

    return [("gelu", ACT2FN["gelu"], "gelu"), ("gelu_new", ACT2FN["gelu_new"], "gelu_tanh"),
            ("gelu_pytorch_tanh", ACT2FN["gelu_pytorch_tanh"], "gelu_tanh"),
            ("gelu_fast", ACT2FN["gelu_fast"], "gelu_tanh"), ("relu", ACT2FN["relu"], "relu"),
            ("relu2", ACT2FN["relu2"], "relu2"), ("silu", ACT2FN["silu"], "silu"),
            ("quick_gelu", ACT2FN["quick_gelu"], "quick_gelu"), ("nn.GELU(tanh)", nn.GELU("tanh"), "gelu_tanh")]


@pytest.mark.parametrize("i", range(9))
def test_the_kind_probes_the_activation(i):
    label, act, want = _acts()[i]
    f, why = mlp_probe(PlainMLP(act))
    assert f and f["activation"] == want, (label, f, why)
    assert (f["up"], f["down"], f["hidden"], f["intermediate"]) == ("fc1", "fc2", 12, 20)


def _patched_vs_float64(module, spec, x, dtype=torch.float32):
    """(patched output, grads) and the float64 module's, on the same weights."""
    ref = __import__("copy").deepcopy(module).double().to(DEVICE)
    m = module.to(dtype).to(DEVICE)
    x = x.to(DEVICE)
    handle = patchdsl.apply(patchdsl.plan(spec, m), m)
    try:
        xk = x.to(dtype).clone().requires_grad_()
        out = m(xk)
        out.backward(torch.ones_like(out))
    finally:
        handle.undo()
    x64 = x.double().clone().requires_grad_()
    r = ref(x64)
    r.backward(torch.ones_like(r))
    return (out, xk.grad, dict(m.named_parameters())), (r, x64.grad, dict(ref.named_parameters()))


MODULE_CASES = [("relu2", True, ("up_proj", "down_proj")), ("gelu_new", False, ("fc1", "fc2")),
                ("silu", True, ("dense_h_to_4h", "dense_4h_to_h")), ("quick_gelu", True, ("lin1", "lin2"))]


@pytest.mark.parametrize("act,bias,names", MODULE_CASES, ids=[c[0] + "-" + c[2][0] for c in MODULE_CASES])
def test_patched_module_matches_float64(act, bias, names):
    from transformers.activations import ACT2FN

    torch.manual_seed(5)
    mod = Holder(PlainMLP(ACT2FN[act], bias=bias, names=names)).eval()
    x = torch.randn(2, 5, 12)
    (out, dx, params), (ref, rdx, rparams) = _patched_vs_float64(mod, "dtype fp32\nmlp: MLP -> fused_mlp\n", x)
    assert_close(out, ref, "fp32", "output")
    assert_close(dx, rdx, "fp32", "dx")
    for n, p in params.items():
        assert p.grad is not None, n
        assert_close(p.grad, rparams[n].grad, "fp32", n)


@pytest.mark.parametrize("kind", ["module", "residual_dropout"])
def test_output_dropout_draws_the_modules_mask(kind):
    """In training mode the patched module applies the same dropout at the same place: under one
    seed its output equals the eager module's (the same mask), and the mask is not all ones."""
    import copy

    from transformers.activations import ACT2FN

    torch.manual_seed(1)
    mod = Holder(PlainMLP(ACT2FN["gelu_new"], out_dropout=0.4) if kind == "module"
                 else ResidualDropoutMLP(ACT2FN["gelu_new"], 0.4)).train()
    mod = mod.to(DEVICE)
    eager = copy.deepcopy(mod)
    x = torch.randn(3, 4, 12, device=DEVICE)
    patchdsl.apply(patchdsl.plan("mlp: MLP -> fused_mlp\n", mod), mod)
    torch.manual_seed(9)
    got = mod(x)
    torch.manual_seed(9)
    want = eager(x)
    assert (want == 0).any(), "the dropout dropped nothing: the test would not see a different mask"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_only_up_output_is_saved_for_backward():
    """recompute=true saves h = up(x) and the weights, never act(h): fewer saved bytes than eager
    by one (tokens x intermediate) tensor; recompute=false saves as much as eager."""
    from transformers.activations import ACT2FN

    def saved_bytes(m, x):
        seen = {}

        def pack(t):
            seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x.requires_grad_())
        return sum(seen.values())

    torch.manual_seed(0)
    mod = Holder(PlainMLP(ACT2FN["gelu"], hidden=16, inter=64)).to(DEVICE)
    x = torch.randn(32, 16, device=DEVICE)
    eager = saved_bytes(mod, x.clone())
    act_bytes = 32 * 64 * 4
    h = patchdsl.apply(patchdsl.plan("mlp: MLP -> fused_mlp\n", mod), mod)
    fused = saved_bytes(mod, x.clone())
    h.undo()
    patchdsl.apply(patchdsl.plan("mlp: MLP -> fused_mlp(recompute=false)\n", mod), mod)
    kept = saved_bytes(mod, x.clone())
    assert fused == eager - act_bytes, (eager, fused)
    assert kept == eager, (eager, kept)


REFUSED = [
    # (module, what the rule's error or the refusal says)
    (lambda: PlainMLP(nn.ELU()), r"its activation ELU is none of the activations fused_mlp computes"),
    (lambda: PlainMLP(nn.GELU(), mid_dropout=0.3),
     r"random in training mode .*dropout with p > 0 between fc1 and fc2"),
]


@pytest.mark.parametrize("i", range(len(REFUSED)))
def test_refused_with_the_reason(i):
    make, why = REFUSED[i]
    m = Holder(make()).train()
    try:
        p = patchdsl.plan("mlp: MLP -> fused_mlp\n", m)
    except SpecError as e:
        assert __import__("re").search(why, str(e)), str(e)
        return
    assert p.sites and p.sites[0].refused, "planned without a refusal"
    assert __import__("re").search(why, p.sites[0].refused), p.sites[0].refused


@pytest.mark.parametrize("make,why", [
    (lambda: TwoArgMLP(nn.GELU()), r"could not be probed with one argument"),
    (lambda: PlainMLP(nn.GELU(), names=("a", "b")), r"no up/down projection pair"),
])
def test_not_an_mlp(make, why):
    f, reason = mlp_probe(make())
    assert f is None and __import__("re").search(why, reason), reason


class FusedGateUpMLP(nn.Module):
    """ModernBERT's / Moshi's shape: one projection gives gate and up, chunked in the forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, 32), nn.Linear(16, 8), nn.GELU()

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.act(a) * b)


def test_a_fused_gate_up_mlp_is_named_gated():
    f, why = mlp_probe(FusedGateUpMLP())
    assert f is None and "a gated MLP whose gate and up are one projection" in why, why


def test_a_sequential_mlp_is_an_mlp_and_patches():
    """CTRL's ffn: nn.Sequential(Linear, ReLU, Linear); the stand-in keeps the children's order."""
    torch.manual_seed(2)
    seq = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 12))
    f, why = mlp_probe(seq)
    assert f and (f["up"], f["down"], f["activation"]) == ("0", "2", "relu"), why
    (out, dx, params), (ref, rdx, rparams) = _patched_vs_float64(Holder(seq), "dtype fp32\nmlp: MLP -> fused_mlp\n",
                                                                 torch.randn(3, 12))
    assert_close(out, ref, "fp32", "output")
    assert_close(params["mlp.0.weight"].grad, rparams["mlp.0.weight"].grad, "fp32", "d up")


def test_a_gated_mlp_is_not_a_plain_mlp():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=2, vocab_size=64)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(SpecError, match=r"SwiGLU"):
        patchdsl.plan("*.mlp: MLP -> fused_mlp\n", m)


# ------------------------------------------------------------------ real families (tiny configs)
def _family(model_type: str):
    from patchdsl.model.tiny import build, tiny_family_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return tiny_family_config(model_type), build
        finally:
            logging.disable(logging.NOTSET)


# nemotron: relu2, no bias; starcoder2: gelu_tanh + biases + residual_dropout; gpt_neox: exact gelu + biases;
# gpt2: Conv1D projections + dropout module
@pytest.mark.parametrize("family,act", [("nemotron", "relu2"), ("starcoder2", "gelu_tanh"), ("gpt_neox", "gelu"),
                                        ("gpt2", "gelu_tanh")])
def test_suggested_spec_patches_the_mlps_and_verifies(family, act):
    cfg, build = _family(family)
    model = build(cfg)
    s = patchdsl.suggest(model)
    mlps = [p for p, op in s.patched.items() if op == "fused_mlp"]
    assert mlps and all(s.concern_of.get(p) == "mlp" for p in mlps), s.text
    assert s.counts()["mlp"][0] == s.counts()["mlp"][1], s.text
    assert f"activation {act}" in s.text and "-> fused_mlp" in s.text, s.text
    rep = patchdsl.verify(s.text, lambda: build(cfg), dtype="fp32", batch=1, seq=8, device=DEVICE)
    assert rep.passed, rep.verdict
    assert any(site["op"] == "fused_mlp" for site in rep.sites)


def test_apertus_xielu_is_refused_naming_it():
    cfg, build = _family("apertus")
    s = patchdsl.suggest(build(cfg))
    assert "fused_mlp" not in s.patched.values()
    assert any("XIELUActivation is none of the activations fused_mlp computes" in why
               for why in s.unpatched.values()), s.text
