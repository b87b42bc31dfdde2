"""patchdsl.graph_step: CUDA-graph capture of a whole training step (docs/cuda-graphs.md).

CPU: every refusal that does not need a GPU (options, optimizer, model, no CUDA), the pure helpers,
and the configuration layer (``kpatch_cuda_graphs``).  GPU (``-m gpu``): graphed losses and weights
equal eager ones over several steps on a tiny patched Qwen3 in fp32 and bf16 (with micro-batches,
clipping and a tensor learning rate under a scheduler), a host sync inside the step refused with
the op's name, each shape-change policy, and the misuse checks.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import patchdsl
from patchdsl.training.graphs import (GraphStepError, UnpatchedModelWarning, batch_signature,
                                     describe_signature_change, graph_step, micro_slices)

from ..families import tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, labels=None):
        return {"loss": (self.lin(x) - labels).pow(2).mean()}


def _batch(device="cpu"):
    return {"x": torch.randn(2, 4, device=device), "labels": torch.randn(2, 4, device=device)}


def _opt(model, **kw):
    kw.setdefault("capturable", True)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)


# ----------------------------------------------------------------------------- CPU: refusals
BAD_OPTIONS = [
    (dict(on_shape_change="sometimes"), "on_shape_change must be one of error, recapture, eager"),
    (dict(micro_batch=0), "micro_batch must be a positive integer"),
    (dict(micro_batch=True), "micro_batch must be a positive integer"),
    (dict(warmup=0), "warmup must be an integer >= 1"),
    (dict(clip_grad_norm=-1.0), "clip_grad_norm must be a finite number > 0"),
    (dict(clip_grad_norm=float("nan")), "clip_grad_norm must be a finite number > 0"),
    (dict(clip_grad_norm=float("inf")), "clip_grad_norm must be a finite number > 0"),
    (dict(max_graphs=0), "max_graphs must be an integer >= 1"),
    (dict(optimizer_step="yes"), "optimizer_step must be True or False"),
    (dict(preserve_state=1), "preserve_state must be True or False"),
    (dict(loss_fn=3), "loss_fn must be callable"),
    (dict(capture_error_mode="strict"), "capture_error_mode must be one of global, thread_local, relaxed"),
]


@pytest.mark.parametrize("kw,msg", BAD_OPTIONS, ids=[m.split(" ")[0] + "-" + str(i) for i, (_, m) in enumerate(BAD_OPTIONS)])
def test_bad_options_are_refused_before_anything_runs(kw, msg):
    m = Tiny()
    with pytest.raises(GraphStepError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        graph_step(m, _opt(m), _batch(), **kw)


def test_a_batch_that_is_not_a_mapping_is_refused():
    m = Tiny()
    with pytest.raises(GraphStepError, match="a batch must be a mapping"):
        graph_step(m, _opt(m), [torch.zeros(2, 4)])


def test_an_optimizer_that_is_not_capturable_is_refused_with_the_fix():
    m = Tiny()
    with pytest.raises(GraphStepError, match=r"AdamW was built with capturable=False.*capturable=True.*"
                                             r"optimizer_step=False"):
        graph_step(m, _opt(m, capturable=False), _batch())


def test_no_optimizer_needs_optimizer_step_false():
    m = Tiny()
    with pytest.raises(GraphStepError, match="needs the optimizer"):
        graph_step(m, None, _batch())


def test_gradient_checkpointing_is_refused():
    m = Tiny()
    m.is_gradient_checkpointing = True
    with pytest.raises(GraphStepError, match="gradient checkpointing is on.*gradient_checkpointing_disable"):
        graph_step(m, _opt(m), _batch())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal")
def test_no_cuda_is_refused_with_a_clear_reason():
    m = Tiny()
    with pytest.raises(GraphStepError, match=r"CUDA graphs need a CUDA device, and torch.cuda.is_available\(\) "
                                             r"is False"):
        graph_step(m, _opt(m), _batch())


# ----------------------------------------------------------------------------- CPU: pure helpers
def test_batch_signature_and_its_differences_in_words():
    a = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16, dtype=torch.long)}
    cases = [
        ({"input_ids": torch.ones(4, 16, dtype=torch.long), "labels": torch.ones(4, 16, dtype=torch.long)}, None),
        ({"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)},
         "input_ids: shape [4, 16] -> [2, 16]; labels: shape [4, 16] -> [2, 16]"),
        ({"input_ids": torch.zeros(4, 16, dtype=torch.int32), "labels": a["labels"]},
         "input_ids: dtype torch.int64 -> torch.int32"),
        ({"input_ids": a["input_ids"]}, "key 'labels' missing"),
        (dict(a, attention_mask=torch.ones(4, 16)), "new key 'attention_mask'"),
        (dict(a, logits_to_keep=1), "new key 'logits_to_keep'"),
    ]
    sa = batch_signature(a)
    for b, words in cases:
        sb = batch_signature(b)
        if words is None:
            assert sb == sa
        else:
            assert sb != sa and describe_signature_change(sa, sb) == words
    assert describe_signature_change(batch_signature(dict(a, k=1)), batch_signature(dict(a, k=2))) == "k: 1 -> 2"


def test_sync_ops_are_named_in_words():
    from patchdsl.training.graphs import _op_words

    assert _op_words(str(torch.ops.aten._local_scalar_dense.default)) == (
        "aten._local_scalar_dense.default (Tensor.item(), or a CUDA tensor used as a Python number or bool "
        "(float(t), int(t), `if t:`, `if t.any():`))")
    assert "boolean-mask indexing" in _op_words(str(torch.ops.aten.nonzero.default))
    assert _op_words("patchdsl.some_op.default") == "patchdsl.some_op.default"


@pytest.mark.parametrize("rows,micro,want", [
    (4, None, [(0, 4)]), (4, 4, [(0, 4)]), (4, 8, [(0, 4)]), (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 2), (2, 4), (4, 5)]), (1, 1, [(0, 1)]),
])
def test_micro_slices(rows, micro, want):
    assert micro_slices(rows, micro) == want


def test_a_changed_float_lr_is_explained_with_the_tensor_lr_fix():
    from patchdsl.training.graphs import _hyper_change, _hyper_snapshot

    m = Tiny()
    opt = _opt(m)
    before = _hyper_snapshot(opt)
    opt.param_groups[0]["lr"] = 5e-4
    msg = _hyper_change(before, _hyper_snapshot(opt))
    assert "lr changed from 0.001 to 0.0005" in msg and "lr=torch.tensor(1e-4)" in msg
    opt2 = torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3), capturable=True)
    b2 = _hyper_snapshot(opt2)
    opt2.param_groups[0]["lr"].fill_(1e-4)          # a tensor lr updated in place is read by the graph: fine
    assert _hyper_snapshot(opt2) == b2
    opt2.param_groups[0]["lr"] = torch.tensor(1e-4)   # replaced: the graph still reads the old tensor
    msg = _hyper_change(b2, _hyper_snapshot(opt2))
    assert "lr (param group 0) was replaced by another object" in msg and "fill_(value)" in msg
    opt2.param_groups[0]["lr"] = 1e-4                 # a number where the tensor was
    assert "was replaced by another object" in _hyper_change(b2, _hyper_snapshot(opt2))


# ----------------------------------------------------------------------------- CPU: the configuration layer
def test_kpatch_cuda_graphs_field_is_validated_and_parsed():
    from transformers import HfArgumentParser

    a = patchdsl.PatchdslArguments(kpatch_spec="qwen3")
    assert a.kpatch_cuda_graphs is False
    with pytest.raises(ValueError, match="kpatch_cuda_graphs must be true or false"):
        patchdsl.PatchdslArguments(kpatch_cuda_graphs="yes")
    (p,) = HfArgumentParser((patchdsl.PatchdslArguments,)).parse_dict({"kpatch_cuda_graphs": True})
    assert p.kpatch_cuda_graphs is True
    (q,) = HfArgumentParser((patchdsl.PatchdslArguments,)).parse_args_into_dataclasses(["--kpatch_cuda_graphs"])
    assert q.kpatch_cuda_graphs is True


@pytest.mark.parametrize("spec", ["qwen3", None])
def test_the_trainer_refuses_cuda_graphs_at_setup_with_the_reasons(spec, tmp_path):
    from patchdsl.training.trainer import TRAINER_GRAPHS_REASONS, TrainerGraphsRefused

    args = patchdsl.PatchdslArguments(kpatch_spec=spec, kpatch_cuda_graphs=True)
    with pytest.raises(TrainerGraphsRefused) as ei:
        patchdsl.PatchdslCallback.from_args(args)
    msg = str(ei.value)
    assert "cannot be captured as a CUDA graph safely" in msg and "lr_scheduler.step()" in msg
    assert all(r in msg for r in TRAINER_GRAPHS_REASONS) and "patchdsl.graph_step" in msg
    ta = patchdsl.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], kpatch_spec=spec,
                                    kpatch_cuda_graphs=True)
    with pytest.raises(TrainerGraphsRefused):
        patchdsl.PatchdslCallback.from_args(ta)
    assert patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=spec)) is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA refusal")
def test_patch_for_training_with_cuda_graphs_refuses_a_cpu_machine_before_patching():
    from transformers import AutoModelForCausalLM

    from patchdsl.runtime.patch import SITE_ATTR

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    args = patchdsl.PatchdslArguments(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm", kpatch_cuda_graphs=True)
    with pytest.raises(GraphStepError, match="CUDA graphs need a CUDA device"):
        patchdsl.patch_for_training(model, args)
    assert not any(SITE_ATTR in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------- GPU
def _qwen3(dtype, seed=0, patched=True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa").to("cuda", dtype)
    m.config.use_cache = False
    m.train()
    handle = patchdsl.apply(patchdsl.plan(patchdsl.load_spec("qwen3"), m), m) if patched else None
    if handle is not None:
        assert handle.patched and not handle.refused
    return m


def _batches(n, rows=4, seq=16, vocab=320, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=g).cuda()
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _eager_step(model, opt, batch, micro=None, clip=None):
    rows = batch["input_ids"].shape[0]
    total = None
    for a, b in micro_slices(rows, micro):
        sub = {k: v[a:b] for k, v in batch.items()}
        loss = model(**sub).loss
        if (a, b) != (0, rows):
            loss = loss * ((b - a) / rows)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip, foreach=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=1e-2)}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("micro,clip", [(None, None), (2, 1.0)], ids=["whole", "micro2-clip"])
def test_gpu_graphed_losses_and_weights_equal_eager(dtype, micro, clip):
    batches = _batches(6)
    ref, graphed = _qwen3(dtype), _qwen3(dtype)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True, capturable=True)
    gopt = torch.optim.AdamW(graphed.parameters(), lr=1e-3, fused=True, capturable=True)
    want = [_eager_step(ref, ropt, b, micro, clip) for b in batches]
    step = graph_step(graphed, gopt, batches[0], micro_batch=micro, clip_grad_norm=clip)
    assert step.captures == 1 and step.patched_sites > 0
    got = [step(b) for b in batches]
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in got)
    torch.testing.assert_close(torch.tensor([float(x) for x in got]), torch.tensor(want), **TOL[dtype])
    assert float(got[0]) != float(got[-1])                       # returned losses are not one shared buffer
    ptol = TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)   # Adam amplifies tiny grads
    for (n, p), q in zip(ref.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q.float(), p.float(), **ptol, msg=n)
    if clip is not None:
        assert step.grad_norm is not None and torch.isfinite(step.grad_norm)
    assert all(p.grad is not None for p in graphed.parameters() if p.requires_grad)
    mem = step.memory()
    assert mem["pool_reserved_bytes"] > 0 and 0 <= mem["pool_free_bytes"] <= mem["pool_reserved_bytes"]
    step.close()


@pytest.mark.gpu
@cuda
def test_gpu_tensor_lr_under_a_scheduler_is_followed_by_the_graph():
    batches = _batches(5)
    ref, graphed = _qwen3(torch.float32), _qwen3(torch.float32)
    mk = (lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True,
                                      capturable=True))
    ropt, gopt = mk(ref), mk(graphed)
    rs, gs = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ropt, gopt))
    want = []
    for b in batches:
        want.append(_eager_step(ref, ropt, b))
        rs.step()
    step = graph_step(graphed, gopt, batches[0])
    got = []
    for b in batches:
        got.append(float(step(b)))
        gs.step()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL[torch.float32])
    assert float(gopt.param_groups[0]["lr"]) == pytest.approx(1e-3 * 0.5 ** 5)


@pytest.mark.gpu
@cuda
def test_gpu_a_float_lr_changed_after_capture_is_refused():
    m = _qwen3(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
    step = graph_step(m, opt, _batches(1)[0])
    opt.param_groups[0]["lr"] = 1e-4
    with pytest.raises(GraphStepError, match="lr changed from 0.001 to 0.0001.*tensor learning rate"):
        step(_batches(1)[0])


@pytest.mark.gpu
@cuda
def test_gpu_a_host_sync_inside_the_step_is_refused_with_the_op_and_the_line():
    m = _qwen3(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
    before = [p.detach().clone() for p in m.parameters()]

    def loss_with_item(model, batch):
        loss = model(**batch).loss
        if loss.item() > 1e9:                 # a host sync
            raise AssertionError("unreachable")
        return loss

    with pytest.raises(GraphStepError) as ei:
        graph_step(m, opt, _batches(1)[0], loss_fn=loss_with_item)
    msg = str(ei.value)
    assert "synchronises with the host" in msg and "_local_scalar_dense" in msg and "Tensor.item()" in msg
    assert "test_cuda_graph_step.py" in msg and "loss.item()" in msg
    for p, q in zip(m.parameters(), before):              # the warm-up left the model as it was
        assert torch.equal(p, q)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.gpu
@cuda
def test_gpu_a_padded_batch_is_graphed_where_transformers_skips_its_mask_check_in_a_capture():
    """transformers checks a padding mask on the host (`mask.all()`) unless is_tracing() says a CUDA stream
    captures; where it says so, the checked warm-up takes the capture's path and a padded batch gives eager's
    losses; elsewhere the sync is refused with the way out."""
    from patchdsl.training.eager_mask import as_if_capturing as _as_if_capturing
    import transformers.utils.import_utils as iu

    def padded(b):
        am = torch.ones_like(b["input_ids"])
        am[1:, -3:] = 0
        labels = b["labels"].masked_fill(am == 0, -100)
        return dict(b, attention_mask=am, labels=labels)

    batches = [padded(b) for b in _batches(3)]
    ref, m = _qwen3(torch.float32), _qwen3(torch.float32)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True, capturable=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
    if "is_cuda_stream_capturing" in iu.is_tracing.__code__.co_names:
        want = [_eager_step(ref, ropt, b) for b in batches]
        step = graph_step(m, opt, batches[0])
        got = [float(step(b)) for b in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL[torch.float32])
    else:
        with pytest.raises(GraphStepError, match="synchronises with the host.*The batch has an attention_mask.*"
                                                 "check_syncs=False"):
            graph_step(m, opt, batches[0])


@pytest.mark.gpu
@cuda
def test_gpu_shape_change_policies():
    a, b, c = _batches(1, rows=4)[0], _batches(1, rows=2, seed=2)[0], _batches(1, rows=4, seed=3)[0]
    ref = _qwen3(torch.float32)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True, capturable=True)
    want = [_eager_step(ref, ropt, x) for x in (a, b, c)]

    m = _qwen3(torch.float32)
    step = graph_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True), a)
    step(a)
    with pytest.raises(GraphStepError, match=r"input_ids: shape \[4, 16\] -> \[2, 16\].*on_shape_change="):
        step(b)

    for policy in ("recapture", "eager"):
        m = _qwen3(torch.float32)
        step = graph_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True), a,
                          on_shape_change=policy)
        got = [float(step(x)) for x in (a, b, c)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL[torch.float32], msg=policy)
        if policy == "recapture":
            assert step.captures == 2 and len(step.signatures) == 2
        else:
            assert step.captures == 1 and step.eager_calls == 1
        for p, q in zip(ref.parameters(), m.parameters()):
            torch.testing.assert_close(q, p, **TOL[torch.float32])


@pytest.mark.gpu
@cuda
def test_gpu_misuse_is_refused():
    m = _qwen3(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
    batch = _batches(1)[0]
    step = graph_step(m, opt, batch)
    with pytest.raises(GraphStepError, match="optimizer.step\\(\\) is part of the graphed step"):
        opt.step()
    m.eval()
    with pytest.raises(GraphStepError, match="captured in train mode and is now in eval mode"):
        step(batch)
    m.train()
    step(batch)
    step.close()
    with pytest.raises(GraphStepError, match="closed"):
        step(batch)
    opt.step()                                   # the hook is gone with close()

    cpu = _qwen3(torch.float32).cpu()
    with pytest.raises(GraphStepError, match="not on a CUDA device"):
        graph_step(cpu, torch.optim.AdamW(cpu.parameters(), capturable=True), batch)


@pytest.mark.gpu
@cuda
def test_gpu_forward_backward_only_leaves_gradients_and_refuses_accumulation_over_calls():
    batches = _batches(3)
    ref, m = _qwen3(torch.float32), _qwen3(torch.float32)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)           # eager optimizer: no capturable needed
    step = graph_step(m, opt, batches[0], optimizer_step=False)
    for b in batches:
        want = _eager_step(ref, ropt, b)
        got = float(step(b))
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(batches[0])
    with pytest.raises(GraphStepError, match="not used by an optimizer step.*micro_batch"):
        step(batches[1])


@pytest.mark.gpu
@cuda
def test_gpu_an_unpatched_model_is_graphed_with_a_warning():
    m = _qwen3(torch.float32, patched=False)
    with pytest.warns(UnpatchedModelWarning, match="no patchdsl patch"):
        step = graph_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True), _batches(1)[0])
    assert step.patched_sites == 0 and torch.isfinite(step(_batches(1)[0]))


@pytest.mark.gpu
@cuda
def test_gpu_patch_for_training_gives_a_graph_step():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa").cuda()
    m.config.use_cache = False
    handle = patchdsl.patch_for_training(m, patchdsl.PatchdslArguments(kpatch_spec="qwen3", kpatch_cuda_graphs=True))
    step = handle.graph_step(torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True), _batches(1)[0])
    assert torch.isfinite(step(_batches(1)[0])) and step.patched_sites > 0 and handle.patched
    step.close()
    handle.undo()


# ----------------------------------------------------------------------------- the e2e bench variant (CPU)
def test_e2e_has_a_graphs_variant_with_a_spec_and_it_needs_cuda():
    from patchdsl_tools.bench import e2e

    o = e2e.E2EOptions(device="cpu", batches=(1, 4), seq=8, variants=("patchdsl", "patchdsl+graphs", "liger"))
    rows = e2e.plan_rows(o)
    g = [r for r in rows if r.variant == "patchdsl+graphs"]
    assert [r.name for r in g] == ["patchdsl+graphs @1x8", "patchdsl+graphs @4x8"]
    assert all(r.spec and r.spec.endswith("qwen3.kpatch") for r in g)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="patchdsl\\+graphs needs --device cuda"):
            e2e.train(Tiny(), [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}], o, 1, graphed=True)


# ----------------------------------------------------------------------------- CPU: the whole flow, with a stand-in graph
# Everything of graph_step except the capture runs for real on the CPU: warm-up, the sync check (with
# torch.cuda's sync-debug switch replaced by a flag that an op below obeys), restoring the state, the
# per-call checks, re-attaching gradients, the shape policies.  The stand-in for the capture runs the
# step once for its outputs and undoes it (a capture executes nothing); its replay runs the step
# again and writes the results into the captured buffers (a replay overwrites them).
_SYNC_MODE = {"v": 0}


@torch.library.custom_op("patchdsl_test_graphs::hostsync", mutates_args=())
def _hostsync(x: torch.Tensor) -> torch.Tensor:
    if _SYNC_MODE["v"] == "error":
        raise RuntimeError("called a synchronizing CUDA operation")
    return x.clone()


class _StandInGraph:
    def __init__(self, step, static, loss, gn, grads):
        self.step, self.static, self.loss, self.gn, self.grads = step, static, loss, gn, grads
        self.replays = 0

    def replay(self):
        st = self.step
        for p in st._params:
            p.grad = None
        loss, gn = st._run(self.static)
        self.loss.copy_(loss)
        if gn is not None:
            self.gn.copy_(gn)
        for p, g in zip(st._params, self.grads):
            if g is not None:
                g.copy_(p.grad)
        self.replays += 1


def _stand_in_record(self, static):
    snap = self._snapshot()
    self._set_grads_none()
    loss, gn = self._run(static)
    loss = loss.clone()
    gn = gn.clone() if gn is not None else None
    grads = [p.grad for p in self._params]
    self._restore(snap)
    return _StandInGraph(self, static, loss, gn, grads), loss, gn


@pytest.fixture
def stand_in(monkeypatch):
    from contextlib import nullcontext

    from patchdsl.training import graphs

    class Stream:                  # a class (transformers annotates with `torch.cuda.Stream | None`)
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

    def set_mode(m):
        _SYNC_MODE["v"] = m

    for name, fn in dict(current_stream=lambda *a: Stream(), Stream=Stream, stream=lambda s: nullcontext(),
                         synchronize=lambda *a: None, get_rng_state=lambda *a: torch.get_rng_state(),
                         set_rng_state=lambda s, *a: torch.set_rng_state(s),
                         get_sync_debug_mode=lambda: _SYNC_MODE["v"], set_sync_debug_mode=set_mode).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(graphs, "_cuda_device", lambda model: torch.device("cpu"))
    real_check = graphs._check_optimizer
    # AdamW's capturable step refuses CPU tensors: the CPU stand-in steps a plain AdamW
    monkeypatch.setattr(graphs, "_check_optimizer", lambda opt, step: real_check(opt, False))
    monkeypatch.setattr(graphs.GraphedStep, "_record", _stand_in_record)
    _SYNC_MODE["v"] = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny tensors: two intra-op threads on a busy 2-core machine cost 100x
    yield
    torch.set_num_threads(threads)
    _SYNC_MODE["v"] = 0


class TinyLM(torch.nn.Module):
    """A causal-LM stand-in with an HF-style output (``.loss``): fast on a busy CPU (the tiny Qwen3 is
    what the GPU tests graph)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(320, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 320)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, input_ids, labels=None, attention_mask=None):
        from types import SimpleNamespace

        h = self.norm(self.emb(input_ids)) * self.scale
        logits = self.head(torch.nn.functional.dropout(h, 0.0, self.training))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def _cpu_lm(seed=0):
    torch.manual_seed(seed)
    return TinyLM().train()


def _cpu_batches(n, rows=4, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, 320, (rows, seq), generator=g)), "labels": ids.clone()}
            for _ in range(n)]


def _cpu_opt(m, cls=torch.optim.AdamW, **kw):
    kw.setdefault("lr", 1e-2)
    return cls(m.parameters(), **kw)


def _graphed(m, opt, batch, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnpatchedModelWarning)
        return graph_step(m, opt, batch, **kw)


@pytest.mark.parametrize("micro,clip", [(None, None), (2, 0.5), (3, None)])
def test_stand_in_losses_and_weights_equal_eager_and_the_warm_up_is_undone(stand_in, micro, clip):
    batches = _cpu_batches(4)
    ref, m = _cpu_lm(), _cpu_lm()
    ropt, opt = _cpu_opt(ref), _cpu_opt(m)
    want = [_eager_step(ref, ropt, b, micro, clip) for b in batches]
    step = _graphed(m, opt, batches[0], micro_batch=micro, clip_grad_norm=clip, warmup=2)
    assert step.captures == 1 and step.patched_sites == 0
    assert all(torch.count_nonzero(s["step"]) == 0 for s in opt.state.values())    # AdamW state back to zeros
    got = [step(b) for b in batches]
    torch.testing.assert_close(torch.stack(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for p, q in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    graph = next(iter(step._graphs.values()))
    assert graph.graph.replays == 4
    assert all(p.grad is g for p, g in zip(m.parameters(), graph.grads))           # the graph's buffers
    assert (step.grad_norm is not None) == (clip is not None)


def test_stand_in_a_sync_is_named_by_op_and_line_and_the_model_is_left_as_it_was(stand_in):
    m = _cpu_lm()
    opt = _cpu_opt(m)
    before = [p.detach().clone() for p in m.parameters()]

    def loss_fn(model, batch):
        loss = model(**batch).loss
        return loss + 0 * _hostsync(loss.detach())

    with pytest.raises(GraphStepError) as ei:
        _graphed(m, opt, dict(_cpu_batches(1)[0], attention_mask=torch.ones(4, 8, dtype=torch.long)), loss_fn=loss_fn)
    msg = str(ei.value)
    assert "synchronises with the host" in msg and "patchdsl_test_graphs.hostsync.default" in msg
    assert "test_cuda_graph_step.py" in msg and "in _hostsync" in msg
    assert "The batch has an attention_mask" in msg
    assert _SYNC_MODE["v"] == 0                                       # the debug mode is put back
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)
    assert not opt.state or all(torch.count_nonzero(s["step"]) == 0 for s in opt.state.values())
    assert all(p.grad is None for p in m.parameters())


def test_stand_in_shape_policies(stand_in):
    a, b, c = _cpu_batches(1)[0], _cpu_batches(1, rows=2, seed=2)[0], _cpu_batches(1, seed=3)[0]
    ref = _cpu_lm()
    ropt = _cpu_opt(ref)
    want = [_eager_step(ref, ropt, x) for x in (a, b, c)]
    m = _cpu_lm()
    step = _graphed(m, _cpu_opt(m), a)
    with pytest.raises(GraphStepError, match=r"input_ids: shape \[4, 8\] -> \[2, 8\]; labels: shape \[4, 8\] -> "
                                             r"\[2, 8\]\); a CUDA graph replays fixed shapes.*on_shape_change"):
        step(b)
    for policy in ("recapture", "eager"):
        m = _cpu_lm()
        step = _graphed(m, _cpu_opt(m), a, on_shape_change=policy, max_graphs=1)
        got = [float(step(x)) for x in (a, b, c)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, msg=policy)
        for p, q in zip(ref.parameters(), m.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        if policy == "recapture":      # max_graphs=1: a, then b replaces it, then a again
            assert step.captures == 3 and step.signatures == [batch_signature(c)]
        else:
            assert step.captures == 1 and step.eager_calls == 1


def test_stand_in_misuse_is_refused(stand_in):
    m = _cpu_lm()
    opt = _cpu_opt(m)
    batch = _cpu_batches(1)[0]
    step = _graphed(m, opt, batch)
    with pytest.raises(GraphStepError, match=r"optimizer.step\(\) is part of the graphed step"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    with pytest.raises(GraphStepError, match="lr changed from 0.01 to 0.001"):
        step(batch)
    opt.param_groups[0]["lr"] = 1e-2
    m.eval()
    with pytest.raises(GraphStepError, match="captured in train mode and is now in eval mode"):
        step(batch)
    m.train()
    step(batch)
    opt.zero_grad(set_to_none=True)           # harmless: the next call re-attaches the graph's gradients
    step(batch)
    assert all(p.grad is not None for p in m.parameters())
    m.norm.weight.data = m.norm.weight.data.clone()
    with pytest.raises(GraphStepError, match="a parameter of the model was replaced or moved"):
        step(batch)
    step.close()
    with pytest.raises(GraphStepError, match="closed"):
        step(batch)


def test_stand_in_forward_backward_only_refuses_accumulation_over_calls(stand_in):
    batches = _cpu_batches(3)
    ref, m = _cpu_lm(), _cpu_lm()
    ropt, opt = _cpu_opt(ref), _cpu_opt(m)
    step = _graphed(m, opt, batches[0], optimizer_step=False)
    for b in batches:
        want = _eager_step(ref, ropt, b)
        assert float(step(b)) == pytest.approx(want, rel=1e-5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p, q in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    step(batches[0])
    with pytest.raises(GraphStepError, match="not used by an optimizer step.*micro_batch=N"):
        step(batches[1])


def test_stand_in_an_optimizer_with_unknown_initial_state_is_refused_before_the_warm_up(stand_in):
    m = _cpu_lm()
    before = [p.detach().clone() for p in m.parameters()]
    opt = _cpu_opt(m, torch.optim.NAdam)
    with pytest.raises(GraphStepError, match="only knows the initial state of Adam and AdamW.*preserve_state=False"):
        _graphed(m, opt, _cpu_batches(1)[0])
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)) and not opt.state
    step = _graphed(m, opt, _cpu_batches(1)[0], preserve_state=False)      # allowed: the warm-up trains
    assert not all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    step.close()


def test_position_ids_are_refused_packed_sequences_would_go_undetected():
    with pytest.raises(GraphStepError, match="position_ids.*packed"):
        batch_signature({"input_ids": torch.zeros(2, 4, dtype=torch.long),
                         "position_ids": torch.arange(4).expand(2, 4)})


def test_the_checked_warm_up_answers_is_cuda_stream_capturing_only_where_is_tracing_asks_it(monkeypatch):
    """_as_if_capturing makes transformers take its in-capture path during the sync-checked warm-up, and
    leaves a version whose is_tracing() does not consult capture alone (there the capture would hit the sync)."""
    import types
    from patchdsl.training import eager_mask, graphs

    def make(consults: bool):
        mod = types.ModuleType("transformers.utils.import_utils")
        mod.is_cuda_stream_capturing = lambda: False
        if consults:
            exec("def is_tracing(t=None):\n    return is_cuda_stream_capturing()", mod.__dict__)
        else:
            exec("def is_tracing(t=None):\n    return False", mod.__dict__)
        return mod

    for consults in (True, False):
        mod = make(consults)
        monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", mod)
        with eager_mask.as_if_capturing():
            assert mod.is_tracing() is consults
        assert mod.is_tracing() is False and mod.is_cuda_stream_capturing() is False


# ----------------------------------------------------------------------------- CPU: the mask decision in a capture
# transformers 5.17's decision, as written there: under any tracing (a capturing CUDA stream included) the
# causal mask is kept, so SDPA gets a materialised mask and cannot run its flash kernel.
def _ignore_causal_mask_sdpa_517(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
    from transformers.utils.import_utils import is_tracing

    if is_tracing(padding_mask):
        return False
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    if (q_length == 1 or kv_length == q_length) and (padding_mask is None or padding_mask.all()):
        return True
    if q_offset == 0 and (padding_mask is None or (padding_mask[:, :q_length].all()
                                                   and (~padding_mask[:, q_length:]).all())):
        return True
    return False


def _sdpa_masks(model, batch, monkeypatch):
    """The attn_mask SDPA receives in each layer of one forward: None (flash, is_causal) or a tensor."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        seen.append(None if attn_mask is None else attn_mask.detach().clone())
        return real(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(**batch)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    return seen


@pytest.mark.parametrize("decision", ["installed", "5.17"])
def test_a_capture_drops_the_causal_mask_where_eager_does(decision, monkeypatch):
    """In the capture (and the checked warm-up standing for it) an unpadded training batch gets SDPA's is_causal
    path, as eagerly: transformers' packed-sequence check (and 5.17's causal-skip decision) answer "mask" whenever a
    stream captures, and a graphed 4 x 2048 Qwen3 step was 12% slower than eager for it (cuDNN SDPA 44.7 vs
    14.6 ms).  With a custom loss (positions unknown) the mask is kept; a padded batch keeps eager's mask."""
    import transformers.masking_utils as mu
    from transformers import AutoModelForCausalLM
    from patchdsl.training import eager_mask, graphs

    if decision == "5.17":
        monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", _ignore_causal_mask_sdpa_517)
    before = mu._ignore_causal_mask_sdpa
    iu = sys.modules["transformers.utils.import_utils"]
    if "is_cuda_stream_capturing" not in iu.is_tracing.__code__.co_names:
        pytest.skip("this transformers' is_tracing() does not consult CUDA stream capture")
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_config("qwen3"), attn_implementation="sdpa")
    m.config.use_cache = False              # training: no cache, so transformers looks for packed sequences
    ids = torch.randint(0, 300, (2, 12))
    plain = {"input_ids": ids}
    am = torch.ones_like(ids)
    am[1, -3:] = 0
    padded = {"input_ids": ids, "attention_mask": am}

    eager = _sdpa_masks(m, plain, monkeypatch)
    assert eager and all(x is None for x in eager)
    with eager_mask.as_if_capturing():
        captured_raw = _sdpa_masks(m, plain, monkeypatch)
    assert captured_raw and all(x is not None for x in captured_raw)     # what the fix is for
    with eager_mask.as_if_capturing(), eager_mask.mask_as_in_eager(model_positions=False):
        custom_loss = _sdpa_masks(m, plain, monkeypatch)                    # positions unknown: mask kept
    assert custom_loss and all(x is not None for x in custom_loss)
    with eager_mask.as_if_capturing(), eager_mask.mask_as_in_eager(model_positions=True):
        captured = _sdpa_masks(m, plain, monkeypatch)
        assert mu._ignore_causal_mask_sdpa is not before
    assert captured == eager
    assert mu._ignore_causal_mask_sdpa is before

    eager_p = _sdpa_masks(m, padded, monkeypatch)
    with eager_mask.as_if_capturing(), eager_mask.mask_as_in_eager(model_positions=True):
        captured_p = _sdpa_masks(m, padded, monkeypatch)
    assert all(x is not None for x in eager_p) and len(captured_p) == len(eager_p)
    for a, b in zip(captured_p, eager_p):
        assert torch.equal(a, b)


def test_the_mask_decision_keeps_the_capture_answer_for_a_tensor_offset_and_restores_itself(monkeypatch):
    """Only calls that read no tensor are decided with the capture flag off; the original functions come back."""
    import types
    from patchdsl.training import eager_mask, graphs

    iu = types.ModuleType("transformers.utils.import_utils")
    iu.is_cuda_stream_capturing = lambda: True
    exec("def is_tracing(t=None):\n    return is_cuda_stream_capturing()", iu.__dict__)
    mu = types.ModuleType("transformers.masking_utils")
    calls = []

    def decision(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        calls.append(iu.is_tracing())
        return not iu.is_tracing()

    mu._ignore_causal_mask_sdpa = decision
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", iu)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", mu)
    with eager_mask.mask_as_in_eager(model_positions=True):
        assert mu._ignore_causal_mask_sdpa(None, 8, 8, 0, 0) is True
        assert mu._ignore_causal_mask_sdpa(padding_mask=None, q_length=8, kv_length=8, q_offset=0, kv_offset=0)
        assert mu._ignore_causal_mask_sdpa(torch.ones(1, 8, dtype=torch.bool), 8, 8, 0, 0) is False
        assert mu._ignore_causal_mask_sdpa(None, 8, 8, torch.tensor(0), 0) is False
        assert iu.is_tracing() is True
    assert calls == [False, False, True, True]
    assert mu._ignore_causal_mask_sdpa is decision and iu.is_tracing() is True
