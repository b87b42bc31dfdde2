"""PatchdslCallback.from_args in transformers' Trainer: PEFT, model_init, gradient accumulation,
gradient checkpointing, resume, strict, verify, Liger translation; patch_for_training.

Tiny Qwen3/Llama (2 layers, hidden 64, vocab 256), batch 2 x seq 16, and specs with few sites:
the kernels run in Triton's interpreter on the CPU, where every patched site costs seconds a step.
"""

import pytest
import torch

import patchdsl
from patchdsl.interop.liger import LigerConfigError
from patchdsl.training.trainer import KpatchRefused, KpatchVerifyFailed

from ..families import tiny_model

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16
MLP_NORM = "*.mlp: SwiGLU -> fused_swiglu\nmodel.norm: RMSNorm -> fused_rmsnorm\n"
LOSS = "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100)\n"


def data(n=8, seed=0, pad=False):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        if pad:   # a different number of counted tokens per row: num_items_in_batch matters
            labels[int(torch.randint(2, SEQ - 2, (1,), generator=g)):] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def targs(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Spy(transformers.TrainerCallback):
    """Records, at every step and evaluation, whether the model in training is patched."""

    def __init__(self, where=lambda m: m.model.layers[0].mlp):
        self.where, self.steps, self.evals, self.models = where, [], [], []

    def _patched(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return "forward" in self.where(base).__dict__

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.steps.append(self._patched(model))
        self.models.append(model)

    def on_evaluate(self, args, state, control, model=None, **kw):
        self.evals.append(self._patched(model))


def patchdsl_logs(trainer):
    return [e for e in trainer.state.log_history if "patchdsl" in e]


def losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


class Records:
    """Records of transformers.trainer's logger (transformers' loggers do not propagate to pytest's caplog)."""

    def __enter__(self):
        import logging

        self.messages = []
        self.handler = logging.Handler()
        self.handler.emit = lambda r: self.messages.append(r.getMessage())
        self.logger = logging.getLogger("transformers.trainer")
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def test_peft_model_patched_for_training_and_evaluation_then_undone(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen3", vocab_size=VOCAB),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    cb = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=MLP_NORM))
    spy = Spy()
    trainer = transformers.Trainer(model=model, args=targs(tmp_path, eval_strategy="steps", eval_steps=2,
                                                           log_level="info"),
                                   train_dataset=data(), eval_dataset=data(2, seed=1), callbacks=[cb, spy])
    with Records() as rec:
        trainer.train()
    assert spy.steps == [True, True] and spy.evals == [True]
    logs = patchdsl_logs(trainer)
    assert len(logs) == 1 and logs[0]["patchdsl"] == "<string>: 2/2 mlp patched, 1/1 norm patched"
    assert logs[0]["patchdsl_sites_patched"] == 3 and logs[0]["step"] == 0
    assert sum("2/2 mlp patched" in m for m in rec.messages) == 1
    base = model.get_base_model()
    assert "forward" not in base.model.layers[0].mlp.__dict__ and cb.handle is None
    trainer.evaluate()                                   # standalone evaluate: the original model
    assert spy.evals == [True, False]
    assert any(p.grad is not None or "lora" in n for n, p in model.named_parameters() if p.requires_grad)


def test_model_init_each_new_model_is_patched(tmp_path):
    made = []

    def init():
        made.append(tiny_model("qwen3", vocab_size=VOCAB, seed=len(made)))
        return made[-1]

    cb = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm"))
    spy = Spy(lambda m: m.model.norm)
    trainer = transformers.Trainer(model_init=init, args=targs(tmp_path, max_steps=1), train_dataset=data(4),
                                   callbacks=[cb, spy])
    trainer.train()
    trainer.train()                                       # hyperparameter search re-creates the model each trial
    assert len(made) == 3                                 # one in __init__, one per train()
    assert spy.steps == [True, True]
    assert spy.models[0] is made[1] and spy.models[1] is made[2]
    assert len(cb.history) == 2
    assert all("forward" not in m.model.norm.__dict__ for m in made)


def _run(tmp_path, spec, name, **kw):
    model = tiny_model("qwen3", vocab_size=VOCAB)
    cbs = [patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=spec))] if spec else []
    trainer = transformers.Trainer(model=model, args=targs(tmp_path / name, **kw), train_dataset=data(pad=True),
                                   callbacks=cbs)
    trainer.train()
    return trainer


@pytest.mark.parametrize("spec,kw", [
    (LOSS, dict(gradient_accumulation_steps=2, max_steps=5, per_device_train_batch_size=1)),
    ("model.layers.1.mlp: SwiGLU -> fused_swiglu\n", dict(gradient_checkpointing=True, max_steps=5)),
], ids=["grad-accumulation-2", "grad-checkpointing"])
def test_losses_match_unpatched(tmp_path, spec, kw):
    """5 optimizer steps (fp32) patched and unpatched: the same losses.  With accumulation over two
    micro-batches whose counted tokens differ, only a loss that divides by num_items_in_batch matches."""
    ref = _run(tmp_path, None, "ref", **kw)
    pat = _run(tmp_path, spec, "pat", **kw)
    a, b = losses(ref), losses(pat)
    assert len(a) == len(b) == 5
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=2e-5, atol=1e-6)
    entry = patchdsl_logs(pat)[0]
    assert entry["patchdsl_sites_refused"] == 0 and entry["patchdsl_sites_patched"] == 1


def test_seq2seq_trainer(tmp_path):
    """Seq2SeqTrainer (a Trainer subclass) takes the same callback."""
    args = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                                 use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    spy = Spy(lambda m: m.model.norm)
    cb = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm"))
    trainer = transformers.Seq2SeqTrainer(model=tiny_model("qwen3", vocab_size=VOCAB), args=args,
                                          train_dataset=data(4), callbacks=[cb, spy])
    trainer.train()
    assert spy.steps == [True] and patchdsl_logs(trainer)[0]["patchdsl"] == "<string>: 1/1 norm patched"


def test_resume_from_checkpoint(tmp_path):
    spec = "model.norm: RMSNorm -> fused_rmsnorm"
    first = _run(tmp_path, spec, "run", max_steps=2, save_strategy="steps", save_steps=2)
    model = tiny_model("qwen3", vocab_size=VOCAB, seed=5)
    spy = Spy(lambda m: m.model.norm)
    cb = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=spec))
    start = []

    class Weights(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            start.append(model.model.norm.weight.detach().clone())

    trainer = transformers.Trainer(model=model, args=targs(tmp_path / "run", max_steps=3, save_strategy="steps",
                                                           save_steps=2),
                                   train_dataset=data(pad=True), callbacks=[cb, spy, Weights()])
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3 and spy.steps == [True]
    # the patched model continued from the checkpoint's weights (those the first run ended with)
    torch.testing.assert_close(start[0], first.model.model.norm.weight.detach(), rtol=0, atol=0)
    logs = patchdsl_logs(trainer)
    assert [e["step"] for e in logs] == [0, 2]           # the resumed history, then this run's entry
    assert first.state.global_step == 2


def test_strict_refusal_stops_before_the_first_step(tmp_path):
    spy = Spy(lambda m: m.model.layers[0].self_attn)
    spec = "*.self_attn: Attention -> fused_qk_norm_rope"        # Llama has no q_norm/k_norm
    cb = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=spec))
    model = tiny_model("llama", vocab_size=VOCAB)
    trainer = transformers.Trainer(model=model, args=targs(tmp_path), train_dataset=data(), callbacks=[cb, spy])
    with pytest.raises(KpatchRefused) as ei:
        trainer.train()
    msg = str(ei.value)
    assert spy.steps == []
    assert "2 site(s) of <string> refused" in msg and "model.layers.1.self_attn" in msg and "kpatch_strict" in msg
    assert not any(hasattr(m, "_patchdsl_site") for m in model.modules())

    lenient = patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec=spec, kpatch_strict=False))
    trainer = transformers.Trainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=data(),
                                   callbacks=[lenient, spy])
    trainer.train()
    assert spy.steps == [False]
    assert patchdsl_logs(trainer)[0]["patchdsl_sites_refused"] == 2
    assert "0/2 self_attn patched; 2 site(s) refused" in patchdsl_logs(trainer)[0]["patchdsl"]


def test_verify_passes_then_trains_and_fails_with_exit_status_1(tmp_path, capsys):
    ok = patchdsl.PatchdslArguments(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm", kpatch_verify=True)
    model = tiny_model("qwen3", vocab_size=VOCAB)
    spy = Spy(lambda m: m.model.norm)
    trainer = transformers.Trainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=data(),
                                   callbacks=[patchdsl.PatchdslCallback.from_args(ok), spy])
    trainer.train()
    assert spy.steps == [True]
    # eps=0.5 is not the module's eps: a real parity failure, found before any step
    bad = patchdsl.PatchdslArguments(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm(eps=0.5)", kpatch_verify=True)
    trainer = transformers.Trainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=data(),
                                   callbacks=[patchdsl.PatchdslCallback.from_args(bad), spy])
    with pytest.raises(SystemExit) as ei:
        trainer.train()
    assert isinstance(ei.value, KpatchVerifyFailed) and ei.value.code == 1
    assert spy.steps == [True]
    assert "FAIL" in capsys.readouterr().err and not ei.value.report.passed
    assert "forward" not in model.model.norm.__dict__


def test_from_liger_translates_and_keeps_liger_off(tmp_path):
    args = patchdsl.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, use_liger_kernel=True, kpatch_from_liger=True,
        liger_kernel_config={"rope": False, "swiglu": False, "fused_linear_cross_entropy": False, "rms_norm": True})
    model = tiny_model("llama", vocab_size=VOCAB)
    spy = Spy(lambda m: m.model.norm)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(), callbacks=[
        patchdsl.PatchdslCallback.from_args(args), spy])
    assert args.use_liger_kernel is False                # the Trainer will not apply Liger as well
    trainer.train()
    assert spy.steps == [True]
    assert patchdsl_logs(trainer)[0]["patchdsl"] == ("<liger_kernel_config>: 2/2 input_layernorm patched, "
                                                     "2/2 post_attention_layernorm patched, 1/1 norm patched")


def test_from_liger_misfit_stops_training_when_strict(tmp_path):
    args = patchdsl.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[],
                                      save_strategy="no", kpatch_from_liger=True,
                                      liger_kernel_config={"swiglu": True, "geglu": False})
    trainer = transformers.Trainer(model=tiny_model("gemma3", vocab_size=VOCAB), args=args, train_dataset=data(),
                                   callbacks=[patchdsl.PatchdslCallback.from_args(args)])
    with pytest.raises(LigerConfigError) as ei:
        trainer.train()
    assert "2 modules (model.layers.0.mlp, ...) (Gemma3MLP) are GeGLU MLPs" in str(ei.value)   # one line, not one per layer


def test_patch_for_training_in_a_plain_loop():
    model = tiny_model("qwen3", vocab_size=VOCAB)
    args = patchdsl.PatchdslArguments(kpatch_spec=LOSS)
    batch = {k: torch.stack([r[k] for r in data(2, pad=True)]) for k in ("input_ids", "labels")}
    ref = model(**batch).loss
    with patchdsl.patch_for_training(model, args) as handle:
        assert handle.patched == ["lm_head"]
        model.train()
        loss = model(**batch).loss
        loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert "forward" not in model.__dict__
    off = patchdsl.patch_for_training(model, patchdsl.PatchdslArguments())
    assert off.patched == [] and not off.active


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_shipped_spec_bf16_accumulation_matches_unpatched(tmp_path):
    """On the GPU: the full shipped qwen3 spec, bf16 mixed precision, gradient accumulation 2 and
    gradient checkpointing, 5 steps; losses within the bf16 tolerances of docs/verify.md's peers
    (atol 1e-2, rtol 5e-2)."""
    kw = dict(use_cpu=False, bf16=True, gradient_accumulation_steps=2, per_device_train_batch_size=1,
              gradient_checkpointing=True, max_steps=5)
    ref = _run(tmp_path, None, "ref", **kw)
    pat = _run(tmp_path, "qwen3", "pat", **kw)
    a, b = losses(ref), losses(pat)
    assert len(a) == len(b) == 5
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=5e-2, atol=1e-2)
    entry = patchdsl_logs(pat)[0]
    assert entry["patchdsl_sites_refused"] == 0 and "2/2 mlp patched" in entry["patchdsl"]
