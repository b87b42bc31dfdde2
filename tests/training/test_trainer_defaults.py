"""Every shipped spec in a default ``transformers.Trainer`` (issue: the fused LM-head loss crashed on
the Trainer's own in-place ``loss *= ...`` scaling, so every shipped spec crashed there)."""

import pytest
import torch

from ..families import tiny_model
from ..shipped_specs import BUILDERS, SHIPPED

pytest.importorskip("accelerate")


@pytest.mark.parametrize("spec", SHIPPED)
def test_default_trainer_runs_every_shipped_spec(tmp_path, spec):
    from transformers import Trainer, TrainingArguments

    from patchdsl.training.trainer import PatchdslCallback

    model = BUILDERS[spec]()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (6, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in ids]
    cb = PatchdslCallback({"spec": spec})
    # default arguments, but for what a CPU test needs (device, no reporting, no checkpoints)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    out = trainer.train()
    assert out.global_step == 3
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert not cb.handle, "the callback undoes the patch when training ends"


@pytest.mark.parametrize("op", ["*=", "/=", "+=", "-="])
def test_fused_loss_may_be_modified_in_place(op):
    """The loss returned by the fused cross entropies is no view: in-place arithmetic on it works and
    the gradient stays right (compared with the same arithmetic on PyTorch's own loss)."""
    import patchdsl

    grads = []
    for fused in (False, True):
        model = tiny_model("qwen3")
        ids = torch.randint(0, 320, (2, 8), generator=torch.Generator().manual_seed(2))
        handle = patchdsl.apply("lm_head: Linear -> fused_linear_cross_entropy", model) if fused else None
        loss = model(input_ids=ids, labels=ids).loss
        assert loss._base is None
        exec(f"loss {op} 3.0")
        loss.backward()
        grads.append(model.model.norm.weight.grad.clone())
        if handle:
            handle.undo()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
