"""Post-training ops against their peers (issue 16 items 4 and 5): time, peak memory, agreement.

    python3 bench/posttrain_bench.py [--out DIR] [--budget 58] [--liger-compiled auto|0|1]
    python3 bench/posttrain_bench.py --tiny          # CPU smoke run (interpreter kernels; times mean nothing)

Sizes (default): Qwen3-0.6B's head, hidden 1024, vocab 151936, sequences of 4096 tokens (the first
1024 a prompt whose positions are ignored), bf16.  Cases, each forward + backward to the hidden
states and the head weight (``torch.autograd.grad``), inputs made once per case:

* ``logprobs``: per-token log-prob and entropy of one sequence, gradient through both
  (``sum(u1 * logprob + u2 * entropy)``, random u);
* ``logprobs_fwd``: per-token log-probs under ``no_grad`` (what a reference model runs);
* ``dpo``: a chosen/rejected pair (2 x 4096), sigmoid DPO (beta 0.1) with the reference
  log-probs precomputed (Liger 0.8.5 takes no precomputed ones: it gets the reference hidden
  states and head and computes them itself, one no-grad head pass more, as its DPO is used);
* ``grpo``: a group of 2 completions of 3072 tokens (one ends early), clipped GRPO with the k3 KL
  term (beta 0.04, epsilon 0.2/0.28, ``dapo``, temperature 0.9, old and reference log-probs given).

Peers: ``patchdsl`` (``fused_linear_logprobs`` + ``patchdsl.training.posttrain``), ``torch`` (the plain
path: the whole logits, fp32 log_softmax, gather; the losses from ``patchdsl.training.posttrain``), ``trl``
(TRL's own chunked log-prob kernel, ``trl.kernels.ChunkedLogProbFunction``, on the non-ignored
positions as TRL's fused head calls it: TRL's path when not patched) and ``liger``
(``LigerFusedLinearDPOLoss`` / ``LigerFusedLinearGRPOLoss``, torch.compile'd as by default when
the time budget allows, else eager, which the JSON says).  Every peer's values and gradients are
compared with the ``torch`` peer's in the same run (tolerances below); a disagreement makes the
exit status 1.

``recipe`` (item 4): one DPO training step (TRL's ``DPOTrainer.compute_loss`` + backward) of the
Qwen3-0.6B architecture (random weights from patchdsl's shipped config, bf16, sdpa, a reference
model with slightly perturbed weights) on a 2 x 4096 pair, three ways: ``trl`` (TRL's own fused LM
head, what DPOTrainer installs), ``patchdsl`` (``patch_trainer`` over it) and ``logits`` (a forward
that materialises the logits and takes fp32 log_softmax, as TRL did before its fused head).

Time: median of CUDA-event-timed repetitions after a warm-up call (whose wall time, compiles
included, is reported).  Peak memory: ``max_memory_allocated`` during one call minus what was
allocated before it (inputs, weights; the gradients the call returns are counted).  Writes
``posttrain.json`` and ``posttrain.txt`` (the table) into ``--out``, else ``$PART_OUT``, else the
current directory, and prints the table and the verdict last.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()        # the budget counts the imports too

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

import patchdsl  # noqa: E402,F401  (first: it switches Triton's interpreter on before anything imports triton)
import torch  # noqa: E402

from patchdsl.training.posttrain import dpo_loss, grpo_loss  # noqa: E402

IGNORE = -100
# bf16 agreement with the torch peer (both round the logits to bf16; relative Frobenius errors):
# per-token values as the kernel tests' bf16 bar against float64, gradients and losses twice that
# (two bf16 implementations, each within the bar of the exact value).
TOL = {"values": 1.6e-2, "grads": 3.2e-2, "loss": 3.2e-2}
RECIPE_TOL = {"loss": 2e-2, "grads": 6e-2}        # a 28-layer bf16 backward on top of the head's rounding

FULL = dict(seq=4096, prompt=1024, hidden=1024, vocab=151936, dtype="bf16", model="Qwen/Qwen3-0.6B")
TINY = dict(seq=12, prompt=4, hidden=32, vocab=160, dtype="bf16", model="Qwen/Qwen3-0.6B")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PEERS = ("patchdsl", "torch", "trl", "liger")


class Unavailable(Exception):
    """A peer that cannot run here (not installed, no such API in this version)."""


# ------------------------------------------------------------------------------ measuring
class Clock:
    def __init__(self, budget: float, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.budget = budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(step: Callable[[], dict], dev: torch.device, target_s: float = 0.3, max_reps: int = 20) -> tuple[dict, dict]:
    """(first call's outputs, record): warm-up wall time, peak extra memory of one call, median time."""
    t = time.perf_counter()
    out = step()
    sync(dev)
    rec: dict[str, Any] = {"warmup_s": round(time.perf_counter() - t, 3)}
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        again = step()
        sync(dev)
        rec["peak_extra_mib"] = round((torch.cuda.max_memory_allocated(dev) - base) / 2**20, 1)
        del again
        one = time.perf_counter()
        step()
        sync(dev)
        est = time.perf_counter() - one
        reps = max(3, min(max_reps, int(target_s / max(est, 1e-4))))
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        rec.update(ms=round(times[len(times) // 2], 3), ms_min=round(times[0], 3), reps=reps)
    else:                                   # CPU (tiny, interpreter): the one call's time, no memory stats
        rec.update(ms=round(rec["warmup_s"] * 1e3, 3), reps=1, peak_extra_mib=None)
    return out, rec


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    d = b.norm().item()
    return (a - b).norm().item() / (d if d > 0 else 1.0)


def compare(out: dict, ref: dict, tol: dict) -> list[dict]:
    """One check per key both have: relative error against the reference peer's value."""
    checks = []
    for kind in ("values", "loss", "grads"):
        for k, v in out.get(kind, {}).items():
            if v is None or ref.get(kind, {}).get(k) is None:
                continue
            e = rel_err(v, ref[kind][k])
            checks.append({"what": f"{kind}:{k}", "rel_err": e, "tol": tol[kind], "ok": e <= tol[kind]})
    return checks


# ------------------------------------------------------------------------------ peers: the head's log-probs
def patchdsl_kernels(vocab: int, hidden: int, dtype: str, dev: torch.device):
    from patchdsl.codegen import KernelKey, load_kernel
    from patchdsl.model.info import ModuleInfo
    from patchdsl.ops.registry import get_op

    op = get_op("fused_linear_logprobs")
    facts = {"vocab": vocab, "hidden": hidden, "bias": False, "softcap": None, "logits_scaling": None, "tied": False}
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts}, dtype=dtype)
    p = op.key_params(info, op.default_flags(), dtype, "cuda" if dev.type == "cuda" else "interpreter")
    return load_kernel(KernelKey.for_op(op, p))


def torch_logprobs(h, w, y, temperature=1.0, entropy=False):
    """The plain path: logits (the head's dtype), fp32 log_softmax, gather; 0 where ignored."""
    logits = (h @ w.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    ls = logits.log_softmax(-1)
    ok = y != IGNORE
    lp = torch.where(ok, ls.gather(-1, y.clamp(min=0)[..., None])[..., 0], 0.0)
    ent = torch.where(ok, -(ls.exp() * ls).sum(-1), 0.0) if entropy else None
    return lp, ent


TRL_SIGNATURE = ["hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
                 "logit_scale", "outputs"]


def trl_logprobs(h, w, y, temperature=1.0, entropy=False):
    """TRL's fused head: its chunked kernel on the non-ignored positions, scattered back (0 elsewhere)."""
    import inspect

    try:
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except ImportError as e:
        raise Unavailable(f"trl has no ChunkedLogProbFunction ({e})") from None
    params = list(inspect.signature(ChunkedLogProbFunction.forward).parameters)[1:]
    if params[:9] != TRL_SIGNATURE:
        raise Unavailable(f"trl's ChunkedLogProbFunction takes {params}, not the 1.16 arguments this bench passes")
    mask = y != IGNORE
    outs = ("entropy",) if entropy else ()
    lp, ent, *_ = ChunkedLogProbFunction.apply(h[mask], w, None, y[mask], temperature, chunk, None, 1.0, outs)
    scatter = lambda x: None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)  # noqa: E731
    return scatter(lp), scatter(ent)


def head_logprobs(peer: str, mod) -> Callable:
    if peer == "patchdsl":
        def f(h, w, y, temperature=1.0, entropy=False):
            lp, ent = mod.linear_logprobs(h, w, None, y, temperature)[:2]
            return lp, (ent if entropy else None)
        return f
    if peer == "torch":
        return torch_logprobs
    if peer == "trl":
        return trl_logprobs
    raise Unavailable(f"{peer} has no per-token log-prob op here")


def liger_module(name: str):
    try:
        import liger_kernel.chunked_loss as lc
    except ImportError as e:
        raise Unavailable(f"liger-kernel is not installed ({e})") from None
    if not hasattr(lc, name):
        raise Unavailable(f"liger_kernel.chunked_loss has no {name}")
    return getattr(lc, name)


# ------------------------------------------------------------------------------ the cases
def make_case(name: str, S: dict, dev: torch.device, seed: int = 0) -> dict:
    """Inputs of one case (on ``dev``), made once: every peer sees the same tensors."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[S["dtype"]]
    H, V, T, P = S["hidden"], S["vocab"], S["seq"], S["prompt"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    w = randn(V, H, scale=0.02)                                   # Qwen3's initializer_range
    c: dict[str, Any] = {"w": w}
    if name in ("logprobs", "logprobs_fwd"):
        c["h"] = randn(1, T, H)
        y = torch.randint(0, V, (1, T), generator=g)
        y[:, :P] = IGNORE
        c["y"] = y.to(dev)
        c["u"] = [torch.randn(1, T, generator=g).to(dev) for _ in range(2)]
    elif name == "dpo":
        c["h"] = randn(2, T, H)                                   # [chosen; rejected]
        y = torch.randint(0, V, (2, T), generator=g)
        y[:, :P] = IGNORE
        y[1, T - T // 8:] = IGNORE                                # the rejected answer is shorter
        c["y"] = y.to(dev)
        c["ref_h"] = (c["h"].float() + randn(2, T, H, scale=0.05).float()).to(dt)
        c["ref_w"] = (w.float() + randn(V, H, scale=0.002).float()).to(dt)
        with torch.no_grad():                                     # the reference model's sequence log-probs
            ref = torch.cat([torch_logprobs(c["ref_h"][i:i + 1], c["ref_w"], c["y"][i:i + 1])[0] for i in range(2)])
        c["ref_logps"] = ref.sum(-1)
    elif name == "grpo":
        Tc = T - P
        c["h"] = randn(2, Tc, H)                                  # the completions' hidden states
        ids = torch.randint(0, V, (2, Tc), generator=g)
        mask = torch.ones(2, Tc, dtype=torch.long)
        mask[1, Tc - Tc // 4:] = 0                                # an early EOS
        c["ids"], c["mask"] = ids.to(dev), mask.to(dev)
        c["y"] = c["ids"].masked_fill(c["mask"] == 0, IGNORE)
        c["adv"] = torch.tensor([0.8, -0.6]).to(dev)
        c["temperature"] = 0.9
        with torch.no_grad():
            lp = torch.cat([torch_logprobs(c["h"][i:i + 1], w, c["y"][i:i + 1], 0.9)[0] for i in range(2)])
        c["old"] = lp + 0.05 * torch.randn(lp.shape, generator=g).to(dev)         # one step behind
        c["ref"] = lp + 0.1 * torch.randn(lp.shape, generator=g).to(dev)
    else:
        raise ValueError(name)
    return c


def step_fn(case: str, peer: str, c: dict, mod, liger_compiled: bool) -> Callable[[], dict]:
    """A no-argument forward + backward of ``peer`` on ``case``; returns {"values", "loss", "grads"}."""
    h, w = c["h"], c["w"]
    if peer == "liger":
        if case == "dpo":
            loss_fn = liger_module("LigerFusedLinearDPOLoss")(
                beta=0.1, compute_nll_loss=False, compiled=liger_compiled, use_ref_model=True,
                average_log_prob=False, chunk_size=1, loss_type="sigmoid")

            def step():
                hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()
                loss, aux = loss_fn(ws, hs, c["y"], ref_input=c["ref_h"], ref_weight=c["ref_w"])
                gh, gw = torch.autograd.grad(loss, (hs, ws))
                return {"loss": {"loss": loss.detach()}, "values": {"seq_logps": torch.cat([aux[0], aux[1]]).detach()},
                        "grads": {"hidden": gh, "weight": gw}}
            return step
        if case == "grpo":
            import inspect

            cls = liger_module("LigerFusedLinearGRPOLoss")
            if "use_bias_correction_kl" not in inspect.signature(cls.__init__).parameters:
                raise Unavailable("this Liger's GRPO loss has no use_bias_correction_kl (TRL's KL term; 0.8.5 has it)")
            loss_fn = cls(
                beta=0.04, compiled=liger_compiled, use_ref_model=True, chunk_size=1, epsilon_low=0.2,
                epsilon_high=0.28, loss_type="dapo", temperature=c["temperature"], use_bias_correction_kl=True)

            def step():
                hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()
                loss, _ = loss_fn(hs, ws, c["ids"], c["mask"], c["adv"], ref_per_token_logps=c["ref"],
                                  old_per_token_logps=c["old"])
                gh, gw = torch.autograd.grad(loss, (hs, ws))
                return {"loss": {"loss": loss.detach()}, "grads": {"hidden": gh, "weight": gw}}
            return step
        raise Unavailable("Liger-Kernel has no per-token log-prob op (its chunked losses fuse the loss)")

    lp_of = head_logprobs(peer, mod)
    if case == "logprobs_fwd":
        def step():
            with torch.no_grad():
                lp, _ = lp_of(h, w, c["y"])
            return {"values": {"logprob": lp}}
        return step
    if case == "logprobs":
        def step():
            hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp, ent = lp_of(hs, ws, c["y"], entropy=True)
            tot = (lp * c["u"][0]).sum() + (ent * c["u"][1]).sum()
            gh, gw = torch.autograd.grad(tot, (hs, ws))
            return {"values": {"logprob": lp.detach(), "entropy": ent.detach()}, "grads": {"hidden": gh, "weight": gw}}
        return step
    if case == "dpo":
        def step():
            hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()
            seq = lp_of(hs, ws, c["y"])[0].sum(-1)
            loss, _, _ = dpo_loss(seq[:1], seq[1:], c["ref_logps"][:1], c["ref_logps"][1:], beta=0.1)
            gh, gw = torch.autograd.grad(loss, (hs, ws))
            return {"loss": {"loss": loss.detach()}, "values": {"seq_logps": seq.detach()},
                    "grads": {"hidden": gh, "weight": gw}}
        return step
    if case == "grpo":
        def step():
            hs, ws = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp = lp_of(hs, ws, c["y"], c["temperature"])[0]
            loss = grpo_loss(lp, c["adv"], c["mask"], c["old"], c["ref"], beta=0.04, epsilon_low=0.2,
                             epsilon_high=0.28, loss_type="dapo")
            gh, gw = torch.autograd.grad(loss, (hs, ws))
            return {"loss": {"loss": loss.detach()}, "values": {"logprob": lp.detach()},
                    "grads": {"hidden": gh, "weight": gw}}
        return step
    raise ValueError(case)


CASES = {  # name: (what, peers in the order they run; liger runs in a later pass)
    "logprobs": ("per-token log-prob + entropy, fwd+bwd", ("torch", "patchdsl", "trl")),
    "logprobs_fwd": ("per-token log-prob, forward under no_grad", ("torch", "patchdsl", "trl")),
    "dpo": ("DPO sigmoid loss, chosen/rejected pair, fwd+bwd", ("torch", "patchdsl", "trl", "liger")),
    "grpo": ("GRPO dapo + KL loss, 2 completions, fwd+bwd", ("torch", "patchdsl", "trl", "liger")),
}


# ------------------------------------------------------------------------------ the TRL recipe (item 4)
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def logits_forward(model):
    """``fused_lm_head=True`` answered from the materialised logits (TRL before its fused head)."""
    from types import MethodType

    from patchdsl.ops.loss_path import fused_output_cls

    prev = model.forward

    def forward(self, *args, fused_lm_head=False, labels=None, **kw):
        if not fused_lm_head:
            return prev(*args, labels=labels, **kw)
        kw.pop("num_items_in_batch", None)
        logits = prev(*args, **kw).logits[:, :-1].float()
        y = labels[:, 1:]
        ls = logits.log_softmax(-1)
        ok = y != IGNORE
        lp = torch.where(ok, ls.gather(-1, y.clamp(min=0)[..., None])[..., 0], 0.0)
        ent = torch.where(ok, -(ls.exp() * ls).sum(-1), 0.0)
        top1 = (logits.argmax(-1) == y) & ok
        return fused_output_cls()(loss=-lp.sum() / ok.sum().clamp(min=1), log_probs=lp, entropy=ent,
                                  mean_logits=torch.where(ok, logits.mean(-1), 0.0), is_top1=top1, label_mask=ok)

    model.forward = MethodType(forward, model)


def recipe(S: dict, dev: torch.device, tiny: bool, out_dir: Path, clock: Clock) -> dict:
    """TRL DPOTrainer.compute_loss + backward, Qwen3-0.6B architecture, trl / patchdsl / logits."""
    import copy

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from patchdsl.model import load_model
    from patchdsl.training.posttrain import patch_trainer

    dt = DTYPES[S["dtype"]]
    lm = load_model(S["model"], dtype=dt, device=str(dev), weights=False, attn_implementation="sdpa", tiny=tiny,
                    seed=0, log=None)
    policy = lm.model
    policy.config.use_cache = False
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 1e-3).to(p.device, p.dtype))
    args = DPOConfig(output_dir=str(out_dir / "dpo_tmp"), per_device_train_batch_size=1, beta=0.1, report_to=[],
                     save_strategy="no", logging_strategy="no", disable_tqdm=True, max_length=None, bf16=False,
                     use_cpu=dev.type != "cuda", seed=0)
    rows = [{"prompt": "w1 w2", "chosen": " w3", "rejected": " w4 w5"}] * 2
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=word_tokenizer())
    V, T, P = policy.config.vocab_size, S["seq"], S["prompt"]
    gi = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (2, T), generator=gi)
    cm = torch.zeros(2, T, dtype=torch.long)
    cm[:, P:] = 1
    cm[1, T - T // 8:] = 0                                        # the rejected answer is shorter ...
    am = torch.ones(2, T, dtype=torch.long)
    am[1, T - T // 8:] = 0                                        # ... and right-padded
    inputs = {"input_ids": ids.to(dev), "attention_mask": am.to(dev), "completion_mask": cm.to(dev)}
    model = trainer.model
    model.train()

    def step():
        for p in model.parameters():
            p.grad = None
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        return {"loss": {"loss": loss.detach()},
                "grads": {"lm_head": model.lm_head.weight.grad, "final_norm": model.model.norm.weight.grad,
                          "layer0_q_proj": model.model.layers[0].self_attn.q_proj.weight.grad}}

    res: dict[str, Any] = {"model": S["model"] + (" (tiny)" if tiny else ""), "source": lm.source,
                           "batch": "2 x %d (chosen, rejected), prompt %d" % (T, P), "dtype": S["dtype"],
                           "variants": {}, "checks": {}}
    outs = {}
    spec = f"dtype {S['dtype']}\nlm_head: Linear -> fused_linear_logprobs\n"
    for variant in ("trl", "patchdsl", "logits"):
        if clock.left() < 3:
            res["variants"][variant] = {"skipped": f"time budget ({clock.budget:.0f} s) used up"}
            continue
        handles = []
        saved = {m: m.__dict__.get("forward") for m in (model, trainer.ref_model)}
        try:
            if variant == "patchdsl":
                handles = patch_trainer(trainer, spec, strict=True)
            elif variant == "logits":
                for m in (model, trainer.ref_model):
                    logits_forward(m)
            out, rec = measure(step, dev, target_s=0.5, max_reps=5)
            outs[variant] = {k: {n: (t.detach().clone() if t is not None else None) for n, t in v.items()}
                             for k, v in out.items()}
            rec["loss"] = float(out["loss"]["loss"])
            res["variants"][variant] = rec
        except Exception as e:                                    # noqa: BLE001 - reported, the run goes on
            res["variants"][variant] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            for h in reversed(handles):
                h.undo()
            for m, f in saved.items():
                if f is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.__dict__["forward"] = f
            for p in model.parameters():
                p.grad = None
    if "trl" in outs:
        for variant in ("patchdsl", "logits"):
            if variant in outs:
                res["checks"][variant] = compare(outs[variant], outs["trl"], {"loss": RECIPE_TOL["loss"],
                                                                              "grads": RECIPE_TOL["grads"]})
    return res


# ------------------------------------------------------------------------------ driver
def run(S: dict, dev: torch.device, clock: Clock, liger_compiled: str, tiny: bool, out_dir: Path,
        recipe_reserve: float, log: Callable[[str], None], save: Callable[[dict], None] = lambda doc: None) -> dict:
    doc: dict[str, Any] = {"sizes": S, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "versions": versions(), "tolerances": {"ops": TOL, "recipe": RECIPE_TOL},
                           "cases": {}, "recipe": None}
    mod = patchdsl_kernels(S["vocab"], S["hidden"], S["dtype"], dev)
    refs: dict[str, dict] = {}
    inputs: dict[str, dict] = {}

    def one(case: str, peer: str, compiled: bool = False) -> None:
        entry = doc["cases"].setdefault(case, {"what": CASES[case][0], "peers": {}})
        if peer != "torch" and case not in refs:
            entry["peers"][peer] = {"skipped": "no torch reference for this case"}
            return
        if clock.left() < 3:
            entry["peers"][peer] = {"skipped": f"time budget ({clock.budget:.0f} s) used up"}
            return
        c = inputs.get(case)
        if c is None:
            c = inputs[case] = make_case(case, S, dev)
        try:
            out, rec = measure(step_fn(case, peer, c, mod, compiled), dev)
        except Unavailable as e:
            entry["peers"][peer] = {"unavailable": str(e)}
            return
        except Exception as e:                                    # noqa: BLE001 - reported, the run goes on
            entry["peers"][peer] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(f"{case}/{peer}: {type(e).__name__}: {e}")
            return
        if peer == "liger":
            rec["compiled"] = compiled
        if peer == "torch":
            refs[case] = out
        else:
            rec["checks"] = compare(out, refs[case], TOL)
        entry["peers"][peer] = rec
        log(f"{case}/{peer}: {rec.get('ms')} ms, peak +{rec.get('peak_extra_mib')} MiB")
        del out

    def done_with(case: str) -> None:
        refs.pop(case, None)
        inputs.pop(case, None)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for case, (_, peers) in CASES.items():          # pass 1: everything but Liger
        for peer in peers:
            if peer != "liger":
                one(case, peer)
        if "liger" not in peers:
            done_with(case)
        save(doc)
    for case, (_, peers) in CASES.items():          # pass 2: Liger (its torch.compile warm-up is the unknown)
        if "liger" in peers:
            if liger_compiled == "auto":
                compiled = dev.type == "cuda" and clock.left() - recipe_reserve > 30
            else:
                compiled = liger_compiled == "1"
            one(case, "liger", compiled)
            done_with(case)
            save(doc)
    if clock.left() > 8:
        try:
            doc["recipe"] = recipe(S, dev, tiny, out_dir, clock)
        except ImportError as e:                                  # trl / datasets not installed here
            doc["recipe"] = {"unavailable": f"{type(e).__name__}: {e}"}
        except Exception as e:                                    # noqa: BLE001
            doc["recipe"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    else:
        doc["recipe"] = {"skipped": f"time budget ({clock.budget:.0f} s) used up"}
    doc["elapsed_s"] = round(time.perf_counter() - clock.t0, 1)
    return doc


def versions() -> dict:
    import importlib

    v = {}
    for m in ("torch", "triton", "transformers", "trl", "liger_kernel", "patchdsl"):
        try:
            v[m] = getattr(importlib.import_module(m), "__version__", "?")
        except Exception:                                         # noqa: BLE001
            v[m] = None
    return v


def failures(doc: dict) -> list[str]:
    """Every failed cross-check and every peer that errored (unavailable/skipped peers are not failures)."""
    bad = []
    for case, e in doc["cases"].items():
        for peer, r in e["peers"].items():
            if "error" in r:
                bad.append(f"{case}/{peer}: {r['error']}")
            for c in r.get("checks", []):
                if not c["ok"]:
                    bad.append(f"{case}/{peer} {c['what']}: rel err {c['rel_err']:.3g} > {c['tol']:g}")
    rc = doc.get("recipe") or {}
    if "error" in rc:
        bad.append(f"recipe: {rc['error']}")
    for variant, r in (rc.get("variants") or {}).items():
        if "error" in r:
            bad.append(f"recipe/{variant}: {r['error']}")
    for variant, checks in (rc.get("checks") or {}).items():
        for c in checks:
            if not c["ok"]:
                bad.append(f"recipe/{variant} vs trl {c['what']}: rel err {c['rel_err']:.3g} > {c['tol']:g}")
    return bad


def skipped(doc: dict) -> list[str]:
    """What the time budget left out (or could not run for want of a reference)."""
    out = [f"{case}/{peer}" for case, e in doc["cases"].items() for peer, r in e["peers"].items() if "skipped" in r]
    rc = doc.get("recipe") or {}
    if "skipped" in rc:
        out.append("recipe")
    out += [f"recipe/{v}" for v, r in (rc.get("variants") or {}).items() if "skipped" in r]
    return out


def _fmt(x, f="{:.3f}") -> str:
    return "-" if x is None else f.format(x)


def table(doc: dict) -> str:
    S = doc["sizes"]
    lines = [f"post-training ops, {doc['device']}: seq {S['seq']} (prompt {S['prompt']}), hidden {S['hidden']}, "
             f"vocab {S['vocab']}, {S['dtype']}; time = median ms of one call, peak = extra MiB during one call"
             + ("  [CPU: interpreter kernels, the times mean nothing]" if doc["device"] == "cpu" else ""),
             f"{'case':<13} {'peer':<9} {'ms':>9} {'x patchdsl':>10} {'peak MiB':>10} {'warm-up s':>9}  agreement with torch"]
    for case, e in doc["cases"].items():
        mine = e["peers"].get("patchdsl", {}).get("ms")
        for peer, r in e["peers"].items():
            if "ms" not in r:
                why = r.get("unavailable") or r.get("skipped") or r.get("error", "")
                lines.append(f"{case:<13} {peer:<9} {'':>9} {'':>10} {'':>10} {'':>9}  {why[:90]}")
                continue
            ratio = r["ms"] / mine if mine else None
            checks = r.get("checks")
            agree = "(reference)" if peer == "torch" else (
                ("ok" if all(c["ok"] for c in checks) else "DISAGREES") + ", max rel err "
                + _fmt(max((c["rel_err"] for c in checks), default=0.0), "{:.2g}"))
            if peer == "liger":
                agree += "" if r.get("compiled") else " (eager: compiled=False)"
            lines.append(f"{case:<13} {peer:<9} {r['ms']:>9.3f} {_fmt(ratio, '{:.2f}x'):>10} "
                         f"{_fmt(r.get('peak_extra_mib'), '{:.0f}'):>10} {r['warmup_s']:>9.1f}  {agree}")
    rc = doc.get("recipe") or {}
    if rc.get("variants"):
        lines.append(f"recipe: TRL DPOTrainer.compute_loss + backward, {rc['model']}, {rc['batch']}, {rc['dtype']}")
        base = rc["variants"].get("trl", {})
        for variant, r in rc["variants"].items():
            if "ms" not in r:
                lines.append(f"  {variant:<9} {(r.get('error') or r.get('skipped', ''))[:100]}")
                continue
            saved = (base.get("peak_extra_mib") - r["peak_extra_mib"]) if (
                base.get("peak_extra_mib") is not None and r.get("peak_extra_mib") is not None) else None
            checks = rc.get("checks", {}).get(variant)
            agree = "(reference)" if variant == "trl" else (
                "-" if not checks else ("ok" if all(c["ok"] for c in checks) else "DISAGREES")
                + ", max rel err " + _fmt(max(c["rel_err"] for c in checks), "{:.2g}"))
            lines.append(f"  {variant:<9} {r['ms']:>9.1f} ms  peak +{_fmt(r.get('peak_extra_mib'), '{:.0f}')} MiB"
                         f"  (vs trl: {_fmt(saved, '{:+.0f}')} MiB saved)  loss {r['loss']:.5f}  {agree}")
    elif rc:
        lines.append(f"recipe: {rc.get('skipped') or rc.get('unavailable') or rc.get('error', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for posttrain.json/.txt (default: $PART_OUT, else .)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run; the times mean nothing)")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run, imports included (default 58; --tiny: none)")
    ap.add_argument("--liger-compiled", choices=("auto", "0", "1"), default="auto",
                    help="Liger's torch.compile: auto = on when the budget leaves 30 s for its warm-up (CUDA only)")
    ap.add_argument("--recipe-reserve", type=float, default=15.0, help="seconds kept for the recipe (default 15)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    S = dict(TINY if a.tiny else FULL)
    out_dir = Path(a.out or os.environ.get("PART_OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock(a.budget if a.budget is not None else (math.inf if a.tiny else 58.0), T_START)
    log = lambda m: print(m, flush=True)  # noqa: E731

    def save(doc: dict) -> None:          # after every case: a run cut by its time limit keeps what finished
        doc["verdict"] = "INCOMPLETE"
        (out_dir / "posttrain.json").write_text(json.dumps(doc, indent=1, default=str))

    doc = run(S, dev, clock, a.liger_compiled, a.tiny, out_dir, a.recipe_reserve, log, save)
    bad = failures(doc)
    left_out = skipped(doc)
    doc["verdict"] = "FAIL" if bad else ("PASS" if not left_out else f"PASS, partial ({len(left_out)} skipped)")
    doc["skipped"] = left_out
    doc["failures"] = bad
    (out_dir / "posttrain.json").write_text(json.dumps(doc, indent=1, default=str))
    text = table(doc)
    (out_dir / "posttrain.txt").write_text(text + "\n")
    print(text)
    print(f"posttrain verdict: {doc['verdict']} ({doc['elapsed_s']} s)" + "".join(f"\n  {b}" for b in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
