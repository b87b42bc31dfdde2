"""Distillation end to end: a tiny Qwen3 student patched with fused_linear_jsd against a tiny teacher
(another architecture size: hidden 48 vs 64), the loss and the student's gradients against the
unpatched computation in float64 (materialised logits, TRL's generalized_jsd_loss formula), and the
errors a wrong teacher gets.  Kernel-level coverage (chunks, bf16, beta, temperature): tests/kernels/
test_linear_jsd.py."""

import copy

import pytest
import torch

import patchdsl
from patchdsl.training.posttrain import distill_loss

from ..families import tiny_model
from ..kernels.helpers import gjsd_per_token

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="tiny CPU models (GPU: tests/kernels)")
SPEC = "dtype fp32\nlm_head: Linear -> fused_linear_jsd(beta={beta}, temperature={t}, chunk=8)\n"


def gjsd(s_logits, t_logits, labels, beta, temperature):
    """TRL GKDTrainer.generalized_jsd_loss (batchmean over labels != -100), written out."""
    s = (s_logits / temperature).log_softmax(-1)
    t = (t_logits / temperature).log_softmax(-1)
    jsd = gjsd_per_token(s, t, beta)
    mask = labels != -100
    return jsd[mask].sum() / mask.sum().clamp(min=1)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 320, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100                  # a prompt
    labels[1, 8:] = -100                  # padding
    return ids, labels


@cpu_only
@pytest.mark.parametrize("beta,temperature", [(0.5, 2.0), (0.0, 1.0), (1.0, 0.8)])
def test_patched_student_loss_and_grads_match_float64(beta, temperature):
    student = tiny_model("qwen3", seed=1)
    teacher = tiny_model("qwen3", seed=2, hidden_size=48, num_attention_heads=3, num_key_value_heads=1).eval()
    ref = copy.deepcopy(student).double()
    handle = patchdsl.apply(SPEC.format(beta=beta, t=temperature), student, strict=True)
    assert not handle.refused and len(handle.patched) == 1
    ids, labels = batch()
    loss = distill_loss(student, teacher, ids, labels)
    loss.backward()
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits.double()
    r = gjsd(ref(input_ids=ids).logits[:, :-1], t_logits[:, :-1], labels[:, 1:], beta, temperature)
    r.backward()
    assert abs(loss.item() - r.item()) <= 1e-5 * abs(r.item()), (loss.item(), r.item())
    grads = dict(student.named_parameters())
    for name, p in ref.named_parameters():
        g, gr = grads[name].grad, p.grad
        assert g is not None, name
        err = (g.double() - gr).norm() / gr.norm().clamp(min=1e-30)
        assert err <= 1e-4, (name, float(err))
    assert all(p.grad is None for p in teacher.parameters())
    out = student(input_ids=ids, labels=labels, teacher_hidden_states=teacher.model(input_ids=ids).last_hidden_state,
                  teacher_head=teacher.lm_head)
    assert out.logits is None and torch.allclose(out.loss, loss.detach())
    handle.undo()
    assert student(input_ids=ids).logits is not None


@cpu_only
def test_calls_without_a_teacher_are_the_original_forward():
    student = tiny_model("qwen3", seed=1)
    ids, labels = batch()
    before = student(input_ids=ids, labels=labels)
    patchdsl.apply(SPEC.format(beta=0.5, t=1.0), student, strict=True)
    after = student(input_ids=ids, labels=labels)
    assert after.logits is not None and torch.equal(after.loss, before.loss)


@cpu_only
def test_wrong_teachers_fail_with_located_errors():
    student = tiny_model("qwen3", seed=1)
    patchdsl.apply("dtype fp32\nlm_head: Linear -> fused_linear_jsd(teacher_hidden=48)\n", student, strict=True)
    ids, labels = batch()
    other_vocab = tiny_model("qwen3", seed=2, vocab_size=300)
    with pytest.raises(ValueError, match=r"fused_linear_jsd on lm_head \(Qwen3ForCausalLM\): vocab mismatch"):
        distill_loss(student, other_vocab, ids.clamp(max=299), labels.clamp(max=299))
    wide = tiny_model("qwen3", seed=3)                      # hidden 64, the spec says 48
    with pytest.raises(ValueError, match="teacher head takes hidden size 64, but the spec says teacher_hidden=48"):
        distill_loss(student, wide, ids, labels)
    narrow = tiny_model("qwen3", seed=2, hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    h_wrong = torch.zeros(2, 11, 40)
    with pytest.raises(ValueError, match="teacher_hidden_states have size 40 .* expects 48"):
        student(input_ids=ids, labels=labels, teacher_hidden_states=h_wrong, teacher_head=narrow.lm_head)
    with pytest.raises(ValueError, match="run the teacher on the same input_ids"):
        student(input_ids=ids, labels=labels, teacher_hidden_states=torch.zeros(2, 10, 48), teacher_head=narrow.lm_head)
    with pytest.raises(ValueError, match="give both teacher_hidden_states and teacher_head"):
        student(input_ids=ids, labels=labels, teacher_head=narrow.lm_head)
    with pytest.raises(ValueError, match="not patched with fused_linear_jsd"):
        distill_loss(tiny_model("qwen3"), narrow, ids, labels)

    class Wrapper(torch.nn.Module):          # DDP-like: the patched model is .module
        def __init__(self, m):
            super().__init__()
            self.module = m

        def forward(self, **kw):
            return self.module(**kw)

    direct = distill_loss(student, narrow, ids, labels)
    assert torch.equal(distill_loss(Wrapper(student), Wrapper(narrow), ids, labels), direct)


@cpu_only
@pytest.mark.parametrize("beta", [0.5, 0.0])
def test_gkd_trainer_compute_loss_patched_equals_trl(beta):
    """TRL's GKDTrainer.compute_loss (unpatched student, materialised logits) and FusedGKDLoss's
    (patched student, fused_linear_jsd) on the same batch: equal loss and student gradients."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    from types import SimpleNamespace

    from patchdsl.training.posttrain import FusedGKDLoss

    teacher = tiny_model("qwen3", seed=2, hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    plain = tiny_model("qwen3", seed=1)
    fused = copy.deepcopy(plain)
    patchdsl.apply(SPEC.format(beta=beta, t=1.0), fused, strict=True)
    ids, labels = batch(3)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    trl_self = SimpleNamespace(teacher_model=teacher, beta=beta,
                               generalized_jsd_loss=gkd.GKDTrainer.generalized_jsd_loss)
    want = gkd.GKDTrainer.compute_loss(trl_self, plain, inputs, num_items_in_batch=torch.tensor(9))
    got = FusedGKDLoss.compute_loss(SimpleNamespace(teacher_model=teacher, beta=beta), fused, inputs,
                                    num_items_in_batch=torch.tensor(9))
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) <= 2e-5 * abs(want.item()), (got.item(), want.item())
    mine = dict(fused.named_parameters())
    for name, p in plain.named_parameters():
        err = (mine[name].grad - p.grad).norm() / p.grad.norm().clamp(min=1e-30)
        assert err <= 1e-4, (name, float(err))
    with pytest.raises(ValueError, match=r"fused_linear_jsd\(beta=%s, temperature=1.0\) but the trainer's loss uses "
                                         r"beta=0.7" % beta):
        FusedGKDLoss.compute_loss(SimpleNamespace(teacher_model=teacher, beta=0.7), fused, inputs)
