"""Post-training on fused_linear_logprobs: the patched model's per-token outputs, the DPO/GRPO
losses of patchdsl.training.posttrain against float64 re-implementations of TRL's formulas, and TRL's own
trainers (DPOTrainer end to end, GRPOTrainer's loss on recorded rollouts) patched vs unpatched.

TRL's "unpatched path" is its own fused LM head (``trl.trainer.utils.add_fused_lm_head``, which its
trainers install); patchdsl's op is installed over it after the trainer is built and answers the
same ``fused_lm_head=True`` calls (docs/post-training.md).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import patchdsl
from patchdsl.training.posttrain import (completion_labels, dpo_loss, grpo_loss, patch_trainer, sequence_logps,
                                token_logprobs)

from ..families import tiny_model

# Tiny models run on the CPU with interpreter kernels; on a GPU box the kernels' coverage at real sizes is
# tests/kernels/test_linear_logprobs.py.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="tiny CPU models (GPU: tests/kernels)")
SPEC = "dtype fp32\nlm_head: Linear -> fused_linear_logprobs(temperature={t})\n"
VOCAB = 320


def patched(model, temperature=1.0):
    return patchdsl.apply(SPEC.format(t=temperature), model, strict=True)


def rollout(seed=0, batch=4, prompt=5, completion=7):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (batch, prompt), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0                                   # left padding
    completion_ids = torch.randint(3, VOCAB, (batch, completion), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 4:] = 0                               # an early EOS
    completion_mask[2, 1:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask, g


# ------------------------------------------------------------------- the patched model's outputs
@cpu_only
def test_token_logprobs_match_float64():
    """Hidden states from the model's own backbone; the LM head, softmax and shift in float64.
    (A float64 copy of the whole model gives NaN on left-padded rows in eager attention.)"""
    temperature = 0.7
    model = tiny_model("qwen3")
    patched(model, temperature)
    p_ids, p_mask, c_ids, c_mask, _ = rollout()
    ids, am = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    cm = torch.cat([torch.zeros_like(p_mask), c_mask], 1)
    out = token_logprobs(model, ids, am, cm)
    assert out.logits is None and out.log_probs.shape == (4, ids.shape[1] - 1)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=am).last_hidden_state[:, :-1].double()
        logits = hidden @ model.lm_head.weight.double().T / temperature
    ls = logits.log_softmax(-1)
    tgt = completion_labels(ids, cm)[:, 1:]
    m = tgt != -100
    lp = torch.where(m, ls.gather(-1, tgt.clamp(min=0)[..., None])[..., 0], 0.0)
    ent = torch.where(m, -(ls.exp() * ls).sum(-1), 0.0)
    for name, got, want in (("log_probs", out.log_probs, lp), ("entropy", out.entropy, ent),
                            ("lse", out.lse, torch.where(m, logits.logsumexp(-1), 0.0))):
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-5, (name, err.item())
    assert torch.equal(out.label_mask, m)
    assert torch.allclose(out.loss.double(), -lp.sum() / m.sum(), rtol=1e-5)
    # shift_labels (context parallelism): already shifted, scored as given, over every position
    shifted = F.pad(tgt, (0, 1), value=-100)
    with torch.no_grad():
        sh = model(input_ids=ids, attention_mask=am, shift_labels=shifted, fused_lm_head=True)
    assert sh.log_probs.shape == ids.shape and torch.count_nonzero(sh.log_probs[:, -1]) == 0
    assert torch.allclose(sh.log_probs[:, :-1], out.log_probs.detach(), atol=1e-6)
    # eval + no_grad (a reference model): the same values, no graph
    model.eval()
    with torch.no_grad():
        again = token_logprobs(model, ids, am, cm)
    assert not again.log_probs.requires_grad
    assert torch.allclose(again.log_probs, out.log_probs, atol=1e-6)


@cpu_only
def test_training_with_labels_gives_hf_loss_and_no_logits():
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    h = patched(model, temperature=0.5)          # the labels loss ignores the temperature (HF's loss)
    out = model.train()(input_ids=ids, labels=ids)
    assert out.logits is None and torch.allclose(out.loss, want, rtol=1e-5)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    h.undo()
    assert "forward" not in model.__dict__


@cpu_only
def test_fused_lm_head_without_labels_is_an_error():
    model = tiny_model("qwen3")
    patched(model)
    with pytest.raises(ValueError, match="needs labels"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), fused_lm_head=True)


@cpu_only
def test_softcapped_model_is_refused():
    from patchdsl.runtime.patch import PatchError

    with pytest.raises(PatchError, match="softcapping"):
        patchdsl.apply("dtype fp32\nlm_head: Linear -> fused_linear_logprobs\n", tiny_model("gemma3"), strict=True)


# ------------------------------------------------------------------- the losses vs float64 TRL formulas
def trl_dpo64(c, r, rc, rr, beta, eps):
    """trl 1.x DPOTrainer._compute_loss, loss_type sigmoid (eps = 0) / cDPO (eps > 0), in float64."""
    d = (c.double() - rc.double()) - (r.double() - rr.double())
    return (-F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps).mean()


def trl_grpo64(lp, old, ref, adv, mask, beta, lo, hi, loss_type, n_items=None, max_len=None, bias_corr=True):
    """trl 1.x GRPOTrainer._compute_loss (token-level IS, no accumulation scaling), in float64."""
    lp, mask, adv = lp.double(), mask.double(), adv.double()[:, None]
    coef_1 = torch.exp(lp - old.double())
    coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
    ptl = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        ref = ref.double()
        ptl = ptl + beta * (torch.exp(ref - lp) - (ref - lp) - 1) * (coef_1 if bias_corr else 1.0)
    if loss_type == "grpo":
        return ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (ptl * mask).sum() / (ptl.size(0) * max_len)
    return (ptl * mask).sum() / n_items


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo_loss_matches_trl_formula(beta, eps):
    g = torch.Generator().manual_seed(int(beta * 10 + eps * 100))
    c, r, rc, rr = (torch.randn(6, generator=g, dtype=torch.float32) * 20 - 40 for _ in range(4))
    c.requires_grad_()
    loss, cr, rj = dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=eps)
    c64 = c.detach().double().requires_grad_()
    want = trl_dpo64(c64, r, rc, rr, beta, eps)
    assert abs(loss.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item()))
    loss.backward()
    want.backward()
    assert torch.allclose(c.grad.double(), c64.grad, rtol=1e-5, atol=1e-8)
    assert torch.allclose(cr.double(), beta * (c.detach().double() - rc.double()), rtol=1e-5)


GRPO_CASES = [("grpo", 0.0, 0.2, 0.2, True), ("bnpo", 0.04, 0.2, 0.28, True), ("dr_grpo", 0.0, 0.2, 0.2, True),
              ("dapo", 0.04, 0.2, 0.28, True), ("dapo", 0.1, 0.2, 0.2, False)]


@pytest.mark.parametrize("loss_type,beta,lo,hi,bias_corr", GRPO_CASES)
def test_grpo_loss_matches_trl_formula(loss_type, beta, lo, hi, bias_corr):
    g = torch.Generator().manual_seed(len(loss_type))
    lp = (torch.randn(4, 7, generator=g) - 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(4, 7, generator=g)    # off-policy: some ratios get clipped
    ref = lp.detach() + 0.1 * torch.randn(4, 7, generator=g)
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    mask[3] = 0                                                  # an empty completion
    n_items = mask.sum() + 5
    loss = grpo_loss(lp, adv, mask, old, ref, beta=beta, epsilon_low=lo, epsilon_high=hi, loss_type=loss_type,
                     num_items_in_batch=n_items, max_completion_length=7, kl_bias_correction=bias_corr)
    lp64 = lp.detach().double().requires_grad_()
    want = trl_grpo64(lp64, old, ref, adv, mask, beta, lo, hi, loss_type, n_items, 7, bias_corr)
    assert abs(loss.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item()))
    loss.backward()
    want.backward()
    assert torch.allclose(lp.grad.double(), lp64.grad, rtol=1e-5, atol=1e-9)


def test_grpo_loss_refuses_what_it_cannot_compute():
    lp, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(lp, torch.ones(2), m, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(lp, torch.ones(2), m, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(lp, torch.ones(2), m, loss_type="dr_grpo")


# ------------------------------------------------------------------- TRL's trainers, patched vs unpatched
def word_tokenizer():
    """A word-level tokenizer over w0..w299 built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def preference_data(n=8, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 300, (k,), generator=g))

    rows = [{"prompt": words(3 + i % 3), "chosen": " " + words(2 + i % 4), "rejected": " " + words(3 + (i + 1) % 3)}
            for i in range(n)]
    return Dataset.from_list(rows)


def run_dpo(tmp_path, patch):
    trl = pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer

    losses = []

    class Recorder(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append((out[0] if return_outputs else out).detach().clone())
            return out

    model = tiny_model("qwen3", seed=3)
    ref = tiny_model("qwen3", seed=3)
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=5e-3,
                     beta=0.1, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                     disable_tqdm=True, seed=0, max_length=32, bf16=False)
    trainer = Recorder(model=model, ref_model=ref, args=args, train_dataset=preference_data(4),
                       processing_class=word_tokenizer())
    handles = patch_trainer(trainer, SPEC.format(t=1.0), strict=True) if patch else []
    trainer.train()
    assert trl.__version__
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.named_parameters()}, handles


@cpu_only
def test_dpo_trainer_patched_matches_unpatched(tmp_path):
    base_losses, base_params, _ = run_dpo(tmp_path / "a", patch=False)
    losses, params, handles = run_dpo(tmp_path / "b", patch=True)
    assert all(h.patched == ["lm_head"] for h in handles)
    assert len(losses) == 2 and torch.isfinite(losses).all()
    assert not torch.allclose(losses[0], losses[-1])          # it trains
    assert torch.allclose(losses, base_losses, rtol=2e-5, atol=1e-6), (losses, base_losses)
    for k, v in params.items():     # Adam turns rounding-level gradient differences into ~lr steps on tiny grads
        assert (v - base_params[k]).norm() <= 1e-3 * base_params[k].norm(), k


def grpo_trainer(tmp_path, loss_type, beta, temperature):
    """A GRPOTrainer built offline; beta is set after construction (it would otherwise load a
    reference model by name: _compute_loss only reads the reference log-probs from its inputs)."""
    pytest.importorskip("trl")
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=7, loss_type=loss_type, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                      temperature=temperature, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                      bf16=False)
    trainer = GRPOTrainer(model=tiny_model("qwen3", seed=5), args=args,
                          reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          train_dataset=preference_data(4).rename_column("chosen", "x"),
                          processing_class=word_tokenizer())
    trainer.beta = beta
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps   # set by train()
    return trainer


@cpu_only
@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.04), ("grpo", 0.0)])
def test_grpo_loss_on_recorded_rollouts_patched_matches_unpatched(tmp_path, loss_type, beta):
    """GRPOTrainer generates, which needs no GPU but makes runs differ; its loss on fixed rollouts
    (completions, advantages, old and reference log-probs) is what the ops change."""
    temperature = 0.9
    trainer = grpo_trainer(tmp_path, loss_type, beta, temperature)
    model = trainer.model
    p_ids, p_mask, c_ids, c_mask, g = rollout(seed=2)
    inputs = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask,
              "advantages": torch.randn(4, generator=g), "num_items_in_batch": c_mask.sum().float(),
              "old_per_token_logps": None}
    ids, am = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    with torch.no_grad():           # the rollout's old log-probs: one step behind, so ratios move off 1
        lg = model(input_ids=ids, attention_mask=am).logits[:, -8:-1] / temperature
        inputs["old_per_token_logps"] = lg.log_softmax(-1).gather(-1, c_ids[..., None])[..., 0] + 0.05
        if beta:
            rl = tiny_model("qwen3", seed=6)(input_ids=ids, attention_mask=am).logits[:, -8:-1] / temperature
            inputs["ref_per_token_logps"] = rl.log_softmax(-1).gather(-1, c_ids[..., None])[..., 0]
    model.train()

    def loss_and_grad():
        model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, dict(inputs))
        loss.backward()
        return loss.detach(), model.lm_head.weight.grad.clone(), model.model.norm.weight.grad.clone()

    base = loss_and_grad()
    handles = [patched(model, temperature)]
    got = loss_and_grad()
    assert handles[0].patched == ["lm_head"]
    for a, b, name in zip(got, base, ("loss", "grad_lm_head", "grad_norm")):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (name, (a - b).abs().max().item())
    # and patchdsl.training.posttrain.grpo_loss on the patched model's log-probs gives TRL's number
    cm = torch.cat([torch.zeros_like(p_mask), c_mask], 1)
    lp = token_logprobs(model, ids, am, cm).log_probs[:, -7:]
    steps = trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    mine = grpo_loss(lp, inputs["advantages"], c_mask, inputs["old_per_token_logps"],
                     inputs.get("ref_per_token_logps"), beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                     loss_type=loss_type, num_items_in_batch=inputs["num_items_in_batch"] * steps)
    if loss_type == "grpo":
        mine = mine / trainer.current_gradient_accumulation_steps
    assert math.isclose(mine.item(), got[0].item(), rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(sequence_logps(lp, c_mask), (lp * c_mask).sum(-1))


@cpu_only
def test_patch_trainer_keeps_the_reference_models_autocast(tmp_path):
    """bf16 mixed precision: accelerate wrapped the reference model's forward in autocast when the
    trainer was built; after patch_trainer the reference still runs under it (as TRL's does)."""
    pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[],
                     save_strategy="no", disable_tqdm=True, max_length=32, bf16=True)
    trainer = DPOTrainer(model=tiny_model("qwen3", seed=3), ref_model=tiny_model("qwen3", seed=3), args=args,
                         train_dataset=preference_data(2), processing_class=word_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    ids, am = batch["input_ids"], batch["attention_mask"]
    labels = completion_labels(ids, batch["completion_mask"])

    def ref_logps():
        with torch.no_grad():
            return trainer.ref_model(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True).log_probs

    seen = []          # the dtype of a backbone matmul's output: bfloat16 under autocast
    hook = trainer.ref_model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    trl_bf16 = ref_logps()
    handles = patch_trainer(trainer, "dtype bf16, fp32\nlm_head: Linear -> fused_linear_logprobs\n", strict=True)
    ours = ref_logps()
    hook.remove()
    assert [h.patched for h in handles] == [["lm_head"], ["lm_head"]]
    assert seen == [torch.bfloat16, torch.bfloat16]
    m = labels[:, 1:] != -100
    assert (ours - trl_bf16)[m].abs().max() < 0.1           # both bf16: within bf16 rounding of each other
    for h in reversed(handles):
        h.undo()
    assert torch.equal(ref_logps(), trl_bf16)
