"""TRL's SFTTrainer with PatchdslCallback.from_args for 3 steps."""

import pytest
import torch

import patchdsl

from ..families import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

VOCAB = 256


def byte_tokenizer():
    """A byte-level tokenizer built in memory (no download): ids 0-255 are bytes, 255 doubles as pad/eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {bytes([i]).decode("latin-1"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="\x00"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="\xff", eos_token="\xff")


def test_sft_trainer_with_the_callback(tmp_path):
    spec = "*.mlp: SwiGLU -> fused_swiglu\nmodel.norm: RMSNorm -> fused_rmsnorm\n" \
           "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100)\n"
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                         report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, max_length=16,
                         learning_rate=1e-3)
    kp = patchdsl.PatchdslArguments(kpatch_spec=spec)
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"input_ids": torch.randint(0, 250, (16,), generator=g).tolist()}
                                     for _ in range(6)])
    model = tiny_model("qwen3", vocab_size=VOCAB)
    seen = []

    from transformers import TrainerCallback

    class Spy(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen.append("forward" in model.model.layers[1].mlp.__dict__)

    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=byte_tokenizer(),
                             callbacks=[patchdsl.PatchdslCallback.from_args(kp), Spy()])
    out = trainer.train()
    assert out.global_step == 3 and seen == [True, True, True]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    entry = [e for e in trainer.state.log_history if "patchdsl" in e]
    assert entry[0]["patchdsl"] == "<string>: 2/2 mlp patched, 1/1 norm patched, 0/1 lm_head patched"
    assert "forward" not in model.model.layers[1].mlp.__dict__
