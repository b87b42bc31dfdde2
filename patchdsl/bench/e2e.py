"""End-to-end training throughput: Qwen3-0.6B (random weights), bf16, fused AdamW, sdpa attention.

Variants, each on a fresh model instance with the same initial weights and the same batches:

* ``hf``: the model as transformers builds it;
* ``patchdsl``: ``patchdsl.apply(plan, model)`` with ``specs/qwen3.kpatch`` (rules whose op is not in
  the registry yet are dropped and listed in the result);
* ``compile``: ``torch.compile(model)`` of the unpatched model (optional: minutes of compilation);
* ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_qwen3(model=...)``.  Liger also
  rebinds names in transformers' modeling module for the whole process, so it always runs LAST.

Per variant: tokens/s over the measured steps (synchronised wall clock), step time, peak memory
(``torch.cuda.max_memory_allocated``: weights, gradients, optimizer state and activations), the
loss of every step (warm-up included: the first loss, from identical weights, must agree), the
wall time of the warm-up steps (compilation shows there).  When a batch does not fit, the
variant retries with half the micro-batch and gradient accumulation, and says so.
"""

from __future__ import annotations

import gc
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import timing

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, hidden_act="silu",
                 attention_bias=False, use_cache=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)


@dataclass
class E2EOptions:
    device: str = "cuda"
    model: str = "Qwen/Qwen3-0.6B"
    spec: str = "specs/qwen3.kpatch"
    dtype: str = "bf16"
    batch: int = 16
    seq: int = 2048
    micro_batch: int | None = None
    steps: int = 5
    warmup: int = 2
    lr: float = 1e-4
    seed: int = 0
    variants: tuple[str, ...] = ("hf", "patchdsl", "liger")
    tiny: bool = False
    attn: str = "sdpa"
    budget_s: float = 1e9
    json_path: str | None = None
    quiet: bool = False


def _log(o: E2EOptions, t0: float, msg: str) -> None:
    if not o.quiet:
        print(f"[e2e {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build_model(o: E2EOptions):
    """(model, where it came from).  patchdsl.models.load_model when present, else the hyperparameters above."""
    import torch

    try:
        from ..models import load_model

        lm = load_model(o.model, dtype=_torch_dtype(o.dtype), device=o.device, weights=False,
                        attn_implementation=o.attn, tiny=o.tiny, seed=o.seed, log=None)
        model, source = lm.model, lm.source
    except Exception as e:  # patchdsl.models missing or failing: the architecture from the constants
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = dict(QWEN3_06B)
        if o.tiny:
            kw.update(TINY)
        cfg = AutoConfig.for_model("qwen3", **kw)
        torch.manual_seed(o.seed)
        dev = torch.device(o.device)
        if dev.type == "cuda":
            torch.cuda.manual_seed_all(o.seed)
        with dev:
            model = AutoModelForCausalLM.from_config(cfg, dtype=_torch_dtype(o.dtype), attn_implementation=o.attn)
        source = f"qwen3 from built-in hyperparameters ({type(e).__name__} from patchdsl.models: {e})"
    model.config.use_cache = False
    return model, source


def filtered_spec(spec: str) -> tuple[str, list[str], str]:
    """The spec text with rules whose op is not registered yet removed; (text, dropped rules, path)."""
    from ..ops.registry import get_op

    p = Path(spec)
    if not p.is_file():
        from ..resources import specs_dir

        cand = specs_dir() / (p.name if p.suffix == ".kpatch" else p.name + ".kpatch")
        if cand.is_file():
            p = cand
    text = p.read_text()
    keep, dropped = [], []
    for line in text.splitlines():
        m = re.search(r"->\s*([A-Za-z_]\w*)", line.split("#", 1)[0])
        if m and get_op(m.group(1)) is None:
            dropped.append(line.strip())
            keep.append("# (not registered yet) " + line)
        else:
            keep.append(line)
    return "\n".join(keep) + "\n", dropped, str(p)


def make_batches(vocab: int, o: E2EOptions, device: Any) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(o.seed + 1)
    out = []
    for _ in range(o.warmup + o.steps):
        ids = torch.randint(0, vocab, (o.batch, o.seq), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def train(model, batches: list[dict], o: E2EOptions, micro: int) -> dict[str, Any]:
    import torch

    cuda = timing.is_cuda(o.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, fused=True if cuda else None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses: list[Any] = []
    warm_s: list[float] = []
    t0 = time.perf_counter()
    t_meas = None
    for i, batch in enumerate(batches):
        if i == o.warmup:
            timing.sync(o.device)
            t_meas = time.perf_counter()
        ts = time.perf_counter()
        total = None
        for j in range(0, o.batch, micro):
            ids = batch["input_ids"][j:j + micro]
            out = model(input_ids=ids, labels=batch["labels"][j:j + micro])
            loss = out.loss * (ids.shape[0] / o.batch)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            del out, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if i < o.warmup:
            timing.sync(o.device)
            warm_s.append(time.perf_counter() - ts)
    timing.sync(o.device)
    end = time.perf_counter()
    elapsed = end - (t_meas if t_meas is not None else t0)
    n = len(batches) - o.warmup
    res = {"losses": [float(x) for x in losses], "warmup_step_s": warm_s,
           "step_ms": 1000 * elapsed / max(1, n), "tokens_per_s": n * o.batch * o.seq / elapsed if elapsed > 0 else 0.0,
           "micro_batch": micro, "grad_accum": -(-o.batch // micro), "measured_steps": n}
    if cuda:
        res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    del opt
    return res


def _prepare(variant: str, model, o: E2EOptions) -> tuple[Any, dict]:
    """Patch / wrap ``model`` for ``variant``; returns (model to train, facts)."""
    info: dict[str, Any] = {}
    if variant == "hf":
        return model, info
    if variant == "patchdsl":
        import patchdsl

        text, dropped, path = filtered_spec(o.spec)
        plan = patchdsl.plan(text, model, dtypes=(o.dtype,))
        handle = patchdsl.apply(plan, model)
        info.update({"spec": path, "dropped_rules": dropped, "patched_sites": len(handle.patched),
                     "refused": [str(r) for r in handle.refused],
                     "totals": [{"name": n, "patched": a, "present": b} for n, a, b in plan.totals]})
        return model, info
    if variant == "compile":
        import torch

        return torch.compile(model), info
    if variant == "liger":
        try:
            import liger_kernel.transformers as lt
        except Exception as e:
            raise ImportError(f"liger_kernel not importable: {e}") from None
        mt = getattr(model.config, "model_type", "")
        fn = getattr(lt, f"apply_liger_kernel_to_{mt}", None)
        if fn is not None:
            fn(model=model)
            info["liger_fn"] = fn.__name__
        else:
            lt._apply_liger_kernel_to_instance(model=model)
            info["liger_fn"] = "_apply_liger_kernel_to_instance"
        return model, info
    raise ValueError(f"unknown variant {variant!r}")


def _free(device: str) -> None:
    gc.collect()
    if timing.is_cuda(device):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_e2e(o: E2EOptions) -> dict[str, Any]:
    import torch

    from ..codegen import ensure_triton
    from .runner import _finite, environment, write_json

    ensure_triton()
    t0 = time.perf_counter()
    variants = [v for v in o.variants if v != "liger"] + [v for v in o.variants if v == "liger"]
    doc: dict[str, Any] = {"kind": "patchdsl-bench-e2e", "env": environment(o.device),
                           "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(o).items()},
                           "variants": [], "complete": False}
    try:
        base, source = build_model(o)
    except Exception as e:
        doc["error"] = f"could not build the model: {type(e).__name__}: {e}"
        doc["traceback"] = traceback.format_exc(limit=6)
        write_json(o.json_path, _finite(doc))
        return _finite(doc)
    cfg = base.config
    doc["model_source"] = source
    doc["model"] = {"type": cfg.model_type, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                    "vocab": cfg.vocab_size, "params": int(sum(p.numel() for p in base.parameters())),
                    "tokens_per_step": o.batch * o.seq}
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
    del base
    _free(o.device)
    batches = make_batches(cfg.vocab_size, o, o.device)
    _log(o, t0, f"{source}; {doc['model']['params'] / 1e6:.0f}M parameters; batch {o.batch} x {o.seq}")
    for variant in variants:
        rec: dict[str, Any] = {"variant": variant, "status": "ok"}
        if time.perf_counter() - t0 > o.budget_s:
            rec.update(status="skipped", error=f"time budget ({o.budget_s:.0f} s) spent")
            doc["variants"].append(rec)
            write_json(o.json_path, _finite(doc))
            continue
        micro = o.micro_batch or o.batch
        tv = time.perf_counter()
        while True:
            model = None
            oom = None
            try:
                model, _ = build_model(o)
                model.load_state_dict(snapshot)
                model, info = _prepare(variant, model, o)
                rec.update(info)
                rec.update(train(model, batches, o, micro))
            except torch.cuda.OutOfMemoryError as e:
                oom = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
            except Exception as e:
                rec.update(status="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500],
                           traceback=traceback.format_exc(limit=8)[-3000:])
            if oom is None:
                break
            model = None          # the exception (and the activations its frames held) is gone here
            _free(o.device)
            if micro <= 1:
                rec.update(status="error", error=f"out of memory even at micro-batch 1: {oom}")
                break
            micro = max(1, micro // 2)
            rec.setdefault("oom_retries", []).append(oom[:200])
            _log(o, t0, f"{variant}: out of memory; retrying with micro-batch {micro}")
        model = None
        _free(o.device)
        rec["variant_s"] = time.perf_counter() - tv
        doc["variants"].append(rec)
        doc["elapsed_s"] = time.perf_counter() - t0
        doc["loss_agreement"] = _agreement(doc["variants"])
        write_json(o.json_path, _finite(doc))
        _log(o, t0, _line(rec))
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t0
    write_json(o.json_path, _finite(doc))
    return _finite(doc)


def _agreement(variants: list[dict]) -> dict[str, Any]:
    ref = next((v for v in variants if v["variant"] == "hf" and v.get("losses")), None)
    out = {}
    if not ref:
        return out
    for v in variants:
        if v is ref or not v.get("losses"):
            continue
        d = [abs(a - b) for a, b in zip(v["losses"], ref["losses"])]
        out[v["variant"]] = {"first_step_abs_diff": d[0] if d else None, "max_abs_diff": max(d) if d else None}
    return out


def _line(rec: dict) -> str:
    if rec["status"] != "ok":
        return f"{rec['variant']}: {rec['status']}: {rec.get('error', '')}"
    peak = rec.get("peak_bytes")
    mem = f", peak {peak / 2**30:.2f} GiB" if peak else ""
    return (f"{rec['variant']}: {rec['tokens_per_s']:,.0f} tokens/s, {rec['step_ms']:.1f} ms/step{mem}, "
            f"micro-batch {rec['micro_batch']}, losses {', '.join(f'{x:.4f}' for x in rec['losses'][:3])}")
