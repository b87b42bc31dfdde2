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

from .compare import tolerance_for
from .hooks import Capture, cast_to, run_host, run_site
from .moe import is_routed_call, router_checks, routing_grads
from ..model.modules import decoder_layers
from ..util.vocab import DTYPES, canonical_dtype, torch_dtype
from .reference import float64_mode
from .report import Check, ParityReport
from .stream import MODES, Float64Tally, StreamedReference, VerifyOutOfMemory, choose, estimate, truncate_layers
from .inputs import _Grads, _base, _batch, _check, _ctx, _forward_backward, _images, _is_oom, _prepare, _typed, _vocab
from .steps import (_first_step, _is_causal_lm, _is_router, _op_inputs, _park, _router_loss_off, _site_tolerances,
                    _source_device, _steps)


def verify(spec: Any, model_or_factory: Any, *, dtype: Any = "fp32", batch: int = 2, seq: int = 16,
           steps: int = 0, seed: int = 0, device: Any = None, target: str | None = None, lr: float = 1e-3,
           factor: float | None = None, floor: float | None = None, worst: int = 5,
           layers: int | None = None, reference: str = "auto", images: bool | None = None,
           log: Callable[[str], None] | None = None) -> ParityReport:
    """Check that ``spec`` applied to the model keeps forward values and gradients as accurate
    (against float64) as the unpatched model in ``dtype``.  Returns a :class:`ParityReport`;
    ``report.passed`` is the verdict.

    ``spec``: a Spec, a spec path / shipped name / text, or a PatchPlan.  ``model_or_factory``:
    an ``nn.Module`` (left untouched: it is deep-copied) or a zero-argument function returning
    one (called once; its model is consumed).  ``device``: "cpu", "cuda", ... (default: cuda
    when available).  ``target``: the kernel target (default: detected).  ``factor`` / ``floor``
    override the tolerance rule of :mod:`patchdsl.parity.compare`.  ``layers``: keep N decoder
    layers, one of each layer type at least (a quick check of a large model at its real widths; the
    report names the original layers kept; :mod:`patchdsl.model.layers`).  A model or factory given
    here is built whole and then cut; ``load_model(..., layers=N)`` (the CLI) builds only the kept
    layers.  ``reference``: "whole" (a float64 copy of the whole model), "streamed" (one decoder
    layer at a time, see :mod:`patchdsl.parity.stream`) or "auto" (whole when it fits).
    ``images`` (vision-language models, see :mod:`.images`): None (default) feeds an image batch built
    from the config when one runs and the reference is whole, else text only with the reason in
    ``report.images``; True requires one (a :class:`~patchdsl.parity.stream.VerifyError` saying why
    not); False feeds text only.

    Running out of memory raises :class:`~patchdsl.parity.stream.VerifyOutOfMemory` (a
    ``ValueError``) saying what to try; the CLI prints it and exits 2.
    """
    import torch

    dtype = canonical_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or torch.float32, torch.bfloat16, "
                         f"torch.float16), got {dtype!r}")
    if batch < 1 or seq < 2 or steps < 0:
        raise ValueError("need batch >= 1, seq >= 2 and steps >= 0")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if reference not in MODES:
        raise ValueError(f"reference must be one of {', '.join(MODES)}, got {reference!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phase = ["building the models"]
    try:
        return _verify(spec, model_or_factory, dtype, batch, seq, steps, seed, device, target, lr, factor, floor,
                       worst, layers, reference, log, phase, images)
    except Exception as e:       # out of memory anywhere: a message saying what to try
        if not _is_oom(e):
            raise
        msg = _oom_message(e, phase[0], device, dtype, batch, seq, layers, reference)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    raise VerifyOutOfMemory(msg)


def _oom_message(e: BaseException, phase: str, device: Any, dtype: str, batch: int, seq: int,
                 layers: int | None, reference: str) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    tries = []
    if reference != "streamed":
        tries.append("--reference streamed (one float64 decoder layer at a time)")
    tries.append(f"--layers N (fewer decoder layers at the real widths{f'; now {layers}' if layers else ''})")
    if batch > 1:
        tries.append(f"a smaller --batch (now {batch})")
    tries.append(f"a smaller --seq (now {seq})")
    return (f"verify ran out of memory on {device} while {phase} ({dtype}, batch {batch} x seq {seq}, "
            f"reference {reference}): {first[:200]}.  Try " + ", or ".join(tries) + ".")


def _patches_nothing(p: Any) -> str | None:
    """Why plan ``p`` patches no site (None when it patches one, or sets the attention implementation)."""
    if p.attention is not None or any(not s.refused for s in p.sites):
        return None
    if p.sites:
        first = p.sites[0]
        return f"all {len(p.sites)} site(s) refused (first: {first.path or '<model>'}: {first.refused})"
    if p.unmatched_optional:
        return (f"every rule is optional and selected nothing ({len(p.unmatched_optional)} rule(s); first: "
                f"{p.unmatched_optional[0]}); `patchdsl suggest --model M` writes a spec for this model")
    return "the spec has no rules"


def _verify(spec, model_or_factory, dtype, batch, seq, steps, seed, device, target, lr, factor, floor, worst,
            layers, reference, log, phase, images=None) -> ParityReport:
    import time

    import torch

    from ..codegen.env import target as detect_target
    from ..planning.plan import PatchPlan
    from ..planning.planner import plan as make_plan
    from ..runtime import apply

    t_start = time.perf_counter()
    say = log or (lambda m: None)

    def stage(m: str) -> None:
        phase[0] = m
        say(m)

    target = target or detect_target()
    if target == "cuda" and device.type != "cuda":
        raise ValueError(f"the kernels are compiled for cuda; run verify with device='cuda', not {device}")
    tol = tolerance_for(dtype, factor, floor)
    dt = torch_dtype(dtype)

    stage("building the model")
    base = _base(model_or_factory)
    layers_info = None
    if layers is not None:
        record = truncate_layers(base, layers)
        layers_info = record.to_json()
        say(record.describe())
    # the verdict that needs no run first: a spec that patches nothing here (a spec for another family,
    # optional rules that select nothing, every site refused) fails now, before any copy or forward
    # (planned again below once the model is in the run dtype, whose plan is the one applied)
    p = spec if isinstance(spec, PatchPlan) else make_plan(spec, base, target=target, dtypes=(dtype,))
    empty = _patches_nothing(p)
    if empty:
        say(empty)
        report = ParityReport(dtype=dtype, device=str(device), target=target, model_class=type(base).__name__,
                              spec=p.spec, batch=batch, seq=seq, steps=steps, seed=seed, factor=tol.factor,
                              floor=tol.floor, nothing_patched=empty)
        report.refused = [str(s.refused) for s in p.sites if s.refused]
        report.layers = layers_info
        report.seconds = time.perf_counter() - t_start
        return report
    p0 = next(base.parameters(), None)
    base_dt = p0.dtype if p0 is not None else dt
    est = estimate(base, dt.itemsize, batch, seq, device,
                   base_on_device=p0 is not None and p0.device.type == device.type, steps=steps)
    mode, why = choose(reference, est, steps, decoder_layers(base) is not None)
    say(f"float64 reference: {mode} ({why})")
    tally = Float64Tally()
    stream = None
    if mode == "whole":
        stage("copying the model (float64 reference, unpatched, patched)")
        ref, hf, patched = copy.deepcopy(base), copy.deepcopy(base), base
        _prepare(ref, torch.float64, device)
        tally.track(ref)
        source = None
    else:
        stage("copying the model (unpatched, patched; the float64 reference is streamed)")
        ref = None
        hf, patched = copy.deepcopy(base), base
        # the reference evaluates the weights as given: stream from the unpatched copy when it has them
        source = hf if base_dt == dt else copy.deepcopy(base)
        if source is not hf:
            _prepare(source, base_dt, _source_device(source, device))
    _prepare(hf, dt, device)
    _prepare(patched, dt, device)
    recipe, images_info = _images(images, hf, [m for m in (ref, patched, source) if m is not None and m is not hf],
                                  mode, batch, seq, say)

    stage("planning and applying the kernels")
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
    if not live and p.attention is None:          # every site refused when applied: no PASS of nothing
        report.nothing_patched = ("every site was refused when applied"
                                  + (f" (first: {report.refused[0]})" if report.refused else ""))
    report.sites = [{"path": s.path, "op": s.op, "host": s.host, **({"source": s.source} if s.source else {})}
                    for s in live]
    # ops that are not exact by design (fp8_linear) state their own floor; the end-to-end rows take the
    # loosest of them (an fp8 projection's error reaches the loss and every gradient upstream of it)
    site_tol = _site_tolerances(live, dtype, tol, floor)
    e2e_tol = max(site_tol.values(), key=lambda t: t.floor, default=tol)
    if e2e_tol is not tol:
        report.sites = [{**d, "floor": site_tol[d["path"]].floor} if site_tol[d["path"]] is not tol else d
                        for d in report.sites]
    report.attention = p.attention.impl if p.attention is not None else None
    report.layers = layers_info
    report.images = images_info
    try:
        gen = torch.Generator().manual_seed(seed)
        vocab = _vocab(patched)
        b0 = recipe.batch(gen, batch, seq, device) if recipe is not None else _batch(gen, vocab, batch, seq, device)
        report.seq = int(b0["input_ids"].shape[1])      # an image batch's sequences hold the image tokens too
        router_off = _router_loss_off(hf) if mode != "whole" else {}
        if router_off:
            say("the streamed float64 reference records no router logits: the MoE auxiliary loss is left out "
                "of all three copies (output_router_logits=False)")
            b0.update(router_off)
        ref_like = ref if ref is not None else source
        extra = _op_inputs(live, ref_like, hf, patched, batch, report.seq, seed)   # e.g. a teacher for a distillation loss
        if extra:
            say(f"the patched ops take {', '.join(sorted(extra))}: the unpatched copies answer those calls "
                "in plain PyTorch")
        lm_hosts = {s.host: _is_causal_lm(p, s.host) for s in live}

        if mode == "whole":
            batches = {id(m): {**_typed(b0, mdt), **cast_to(extra, mdt, device)}
                       for m, mdt in ((ref, torch.float64), (hf, dt), (patched, dt))}
            # ---- whole-model runs; the float64 one also records every site's inputs ---------
            cap = Capture(ref, lm_hosts)
            try:
                stage("float64 reference: forward + backward")
                r_loss, r_logits, r_grads = _forward_backward(ref, batches[id(ref)])
            finally:
                cap.remove()
            calls = cap.calls
            stage(f"unpatched {dtype}: forward + backward")
            h_loss, h_logits, h_grads = _forward_backward(hf, batches[id(hf)])
            stage(f"patched {dtype}: forward + backward")
            p_loss, p_logits, p_grads = _forward_backward(patched, batches[id(patched)])
            judge_grads = _Grads(h_grads, p_grads, e2e_tol)
            for n, rg in r_grads.items():
                judge_grads.add(n, rg)
            del r_grads
        else:
            # ---- the runs under test first (their gradients are kept), then the float64 one streamed
            # (on a GPU their gradients wait on the host: an 8B model's two bf16 gradient sets are 32 GB)
            stage(f"unpatched {dtype}: forward + backward")
            h_loss, h_logits, h_grads = _forward_backward(hf, {**b0, **cast_to(extra, dt, device)})
            h_grads = _park(hf, h_grads, device)
            stage(f"patched {dtype}: forward + backward")
            p_loss, p_logits, p_grads = _forward_backward(patched, {**b0, **cast_to(extra, dt, device)})
            p_grads = _park(patched, p_grads, device)
            stage("float64 reference, streamed layer by layer: forward + backward")
            stream = StreamedReference(source, device, lm_hosts, tally, say)
            judge_grads = _Grads(h_grads, p_grads, e2e_tol)
            stream.on_grad = judge_grads.add
            r_loss, r_logits = stream.forward_backward({**b0, **cast_to(extra, torch.float64, device)})
            calls = stream.capture.calls
            for n, _ in hf.named_parameters():     # parameters the float64 run never reached
                judge_grads.add(n, None)

        # ---- per site, each on the reference's inputs ---------------------------------------
        for i, s in enumerate(live):
            stage(f"site {s.path or '<model>'} ({s.op})")
            c = calls.get(s.host)
            if c is None:
                inf = float("inf")
                report.rows.append(Check("site", s.path, s.op, "output", inf, inf, inf, float("nan"), float("nan"),
                                         False, "the module did not run in the forward pass; nothing was compared"
                                         + (f" (no images were fed: {images_info['reason']})"
                                            if images_info and not images_info.get("fed") else "")))
                continue
            is_lm = lm_hosts[s.host]

            def upstream(main, _i=i):
                if main.dim() == 0:
                    return torch.ones_like(main)
                g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (_i + 1))
                return torch.randn(main.shape, generator=g, dtype=torch.float64).to(main.device, main.dtype)

            res = {name: run_site(m, s.host, s.path, c, mdt, device, upstream, is_lm, _ctx(m))
                   for name, m, mdt in (("hf", hf, dt), ("patched", patched, dt))}
            if ref is not None:
                res["ref"] = run_site(ref, s.host, s.path, c, torch.float64, device, upstream, is_lm, _ctx(ref))
            else:
                with stream.host(s.host) as (h64, hp):
                    rel = s.path[len(hp) + 1:] if hp and s.path != hp else (s.path if not hp else "")
                    mod = h64.get_submodule(rel) if rel else h64
                    res["ref"] = run_host(h64, mod, s.host, c, torch.float64, device, upstream, is_lm,
                                          float64_mode())
                    del h64, mod
            if not is_lm and is_routed_call(c):     # MoE experts: the router's gradient too (see .moe)
                if ref is not None:
                    res["ref"].update(routing_grads(ref, s.path, c, torch.float64, device, upstream, _ctx(ref)))
                else:
                    with stream.host(s.host) as (h64, hp):
                        res["ref"].update(routing_grads(h64, s.path[len(hp) + 1:] if hp else s.path, c,
                                                        torch.float64, device, upstream, float64_mode()))
                        del h64
                for name, m in (("hf", hf), ("patched", patched)):
                    res[name].update(routing_grads(m, s.path, c, dt, device, upstream, _ctx(m)))
            elif not is_lm and _is_router(p, s.path):   # MoE router: its top-k weights, routing held fixed (.moe)
                rseed = seed * 1_000_003 + 7919 * (i + 1) + 1
                copies = {"hf": (hf.get_submodule(s.path), dt, _ctx(hf)),
                          "patched": (patched.get_submodule(s.path), dt, _ctx(patched))}
                if ref is not None:
                    copies["ref"] = (ref.get_submodule(s.path), torch.float64, _ctx(ref))
                    rc = router_checks(copies, c, device, rseed)
                else:
                    with stream.host(s.host) as (h64, hp):
                        rel = s.path[len(hp) + 1:] if hp and s.path != hp else (s.path if not hp else "")
                        copies["ref"] = (h64.get_submodule(rel) if rel else h64, torch.float64, float64_mode())
                        rc = router_checks(copies, c, device, rseed)
                        del h64, copies
                for name in ("hf", "patched", "ref"):
                    res[name].update(rc.get(name, {}))
            for q in res["ref"]:
                rv, hv, pv = res["ref"][q], res["hf"].get(q), res["patched"].get(q)
                if rv is None and pv is None:
                    continue
                report.rows.append(_check("site", s.path, s.op, q, pv, hv, rv, site_tol.get(s.path, tol)))
            del res

        # ---- end to end --------------------------------------------------------------------
        tol = e2e_tol
        report.rows.append(_check("end-to-end", "", "", "loss", p_loss, h_loss, r_loss, tol))
        if p_logits is not None and r_logits is not None:
            report.rows.append(_check("end-to-end", "", "", "logits", p_logits, h_logits, r_logits, tol))
        del r_logits, h_logits, p_logits
        grad_rows = judge_grads.rows
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
            report.rows.append(judge_grads.aggregate())
        elif grad_rows:
            n_bad = sum(not r.passed for r in grad_rows)
            report.rows.append(Check("end-to-end", "", "", f"grad (all {len(grad_rows)} parameters)",
                                     max(r.max_abs_err for r in grad_rows), max(r.max_rel_err for r in grad_rows),
                                     max(r.rel_fro_err for r in grad_rows), float("nan"), float("nan"), False,
                                     f"{n_bad} parameter gradient(s) out of tolerance"))
        del h_grads, p_grads, judge_grads

        # ---- training steps ----------------------------------------------------------------
        if steps:
            stage(f"{steps} training step(s)")
            if mode == "whole":
                _steps(report, (ref, hf, patched), gen, vocab, batch, seq, steps, lr, device, tol, say, extra, recipe)
            else:
                _first_step(report, stream, (hf, patched), gen, vocab, batch, seq, device, tol, extra, router_off)
        report.reference = {
            "mode": mode, "why": why, "float64_params_peak": tally.peak, "params": est.params,
            "layer_params": est.layer_params, "outside_layers_params": est.other_params,
            "layer_copies": stream.layer_copies if stream is not None else 0,
            "estimate": est.to_json(),
            "compared": (
                "sites: each host module's float64 copy, on the float64 run's captured inputs; end to end: "
                "a float64 copy of the whole model" if mode == "whole" else
                "sites: each host module's float64 copy made, run on the streamed float64 run's captured inputs "
                "and freed; end to end: the float64 run streamed one decoder layer at a time (forward, then the "
                "backward layer by layer in reverse, recomputing each layer from its saved float64 input), "
                "every parameter gradient judged as it is computed")}
    finally:
        handle.undo()
        if stream is not None:
            stream.close()
    if device.type == "cuda":
        report.memory = {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                         "device_total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
                         "params": est.params, "dtype_bytes": dt.itemsize}
    report.seconds = round(time.perf_counter() - t_start, 2)
    return report
