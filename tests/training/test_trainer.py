"""TrainingArguments-style config and the Trainer callback."""

import pytest
import torch

from patchdsl import SpecError
from patchdsl.training.trainer import PatchdslCallback, spec_from_config

from ..families import tiny_model


@pytest.mark.parametrize("config,n_rules", [
    ("qwen3", 4),
    ({"spec": "qwen3"}, 4),
    ({"rules": ["*.mlp: SwiGLU -> fused_swiglu"], "dtype": ["bf16"]}, 1),
    ({"rules": ["*.mlp: SwiGLU -> fused_swiglu", "model.norm: RMSNorm -> fused_rmsnorm"], "strict": False}, 2),
])
def test_config_forms(config, n_rules):
    spec, strict = spec_from_config(config)
    assert len(spec.rules) == n_rules


@pytest.mark.parametrize("config,frag", [
    ({"spec": "qwen3", "strcit": True}, "did you mean 'strict'?"),
    ({"rules": "*.mlp: SwiGLU -> fused_swiglu"}, "must be a list of strings"),
    ({"spec": "qwen3", "rules": []}, "exactly one of"),
    ({"rules": ["*.mlp: SwiGLU -> fused_swigul"]}, "did you mean 'fused_swiglu'?"),
    ({"rules": ["*.mlp: SwiGLU -> fused_swiglu"], "strict": "yes"}, "true or false"),
])
def test_config_errors_are_not_silent(config, frag):
    with pytest.raises(SpecError) as ei:
        spec = spec_from_config(config)[0]
        from patchdsl.planning.check import check_spec
        check_spec(spec)
    assert frag in ei.value.render()


def test_trainer_callback_patches_during_train_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    model = tiny_model("qwen3")
    ids = torch.randint(0, 320, (4, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    seen = []

    class Spy(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen.append("forward" in model.model.layers[0].mlp.__dict__)

    cb = PatchdslCallback({"rules": ["*.mlp: SwiGLU -> fused_swiglu", "model.norm: RMSNorm -> fused_rmsnorm"]})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, Spy()])
    out = trainer.train()
    assert seen == [True, True]
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert "forward" not in model.model.layers[0].mlp.__dict__ and cb.handle is None
