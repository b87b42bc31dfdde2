"""torch.compile of patched models (CPU, fp32, Triton interpreter, tiny models).

* every registered op's custom ops pass ``torch.library.opcheck`` (schema, fake tensors, autograd
  registration, AOT dispatch with dynamic shapes), called with the arguments a patched model
  really passes them;
* every shipped spec's family compiles with ``fullgraph=True`` (aot_eager), with as many graph
  breaks as the unpatched model (none), trains a forward+backward with labels matching the eager
  patched model, and does not recompile for new inputs of the same shape;
* what cannot be traced fails with an error that says what to do.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

import patchdsl
from patchdsl.kernel_support import custom_ops
from patchdsl.ops.registry import ops
from patchdsl.parity.compare import FLOORS
from patchdsl.util.resources import shipped_spec
from patchdsl.syntax import load_spec

from ..families import FAMILIES, tiny_model
from ..moe_families import tiny_moe_model

TOL = FLOORS["fp32"]    # verify's fp32 floor: the compiled model runs the same kernels as eager


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def no_recompile():
    """Fail if anything compiles again inside the block. Dynamo's own switch where the torch in range
    has it (set through ``config.patch``, the supported API, not attribute assignment on the lazy
    config module), and in every version a count of frames Dynamo compiled, which must not grow."""
    from torch._dynamo.utils import counters
    before = counters["frames"]["total"]
    flag = {"error_on_recompile": True} if "error_on_recompile" in getattr(torch._dynamo.config, "_config", {}) else {}
    with torch._dynamo.config.patch(**flag):
        yield
    assert counters["frames"]["total"] == before, f"recompiled: {counters['frames']['total'] - before} new frame(s)"


def tiny(family: str, seed: int = 0):
    """One decoder layer is enough to trace every patched path and keeps the interpreter fast."""
    return tiny_model(family, seed=seed, num_hidden_layers=1).train()


def tiny_phi():
    """Phi-2: LayerNorm with bias (the LayerNorm family's representative, as in test_mutations)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "phi", hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=160, max_position_embeddings=64, partial_rotary_factor=0.5,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg).train()


def batch(model, seed: int, bsz: int = 1, seq: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (bsz, seq), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------- opcheck
# Runs that together reach every registered op (and their kernels' variants: Llama/Gemma casting,
# offset, softcap, fused gate_up, partial rotary, LayerNorm bias, reduction=none).
OPCHECK_RUNS = {
    "qwen3": (lambda: tiny("qwen3"), shipped_spec("qwen3")),
    "gemma3": (lambda: tiny("gemma3"), shipped_spec("gemma3")),
    "llama": (lambda: tiny("llama"), "dtype fp32\nmodel.layers.*: DecoderLayer -> fused_add_rmsnorm\n"
                                     "*.self_attn: Attention -> fused_rope\nlm_head: Linear -> fused_cross_entropy\n"),
    "phi3": (lambda: tiny("phi3"), "dtype fp32\n*.mlp: SwiGLU -> fused_swiglu\n*.self_attn: Attention -> fused_rope\n"
                                   "lm_head: Linear -> fused_linear_cross_entropy(reduction='none')\n"),
    # the logits-free mode of the linear CE: its own forward (loss, logsumexp) and backward ops
    "llama_fused_lce": (lambda: tiny("llama"), "dtype fp32\nlm_head: Linear -> fused_linear_cross_entropy(mode=fused)\n"),
    "phi": (tiny_phi, "dtype fp32\n*.input_layernorm, model.final_layernorm: LayerNorm -> fused_layernorm\n"),
    # the labels loss from per-token log-probs; chunks of 3 do not divide the 4 shifted tokens
    "logprobs": (lambda: tiny("qwen3"), "dtype fp32\nlm_head: Linear -> fused_linear_logprobs(chunk=3)\n"),
    # fp8 projections, emulated (fp8 matmuls are refused on the CPU); q_proj has no bias, Qwen2's has one
    "fp8": (lambda: tiny("qwen2"), "dtype fp32\n*.mlp.down_proj, *.self_attn.q_proj: Linear -> fp8_linear(emulate=true)\n"),
    # mixture of experts (issue 24): concatenated experts; gpt-oss's transposed, interleaved, biased ones
    "qwen3_moe": (lambda: tiny_moe_model("qwen3_moe").train(), "dtype fp32\n*.mlp.experts: Experts -> fused_experts\n"),
    "gpt_oss": (lambda: tiny_moe_model("gpt_oss").train(), "dtype fp32\n*.mlp.experts: Experts -> fused_experts\n"),
    # plain MLP (Nemotron's relu2): layer 1 runs the down projection inside the op (mlp_down ops), layer 0
    # with recompute=false the activation alone (mlp_act ops); both in the one kernel module
    "nemotron": (lambda: _census_model("nemotron"), "dtype fp32\n*.mlp: MLP -> fused_mlp\n"
                                                    "model.layers.0.mlp: MLP -> fused_mlp(recompute=false)\n"),
    # the router (softmax, top-k, renormalisation): Mixtral's renormalises and keeps float32 weights
    "mixtral_router": (lambda: tiny_moe_model("mixtral").train(), "dtype fp32\n*.mlp.gate: Router -> fused_router\n"),
    # DeepSeek-V3's sigmoid grouped top-k (issue 37): the correction bias a tensor argument of the custom op
    "deepseek_v3_router": (lambda: _deepseek_v3_router_model(), "dtype fp32\n*.mlp.gate: Router -> fused_router\n"),
    # the gated RMSNorm of Qwen3-Next's linear-attention layers (x and its gate both get gradients)
    "qwen3_next_gated": (lambda: _gated_norm_model(), "dtype fp32\n*.linear_attn.norm: GatedRMSNorm -> fused_rmsnorm_gated\n"),
}


def _deepseek_v3_router_model():
    from ..runtime.test_mutations import tiny_deepseek_v3

    return tiny_deepseek_v3().train()


def _gated_norm_model():
    from ..model.test_gated_norms import tiny_qwen3_next

    return tiny_qwen3_next().train()


def _census_model(model_type: str):
    """A tiny model of any installed family, as the census builds it (train mode)."""
    from ..kernels.helpers import tiny_family

    return tiny_family(model_type).train()


def _spec(text_or_path):
    return load_spec(text_or_path)


def test_opcheck_runs_cover_every_op():
    """Adding an op to the registry without a run here fails (its custom ops would go unchecked)."""
    covered = set()
    for build, spec in OPCHECK_RUNS.values():
        covered |= {r.op.name for r in _spec(spec).rules}
    generated = {name for name, op in ops().items() if not op.external}   # hub/liger: third-party kernels
    # fused_linear_jsd needs a teacher at the call (a plain training call runs the original forward):
    # its custom op is opcheck'ed in tests/kernels/test_linear_jsd.py
    assert covered == generated - {"fused_linear_jsd"}, sorted(generated - covered)


def _snapshot(x, grad: bool):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(grad and x.requires_grad and x.is_floating_point())
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(v, grad) for v in x)
    return x


class RecordPatchdslOps(TorchDispatchMode):
    """Keeps the arguments of the first call of every patchdsl:: op (the autograd layer is above
    this mode, so an input that requires grad still says so).  Backward ops run inside a
    backward, where nothing is differentiated: their inputs are recorded as not requiring grad."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith(custom_ops.NAMESPACE + "::") and name not in self.calls:
            grad = custom_ops.differentiable(name)
            self.calls[name] = (func, _snapshot(args, grad), _snapshot(kwargs, grad))
        return func(*args, **kwargs)


@pytest.mark.parametrize("run", list(OPCHECK_RUNS))
def test_custom_ops_pass_opcheck(run):
    build, spec = OPCHECK_RUNS[run]
    model = build()
    handle = patchdsl.apply(_spec(spec), model)
    assert not handle.refused, handle.refused
    ids, labels = batch(model, 1)
    rec = RecordPatchdslOps()
    with custom_ops.use_custom_ops(), rec:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.sum().backward()
    # every op of every kernel module the model used was called (forward ops and backward ops)
    used = [m for n, m in sys.modules.items() if n.startswith("patchdsl_kernels.")
            and any(op._schema.name in rec.calls for op in getattr(m, "CUSTOM_OPS", ()))]
    assert used
    for m in used:
        missing = [op._schema.name for op in m.CUSTOM_OPS if op._schema.name not in rec.calls]
        assert not missing, f"{m.__name__}: never called {missing}"
    for name, (func, args, kwargs) in rec.calls.items():
        result = torch.library.opcheck(func, args, kwargs)
        assert all(v == "SUCCESS" for v in result.values()), (name, result)


def test_op_names_unique_per_specialisation_and_registration_idempotent():
    """Two RMSNorm kernels differing only in eps get different ops; importing a module again
    (a fresh module object from the same file) finds its ops instead of failing."""
    import importlib.util

    from patchdsl.codegen import KernelKey, load_kernel, write_kernel
    from patchdsl.ops.registry import get_op
    from patchdsl.model.info import ModuleInfo

    op = get_op("fused_rmsnorm")
    info = ModuleInfo("norm", "RMSNorm", (), {"RMSNorm": {"hidden": 32, "eps": 1e-6, "offset": 0.0, "casting": "llama"}},
                      "fp32")
    keys = []
    for eps in (1e-6, 1e-5):
        p = op.key_params(info, {"eps": eps}, "fp32", "interpreter")
        keys.append(KernelKey.for_op(op, p))
    assert keys[0].name == keys[1].name        # the readable name does not show eps ...
    mods = [load_kernel(k) for k in keys]
    names = [tuple(o._schema.name for o in m.CUSTOM_OPS) for m in mods]
    assert names[0] != names[1] and not set(names[0]) & set(names[1])    # ... the op names do
    spec = importlib.util.spec_from_file_location("patchdsl_kernels_again", write_kernel(keys[0]))
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert [o._schema.name for o in again.CUSTOM_OPS] == list(names[0])
    x = torch.randn(3, 32)
    w = torch.randn(32)
    with custom_ops.use_custom_ops():
        torch.testing.assert_close(again.rmsnorm(x, w), mods[0].rmsnorm(x, w), rtol=0, atol=0)


# ------------------------------------------------------------------- fullgraph compile
def _step(call, model, ids, labels):
    """Forward + backward of ``call`` (the model or its compiled wrapper); ``model``'s gradients."""
    for p in model.parameters():
        p.grad = None
    out = call(input_ids=ids, labels=labels, use_cache=False)
    loss = out.loss
    loss *= 1.0     # the Trainer scales the loss in place: it must not be a view of an op's output
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fullgraph_compile_matches_eager(family):
    base = tiny(family)
    ids, labels = batch(base, 1)
    ref_breaks = torch._dynamo.explain(base)(input_ids=ids, labels=labels, use_cache=False).graph_break_count
    torch._dynamo.reset()

    model = tiny(family)
    handle = patchdsl.apply(load_spec(shipped_spec(family)), model)
    assert not handle.refused
    if family == "qwen3":     # explain itself traces the patched model (it once failed in fake-tensor code)
        assert torch._dynamo.explain(model)(input_ids=ids, labels=labels, use_cache=False).graph_break_count == ref_breaks
        torch._dynamo.reset()
    loss_e, grads_e = _step(model, model, ids, labels)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss_c, grads_c = _step(compiled, model, ids, labels)     # fullgraph: a graph break would raise here
    assert ref_breaks == 0      # ... so the patched count (0) equals the unpatched model's
    assert rel_err(loss_c, loss_e) <= TOL, (loss_c, loss_e)
    assert grads_c.keys() == grads_e.keys()
    worst = max(grads_e, key=lambda n: rel_err(grads_c[n], grads_e[n]))
    assert rel_err(grads_c[worst], grads_e[worst]) <= TOL, (worst, rel_err(grads_c[worst], grads_e[worst]))

    # new inputs of the same shape: no recompilation, and the same loss as eager
    ids2, labels2 = batch(model, 2)
    with no_recompile():
        loss_c2, grads_c2 = _step(compiled, model, ids2, labels2)
    loss_e2, grads_e2 = _step(model, model, ids2, labels2)
    assert rel_err(loss_c2, loss_e2) <= TOL and math.isfinite(float(loss_c2))
    assert max(rel_err(grads_c2[n], grads_e2[n]) for n in grads_e2) <= TOL
    handle.undo()


def test_missing_kernel_dtype_under_compile_says_what_to_do():
    """A kernel cannot be rendered and imported while Dynamo traces: a dtype the spec did not list
    fails with an error naming the op, the site and the fix (not deep inside importlib)."""
    model = tiny("llama")
    patchdsl.apply(load_spec("dtype fp32\nmodel.norm: RMSNorm -> fused_rmsnorm\n"), model)
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.bfloat16)
    compiled = torch.compile(model.model.norm, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="no kernel was loaded for bf16.*add bf16 to the spec's dtype line"):
        compiled(x)
    torch._dynamo.reset()
    model.model.norm(x)         # eager loads it; then the compiled module traces
    torch.testing.assert_close(torch.compile(model.model.norm, backend="aot_eager", fullgraph=True)(x),
                               model.model.norm(x), rtol=0, atol=0)


# ------------------------------------------------------- per-token log-probs (TRL's fused_lm_head)
LOGPROBS_SPEC = "dtype fp32\nlm_head: Linear -> fused_linear_logprobs(temperature=0.7, chunk=4)\n"


def _patchdsl_ops_in(graph_module) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes
            if n.op == "call_function" and str(n.target).startswith(custom_ops.NAMESPACE + ".")]


def _logprob_step(call, model, ids, am, labels):
    """TRL's call (``fused_lm_head=True``) and a loss on every differentiable field; values and grads."""
    for p in model.parameters():
        p.grad = None
    out = call(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    loss = out.loss + 0.3 * out.entropy.sum() - 0.01 * out.lse.sum()
    loss.backward()
    vals = {k: getattr(out, k).detach().clone() for k in ("log_probs", "entropy", "lse", "mean_logits",
                                                           "log_sum_sq_probs", "is_top1", "loss")}
    return vals, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _logprob_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (2, 7), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = 0                                    # left padding
    labels = ids.masked_fill(torch.arange(7) < 3, -100)     # a prompt of 3 tokens
    return ids, am, labels


@pytest.mark.parametrize("trl_head", [False, True], ids=["plain", "over_trl_fused_head"])
def test_fused_lm_head_compiles_fullgraph(trl_head):
    """``model(..., labels=, fused_lm_head=True)`` on a patched model compiles with fullgraph=True (a
    graph break would raise), with patchdsl's forward and backward ops in the graph, the same values
    and gradients as eager, and no recompile for new inputs; also over TRL's own fused head (TRL's
    trainers install it first; trl 1.16's head alone breaks the graph twice on torch 2.13)."""
    model = tiny("qwen3")
    if trl_head:
        trl_utils = pytest.importorskip("trl.trainer.utils")
        trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    handle = patchdsl.apply(load_spec(LOGPROBS_SPEC), model, strict=True)
    ids, am, labels = _logprob_batch(1)
    ex = torch._dynamo.explain(model)(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    assert ex.graph_break_count == 0 and len(ex.graphs) == 1, ex.break_reasons
    assert len(_patchdsl_ops_in(ex.graphs[0])) == 1          # the forward op, one opaque node
    torch._dynamo.reset()

    graphs = []

    def backend(gm, example_inputs):               # aot_eager, keeping the joint graph's op calls
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    eager_vals, eager_grads = _logprob_step(model, model, ids, am, labels)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    vals, grads = _logprob_step(compiled, model, ids, am, labels)
    called = [op for g in graphs for op in _patchdsl_ops_in(g)]
    assert any(op.endswith("_fwd.default") for op in called) and any(op.endswith("_bwd.default") for op in called), called
    for k, v in eager_vals.items():
        assert torch.equal(v, vals[k]) if v.dtype == torch.bool else rel_err(vals[k], v) <= TOL, k
    assert grads.keys() == eager_grads.keys()
    assert max(rel_err(grads[n], eager_grads[n]) for n in grads) <= TOL

    ids2, am2, labels2 = _logprob_batch(2)
    with no_recompile():
        vals2, grads2 = _logprob_step(compiled, model, ids2, am2, labels2)
    eager2, egrads2 = _logprob_step(model, model, ids2, am2, labels2)
    assert rel_err(vals2["log_probs"], eager2["log_probs"]) <= TOL
    assert max(rel_err(grads2[n], egrads2[n]) for n in grads2) <= TOL
    handle.undo()


def test_logprobs_labels_loss_compiles_fullgraph():
    """A plain training call with labels (HF's loss from the log-prob kernels) compiles fullgraph too."""
    model = tiny("qwen3")
    handle = patchdsl.apply(load_spec(LOGPROBS_SPEC), model, strict=True)
    ids, _, labels = _logprob_batch(3)
    loss_e, grads_e = _step(model, model, ids, labels)
    loss_c, grads_c = _step(torch.compile(model, backend="aot_eager", fullgraph=True), model, ids, labels)
    assert rel_err(loss_c, loss_e) <= TOL
    assert max(rel_err(grads_c[n], grads_e[n]) for n in grads_e) <= TOL
    handle.undo()
