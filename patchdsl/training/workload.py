"""The synthetic training workload of ``patchdsl apply``: the same batches and the same
initial weights, run unpatched then patched, with loss per step, tokens/s and peak memory."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RunResult:
    label: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    peak_mem_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "losses": self.losses, "tokens_per_s": self.tokens_per_s,
                "step_ms": self.step_ms, "peak_mem_bytes": self.peak_mem_bytes}


@dataclass(frozen=True)
class Workload:
    steps: int
    batch: int
    seq: int
    lr: float = 1e-4
    seed: int = 0
    warmup: int = 1

    @staticmethod
    def default(device: str) -> "Workload":
        if device.startswith("cuda"):
            return Workload(steps=20, batch=16, seq=2048, warmup=3)
        return Workload(steps=3, batch=1, seq=16, warmup=1)


def make_batches(vocab: int, w: Workload, device: Any) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(w.seed)
    out = []
    for _ in range(w.steps + w.warmup):
        ids = torch.randint(0, vocab, (w.batch, w.seq), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def train(model: Any, batches: list[dict[str, Any]], w: Workload, label: str,
          progress: Callable[[int], None] | None = None) -> RunResult:
    """Run warm-up + ``w.steps`` AdamW steps; time only the measured steps."""
    import torch

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, fused=cuda or None)
    res = RunResult(label)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = None
    for i, batch in enumerate(batches):
        if i == w.warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= w.warmup:
            res.losses.append(out.loss.detach())
        if progress:
            progress(1)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    res.losses = [float(l) for l in res.losses]
    n = max(1, len(batches) - w.warmup)
    res.step_ms = 1000 * elapsed / n
    res.tokens_per_s = n * w.batch * w.seq / elapsed if elapsed > 0 else 0.0
    if cuda:
        res.peak_mem_bytes = int(torch.cuda.max_memory_allocated())
    del opt
    return res


def compare_runs(model: Any, plan: Any, w: Workload, progress_factory: Callable | None = None,
                 apply_fn: Callable | None = None) -> tuple[RunResult, RunResult, Any]:
    """Train a copy of ``model`` unpatched, then a copy patched with ``plan``, same weights and batches."""
    import torch

    from ..runtime import apply

    apply_fn = apply_fn or apply
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    batches = make_batches(vocab, w, dev)
    base_state = copy.deepcopy(model.state_dict())
    total = len(batches)
    bar = progress_factory("unpatched", total) if progress_factory else None
    ref = train(model, batches, w, "unpatched", bar)
    model.load_state_dict(base_state)
    del base_state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    handle = apply_fn(plan, model)
    bar = progress_factory("patched", total) if progress_factory else None
    pat = train(model, batches, w, "patched", bar)
    return ref, pat, handle
