"""``verify(spec, model_or_factory)``: gradient parity of a patched model against float64.

Three copies of the same weights are built: the unpatched model in float64 (the reference),
the unpatched model in the run dtype ("HF") and the patched model in the run dtype.  They see
the same synthetic batch (seeded random token ids, labels = input ids, an all-ones attention
mask), in train mode with every dropout set to 0, so training-only paths (the fused
linear-cross-entropy loss) run.  Compared, each judged by :mod:`patchdsl.parity.compare`:

* per patched site, re-run alone on the float64 run's inputs (see :mod:`.hooks`): the output
  (the loss for sites hosted by the causal LM), the gradient w.r.t. its input and the
  gradient of each of its parameters, for a seeded random upstream gradient;
* end to end: the loss, the logits when the patched model returns them, every parameter's
  gradient (all judged; the worst few and every failure are reported);
* with ``steps=N``: N AdamW steps on each copy (float64 too), comparing each step's loss.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from .compare import Errors, Tolerance, errors, judge, tolerance_for
from .hooks import Capture, cast_to, run_site
from .reference import float64_mode
from .report import Check, ParityReport

TORCH_DTYPES = ("fp32", "bf16", "fp16")


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]


def _prepare(model: Any, dtype: Any, device: Any) -> Any:
    """Cast, move, train mode, dropout off (training-only code paths run, deterministically)."""
    import torch

    model.to(device=device, dtype=dtype)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout", "hidden_dropout", "resid_dropout", "residual_dropout"):
            v = m.__dict__.get(attr)
            if isinstance(v, float) and not isinstance(v, bool):
                setattr(m, attr, 0.0)
    for p in model.parameters():
        p.grad = None
    return model


def _vocab(model: Any) -> int:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = model.get_input_embeddings()
    return int(emb.num_embeddings)


def _batch(gen: Any, vocab: int, batch: int, seq: int, device: Any) -> dict[str, Any]:
    import torch

    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "labels": ids.clone().to(device), "use_cache": False}


def _ctx(model: Any):
    """The float64 mode for the reference model (see .reference), nothing for the others."""
    import contextlib

    import torch

    p = next(model.parameters(), None)
    return float64_mode() if p is not None and p.dtype == torch.float64 else contextlib.nullcontext()


def _forward_backward(model: Any, batch: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(loss, logits or None, {param name: grad})."""
    for p in model.parameters():
        p.grad = None
    with _ctx(model):
        out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None:
        raise RuntimeError(f"{type(model).__name__} returned no loss for a batch with labels")
    loss.backward()
    logits = getattr(out, "logits", None)
    grads = {n: (p.grad.detach() if p.grad is not None else None) for n, p in model.named_parameters()}
    return loss.detach(), (logits.detach() if logits is not None else None), grads


def _check(kind: str, path: str, op: str, quantity: str, patched: Any, hf: Any, ref: Any, tol: Tolerance,
           note: str = "") -> Check:
    if ref is None and patched is None and hf is None:
        raise ValueError("nothing to compare")
    if ref is None or patched is None:
        missing = "the patched model" if patched is None else "the float64 reference"
        inf = float("inf")
        return Check(kind, path, op, quantity, inf, inf, inf, float("nan"), float("nan"), False,
                     (note + "; " if note else "") + f"no value from {missing}")
    ep = errors(patched, ref)
    eh = errors(hf, ref) if hf is not None else Errors.nonfinite()
    if not bool(_finite(ref)):
        return Check(kind, path, op, quantity, ep.max_abs, ep.max_rel, ep.rel_fro, eh.rel_fro, float("nan"), False,
                     (note + "; " if note else "") + "the float64 reference is not finite")
    ok, ref_err, bound = judge(ep, eh, tol)
    if not ep.finite:
        note = (note + "; " if note else "") + "NaN/inf in the patched value"
    return Check(kind, path, op, quantity, ep.max_abs, ep.max_rel, ep.rel_fro, ref_err, bound, ok, note)


def _finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def _models(model_or_factory: Any) -> tuple[Any, Any, Any]:
    """Three independent copies with identical weights (a factory is called once, then copied)."""
    import torch

    if isinstance(model_or_factory, torch.nn.Module):
        base = model_or_factory
        patched = copy.deepcopy(base)
    elif callable(model_or_factory):
        base = model_or_factory()
        if not isinstance(base, torch.nn.Module):
            raise TypeError(f"the model factory returned {type(base).__name__}, not a torch.nn.Module")
        patched = base
    else:
        raise TypeError("verify() needs an nn.Module or a zero-argument function returning one")
    from ..runtime.patch import SITE_ATTR

    if any(SITE_ATTR in m.__dict__ for m in base.modules()):
        raise ValueError("the model is already patched; pass the unpatched model (undo its handle first)")
    ref = copy.deepcopy(base)
    hf = copy.deepcopy(base)
    return ref, hf, patched


def verify(spec: Any, model_or_factory: Any, *, dtype: str = "fp32", batch: int = 2, seq: int = 16,
           steps: int = 0, seed: int = 0, device: Any = None, target: str | None = None, lr: float = 1e-3,
           factor: float | None = None, floor: float | None = None, worst: int = 5,
           log: Callable[[str], None] | None = None) -> ParityReport:
    """Check that ``spec`` applied to the model keeps forward values and gradients as accurate
    (against float64) as the unpatched model in ``dtype``.  Returns a :class:`ParityReport`;
    ``report.passed`` is the verdict.

    ``spec``: a Spec, a spec path / shipped name / text, or a PatchPlan.  ``model_or_factory``:
    an ``nn.Module`` (left untouched: it is deep-copied) or a zero-argument function returning
    one (called once; its model is consumed).  ``device``: "cpu", "cuda", ... (default: cuda
    when available).  ``target``: the kernel target (default: detected).  ``factor`` / ``floor``
    override the tolerance rule of :mod:`patchdsl.parity.compare`.
    """
    import torch

    from ..codegen.env import target as detect_target
    from ..planner import PatchPlan, plan as make_plan
    from ..runtime import apply

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    if batch < 1 or seq < 2 or steps < 0:
        raise ValueError("need batch >= 1, seq >= 2 and steps >= 0")
    say = log or (lambda m: None)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    target = target or detect_target()
    if target == "cuda" and device.type != "cuda":
        raise ValueError(f"the kernels are compiled for cuda; run verify with device='cuda', not {device}")
    tol = tolerance_for(dtype, factor, floor)
    dt = _torch_dtype(dtype)

    say("building the three models (float64 reference, unpatched, patched)")
    ref, hf, patched = _models(model_or_factory)
    say(f"moving them to {device}")
    _prepare(ref, torch.float64, device)
    _prepare(hf, dt, device)
    _prepare(patched, dt, device)

    p = spec if isinstance(spec, PatchPlan) else make_plan(spec, patched, target=target, dtypes=(dtype,))
    say(f"planned {len(p.sites)} site(s); generating and applying the kernels")
    handle = apply(p, patched, target=target)
    spec_name = p.spec
    report = ParityReport(dtype=dtype, device=str(device), target=target, model_class=type(patched).__name__,
                          spec=spec_name, batch=batch, seq=seq, steps=steps, seed=seed,
                          factor=tol.factor, floor=tol.floor)
    report.refused = [str(r) for r in handle.refused]
    report.refused_required = [str(r) for r in handle.refused_required]
    live = [s for s in p.sites if s.path in handle.patched]
    report.sites = [{"path": s.path, "op": s.op, "host": s.host, **({"source": s.source} if s.source else {})}
                    for s in live]
    report.attention = p.attention.impl if p.attention is not None else None
    try:
        gen = torch.Generator().manual_seed(seed)
        vocab = _vocab(patched)
        b0 = _batch(gen, vocab, batch, seq, device)
        extra = _op_inputs(live, ref, hf, patched, batch, seq, seed)   # e.g. a teacher for a distillation loss
        if extra:
            say(f"the patched ops take {', '.join(sorted(extra))}: the unpatched copies answer those calls "
                "in plain PyTorch")
        batches = {id(m): {**b0, **cast_to(extra, mdt, device)}
                   for m, mdt in ((ref, torch.float64), (hf, dt), (patched, dt))}

        # ---- whole-model runs; the float64 one also records every site's inputs -------------
        lm_hosts = {s.host: _is_causal_lm(p, s.host) for s in live}
        cap = Capture(ref, lm_hosts)
        try:
            say("float64 reference: forward + backward")
            r_loss, r_logits, r_grads = _forward_backward(ref, batches[id(ref)])
        finally:
            cap.remove()
        say(f"unpatched {dtype}: forward + backward")
        h_loss, h_logits, h_grads = _forward_backward(hf, batches[id(hf)])
        say(f"patched {dtype}: forward + backward")
        p_loss, p_logits, p_grads = _forward_backward(patched, batches[id(patched)])

        # ---- per site, each on the reference's inputs ---------------------------------------
        for i, s in enumerate(live):
            say(f"site {s.path or '<model>'} ({s.op})")
            c = cap.calls.get(s.host)
            if c is None:
                inf = float("inf")
                report.rows.append(Check("site", s.path, s.op, "output", inf, inf, inf, float("nan"), float("nan"),
                                         False, "the module did not run in the forward pass; nothing was compared"))
                continue
            is_lm = lm_hosts[s.host]

            def upstream(main, _i=i):
                if main.dim() == 0:
                    return torch.ones_like(main)
                g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (_i + 1))
                return torch.randn(main.shape, generator=g, dtype=torch.float64).to(main.device, main.dtype)

            res = {name: run_site(m, s.host, s.path, c, mdt, device, upstream, is_lm, _ctx(m))
                   for name, m, mdt in (("ref", ref, torch.float64), ("hf", hf, dt), ("patched", patched, dt))}
            for q in res["ref"]:
                rv, hv, pv = res["ref"][q], res["hf"].get(q), res["patched"].get(q)
                if rv is None and pv is None:
                    continue
                report.rows.append(_check("site", s.path, s.op, q, pv, hv, rv, tol))

        # ---- end to end --------------------------------------------------------------------
        report.rows.append(_check("end-to-end", "", "", "loss", p_loss, h_loss, r_loss, tol))
        if p_logits is not None and r_logits is not None:
            report.rows.append(_check("end-to-end", "", "", "logits", p_logits, h_logits, r_logits, tol))
        grad_rows = []
        for n, rg in r_grads.items():
            pg, hg = p_grads.get(n), h_grads.get(n)
            if rg is None and pg is None:
                continue
            grad_rows.append(_check("end-to-end", n, "", "grad", pg, hg, rg, tol))
        report.grads_compared = len(grad_rows)

        def badness(r: Check) -> float:
            if not r.passed:
                return float("inf")
            return r.rel_fro_err / r.tolerance if r.tolerance > 0 else 0.0

        grad_rows.sort(key=badness, reverse=True)
        shown = [r for r in grad_rows if not r.passed]
        shown += [r for r in grad_rows if r.passed][:max(0, worst - len(shown))]
        report.rows.extend(shown)
        if grad_rows and all(r.passed for r in grad_rows):
            agg = _aggregate(r_grads, h_grads, p_grads, tol)
            report.rows.append(agg)
        elif grad_rows:
            n_bad = sum(not r.passed for r in grad_rows)
            report.rows.append(Check("end-to-end", "", "", f"grad (all {len(grad_rows)} parameters)",
                                     max(r.max_abs_err for r in grad_rows), max(r.max_rel_err for r in grad_rows),
                                     max(r.rel_fro_err for r in grad_rows), float("nan"), float("nan"), False,
                                     f"{n_bad} parameter gradient(s) out of tolerance"))

        # ---- training steps ----------------------------------------------------------------
        if steps:
            _steps(report, (ref, hf, patched), gen, vocab, batch, seq, steps, lr, device, tol, say, extra)
    finally:
        handle.undo()
    return report


def _aggregate(r_grads, h_grads, p_grads, tol) -> Check:
    """One row over all parameter gradients concatenated (informational; each was judged alone)."""
    import math

    names = [n for n, g in r_grads.items() if g is not None and p_grads.get(n) is not None]
    num_p = num_h = den = 0.0
    max_abs = max_rel = 0.0
    for n in names:
        r = r_grads[n]
        ep = errors(p_grads[n], r)
        eh = errors(h_grads[n], r) if h_grads.get(n) is not None else Errors.nonfinite()
        rn2 = float(r.double().norm()) ** 2
        num_p += (ep.rel_fro ** 2) * rn2
        num_h += (eh.rel_fro ** 2) * rn2
        den += rn2
        max_abs, max_rel = max(max_abs, ep.max_abs), max(max_rel, ep.max_rel)
    rp = math.sqrt(num_p / den) if den else 0.0
    rh = math.sqrt(num_h / den) if den else 0.0
    bound = tol.bound(rh)
    return Check("end-to-end", "", "", f"grad (all {len(names)} parameters)", max_abs, max_rel, rp, rh, bound,
                 rp <= bound, "each parameter judged separately")


def _op_inputs(live: list, ref: Any, hf: Any, patched: Any, batch: int, seq: int, seed: int) -> dict[str, Any]:
    """What ops whose calls an unpatched model cannot answer need (``Op.parity_kwargs``: a distillation
    loss's teacher), and the plain-PyTorch forwards (``Op.parity_reference``) that let the float64
    reference and the unpatched copy answer them, installed on those two copies (verify's own)."""
    import torch

    from ..ops.registry import get_op

    extra: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(seed * 7 + 12345)      # its own stream: b0 stays as without it
    for s in live:
        op = get_op(s.op)
        if op is None:
            continue
        flags = s.flag_dict
        host = patched.get_submodule(s.host) if s.host else patched
        kw = op.parity_kwargs(host, flags, batch, seq, gen)
        if not kw:
            continue
        extra.update(kw)
        for m in (ref, hf):
            h = m.get_submodule(s.host) if s.host else m
            for obj, attr, value in op.parity_reference(h, flags):
                setattr(obj, attr, value)
    return extra


def _steps(report: ParityReport, models, gen, vocab, batch, seq, steps, lr, device, tol, say,
           extra: dict[str, Any] | None = None) -> None:
    """N AdamW steps on each model.  16-bit models keep fp32 master weights (the usual mixed-precision
    recipe: AdamW's state and eps do not fit fp16); the float64 reference steps its own weights."""
    import torch

    params, masters, opts = [], [], []
    for m in models:
        ps = [q for q in m.parameters() if q.requires_grad]
        if ps and ps[0].dtype in (torch.float16, torch.bfloat16):
            ms = [q.detach().float().clone().requires_grad_(True) for q in ps]
        else:
            ms = ps
        params.append(ps)
        masters.append(ms)
        opts.append(torch.optim.AdamW(ms, lr=lr, foreach=False))
    losses: list[list[Any]] = [[], [], []]
    for i in range(steps):
        b = _batch(gen, vocab, batch, seq, device)
        say(f"step {i + 1}/{steps}")
        for k, m in enumerate(models):
            for q in params[k]:
                q.grad = None
            p0 = next(m.parameters(), None)
            kw = cast_to(extra, p0.dtype, device) if extra and p0 is not None else {}
            with _ctx(m):
                out = m(**b, **kw)
            out.loss.backward()
            if masters[k] is not params[k]:
                for q, mq in zip(params[k], masters[k]):
                    mq.grad = None if q.grad is None else q.grad.float()
            opts[k].step()
            if masters[k] is not params[k]:
                with torch.no_grad():
                    for q, mq in zip(params[k], masters[k]):
                        q.copy_(mq)
            losses[k].append(out.loss.detach())
    for i in range(steps):
        r, h, p = losses[0][i], losses[1][i], losses[2][i]
        report.rows.append(_check("step", "", "", f"loss step {i + 1}", p, h, r, tol))
    for m in models:
        for q in m.parameters():
            q.grad = None


def _is_causal_lm(p: Any, host: str) -> bool:
    info = p.infos.get(host)
    return bool(info is not None and "CausalLM" in info.kinds)
