"""The synthetic training workload of ``patchdsl apply``: the same batches and the same
initial weights, run unpatched then patched, with loss per step, tokens/s and peak memory, and
apply's verdict on them (:func:`side_by_side`: verify's check on the model in hand decides, the two
runs disagreeing on a loss's finiteness fails it, a required site refused is bad input)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RunResult:
    label: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    peak_mem_bytes: int | None = None

    def to_json(self, speed: bool = True) -> dict[str, Any]:
        """The run as JSON; without ``speed`` (the CPU: interpreter times) no tokens/s, step time, memory."""
        d = {"label": self.label, "losses": self.losses, "tokens_per_s": self.tokens_per_s,
             "step_ms": self.step_ms, "peak_mem_bytes": self.peak_mem_bytes}
        if not speed:
            for k in ("tokens_per_s", "step_ms", "peak_mem_bytes"):
                d.pop(k, None)
        return d


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
                 apply_fn: Callable | None = None, stage: Callable[[str], Any] | None = None
                 ) -> tuple[RunResult, RunResult, Any]:
    """Train a copy of ``model`` unpatched, then a copy patched with ``plan``, same weights and batches
    (``stage``: told when each run starts)."""
    import torch

    from ..runtime import apply

    apply_fn = apply_fn or apply
    stage = stage or (lambda _m: None)
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    batches = make_batches(vocab, w, dev)
    base_state = copy.deepcopy(model.state_dict())
    total = len(batches)
    bar = progress_factory("unpatched", total) if progress_factory else None
    stage(f"training unpatched ({total} step(s))")
    ref = train(model, batches, w, "unpatched", bar)
    model.load_state_dict(base_state)
    del base_state
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    handle = apply_fn(plan, model)
    bar = progress_factory("patched", total) if progress_factory else None
    stage(f"training patched ({total} step(s))")
    pat = train(model, batches, w, "patched", bar)
    return ref, pat, handle


def measured_steps(before: int, after: int, warmup: int) -> int:
    """How many of the steps ``before+1 .. after`` (counted from 1) are measured, the first
    ``warmup`` steps being warm-up: what apply's progress bar advances by."""
    return max(0, after - warmup) - max(0, before - warmup)


def parity_verdict(plan: Any, model: Any, dtype: str, w: Workload, seed: int, device: str) -> dict:
    """apply's verdict: verify's check (forward values and gradients of every patched site against a
    float64 reference, verify's tolerances) on the model in hand before training, at batch
    min(batch, 2) x min(seq, 16).  The loss columns apply prints are for reading; this decides."""
    from ..parity import verify as run_verify

    b, q = min(w.batch, 2), min(w.seq, 16)
    where = f"patchdsl verify's check on this model (batch {b} x {q}, {dtype})"
    try:
        report = run_verify(plan, model, dtype=dtype, batch=b, seq=q, seed=seed, device=device)
    except Exception as e:          # a verdict that cannot be had is no pass
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        return {"passed": False, "verdict": f"{where} could not run ({type(e).__name__}: {msg}); "
                                           f"run `patchdsl verify` for the details", "checks": []}
    return {"passed": bool(report.passed), "verdict": f"{where}: {report.verdict}",
            "failed_sites": report.failed_sites()}


@dataclass
class SideBySide:
    """What :func:`side_by_side` found: both runs, the patch (still applied: ``handle.undo()``), the sites
    patched per leaf name (a site refused at apply counts as present, not patched) and the verdict."""

    workload: Workload
    unpatched: RunResult
    patched: RunResult
    handle: Any
    totals: tuple[tuple[str, int, int], ...]
    fused: int                      # modules fused into the patched sites
    parity: dict                    # {"passed", "verdict", ...}: verify's check, and the runs' finiteness
    trained: bool = True            # False: the verdict failed first, so neither run trained

    @property
    def passed(self) -> bool:
        return bool(self.parity["passed"])

    @property
    def refused_required(self) -> bool:
        return bool(self.handle.refused_required)

    def to_json(self, speed: bool) -> dict[str, Any]:
        w = self.workload
        return {"workload": {"steps": w.steps, "warmup": w.warmup, "batch": w.batch, "seq": w.seq, "lr": w.lr,
                             "seed": w.seed},
                "speed_measured": speed,      # on the CPU tokens/s and step times are interpreter times: left out
                "unpatched": self.unpatched.to_json(speed), "patched": self.patched.to_json(speed),
                "patched_sites": len(self.handle.patched), "fused_modules": self.fused,
                "refused": [str(r) for r in self.handle.refused],
                "totals": [{"name": n, "patched": a, "present": b} for n, a, b in self.totals],
                "parity": self.parity, "trained": self.trained}


def side_by_side(model: Any, plan: Any, w: Workload, *, dtype: str, device: str, seed: int,
                 progress_factory: Callable | None = None, stage: Callable[[str], Any] | None = None) -> SideBySide:
    """``patchdsl apply`` as a function: verify's check on ``model`` (:func:`parity_verdict`), then the
    unpatched and the patched run of :func:`compare_runs`, and the verdict (the runs disagreeing on
    whether a step's loss is finite fails it)."""
    from ..planning.site import count_totals

    if stage is not None:
        stage("the verdict: verify's check of every patched site on this model against float64")
    parity = parity_verdict(plan, model, dtype, w, seed, device)
    if not parity["passed"]:
        # the verdict comes first and decides: a spec that fails it (one for another family, a wrong flag)
        # is reported now, without training the two runs whose losses would not change it
        from ..runtime import PatchHandle

        if stage is not None:
            stage("the verdict failed: neither run is trained")
        handle = PatchHandle(plan, active=False)
        fused = sum(len(s.covers) for s in plan.sites if not s.refused)
        return SideBySide(w, RunResult("unpatched"), RunResult("patched"), handle, tuple(plan.totals), fused,
                          parity, trained=False)
    ref, pat, handle = compare_runs(model, plan, w, progress_factory, stage=stage)
    live = [s if s.path in handle.patched else replace(s, refused=s.refused or "refused at apply") for s in plan.sites]
    totals = count_totals(live, {n: pr for n, _, pr in plan.totals})
    fused = sum(len(s.covers) for s in live if not s.refused)
    mismatch = [i + 1 for i, (a, b) in enumerate(zip(ref.losses, pat.losses)) if math.isfinite(a) != math.isfinite(b)]
    if mismatch:
        parity["passed"] = False
        parity["verdict"] += (f"; the two runs disagree on finiteness at step(s) {', '.join(map(str, mismatch[:10]))} "
                              f"(one loss finite, the other not)")
    return SideBySide(w, ref, pat, handle, totals, fused, parity)


def memory_need(model: Any, dtype: str, w: Workload, device: Any) -> tuple[int, str]:
    """(bytes, how) ``patchdsl apply`` is estimated to take at its peak with ``model`` (a meta-device
    model will do: nothing is allocated), rough and on the safe side: the larger of the verdict (verify's
    check on the model in hand: the model and its float64 reference, parity.stream.estimate) and the
    training (the model, the state it restarts from, gradients, AdamW's two states, the activations)."""
    from ..parity.stream import estimate
    from ..util.vocab import DTYPE_BYTES

    b = DTYPE_BYTES[dtype]
    est = estimate(model, b, min(w.batch, 2), min(w.seq, 16), device, base_on_device=True)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = int(getattr(cfg, "hidden_size", 0) or 1024)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden) if not isinstance(
        getattr(cfg, "intermediate_size", 0), list) else 4 * hidden
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 1)
    vocab = int(getattr(cfg, "vocab_size", 0) or 32000)
    tokens = w.batch * w.seq
    training = 5 * b * est.params + b * tokens * ((24 * hidden + 6 * inter) * layers + 4 * vocab)
    verdict = b * est.params + est.whole_bytes
    return max(training, verdict), ("the two training runs" if training >= verdict
                                    else "the parity verdict's float64 reference")
