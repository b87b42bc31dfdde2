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
from .hooks import Capture, cast_to, run_host, run_site
from .moe import eager_experts, is_routed_call, router_checks, routing_grads
from ..model.modules import decoder_layers
from ..util.vocab import DTYPES, canonical_dtype, torch_dtype
from .reference import float64_mode
from .report import Check, ParityReport
from .stream import (MODES, Float64Tally, VerifyError, StreamedReference, VerifyOutOfMemory, choose, estimate,
                     truncate_layers)



def _prepare(model: Any, dtype: Any, device: Any) -> Any:
    """Cast, move, train mode, dropout off (training-only code paths run, deterministically)."""
    import torch

    model.to(device=device, dtype=dtype)
    if dtype == torch.float64:
        eager_experts(model)    # MoE: the float64 reference must not go through grouped_mm (see .moe)
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
    if hasattr(cfg, "get_text_config"):      # a vision-language model: its language tower's vocabulary
        cfg = cfg.get_text_config()          # (PaliGemma's top-level vocab_size is not its embedding's)
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


def _typed(b: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """``b`` with its floating tensors (an image batch's pixels) in ``dtype``."""
    if dtype is None:
        return b
    return {k: (v.to(dtype) if hasattr(v, "is_floating_point") and v.is_floating_point() else v)
            for k, v in b.items()}


def _images(images: bool | None, model: Any, others: list, mode: str, batch: int, seq: int,
            say: Callable[[str], None]) -> tuple[Any, dict[str, Any] | None]:
    """(the image recipe or None, what the report says about images) for ``verify(images=...)``; the
    recipe's special ids are moved into the vocabulary on every copy (see :mod:`.images`)."""
    from .images import image_recipe

    vl = getattr(getattr(model, "config", None), "vision_config", None) is not None
    if images is False:
        return None, ({"fed": False, "reason": "text only asked (images=False / --text-only)"} if vl else None)
    if not vl and images is None:
        return None, None
    if mode != "whole":
        why = ("the streamed float64 reference runs the language tower's decoder layers alone; an image batch "
               "needs the whole float64 reference (--reference whole, --layers N or a smaller model)")
    else:
        say("building an image batch from the config (one forward without gradient)")
        recipe, why = image_recipe(model, batch=batch, seq=seq)
        if recipe is not None:
            for m in others:
                recipe.configure(m)
            say(f"images: {recipe.describe()}")
            return recipe, {"fed": True, "batch": recipe.describe(), "layout": recipe.layout,
                            "image_tokens": recipe.per_image}
    if images:
        raise VerifyError(f"verify cannot feed images to {type(model).__name__}: {why}")
    say(f"images: none fed ({why})")
    return None, {"fed": False, "reason": why}


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


def _base(model_or_factory: Any) -> Any:
    """The model verify patches: a deep copy of an ``nn.Module`` argument (left untouched), or
    what the factory returns (consumed)."""
    import torch

    if isinstance(model_or_factory, torch.nn.Module):
        src = model_or_factory
        _not_patched(src)
        return copy.deepcopy(src)
    if callable(model_or_factory):
        base = model_or_factory()
        if not isinstance(base, torch.nn.Module):
            raise TypeError(f"the model factory returned {type(base).__name__}, not a torch.nn.Module")
        _not_patched(base)
        return base
    raise TypeError("verify() needs an nn.Module or a zero-argument function returning one")


def _not_patched(model: Any) -> None:
    from ..runtime.patch import SITE_ATTR

    if any(SITE_ATTR in m.__dict__ for m in model.modules()):
        raise ValueError("the model is already patched; pass the unpatched model (undo its handle first)")


class _Grads:
    """Judges each parameter's gradient as its float64 reference arrives (whole model: all at
    once; streamed: layer by layer in the backward), keeping numbers, not tensors."""

    def __init__(self, h_grads: dict[str, Any], p_grads: dict[str, Any], tol: Tolerance):
        self.h, self.p, self.tol = h_grads, p_grads, tol
        self.rows: list[Check] = []
        self.stats: list[tuple[float, float, float, float, float]] = []   # rel_p, rel_h, |ref|^2, max_abs, max_rel
        self.seen: set[str] = set()

    def add(self, name: str, rg: Any) -> None:
        if name in self.seen:
            return
        self.seen.add(name)
        pg, hg = self.p.get(name), self.h.get(name)
        if rg is None and pg is None:
            return
        if rg is not None:        # gradients parked on the host: one transfer each
            pg = pg.to(rg.device) if pg is not None else None
            hg = hg.to(rg.device) if hg is not None else None
        row = _check("end-to-end", name, "", "grad", pg, hg, rg, self.tol)
        self.rows.append(row)
        if rg is not None and pg is not None:
            rn2 = float(rg.double().norm()) ** 2 if rg.numel() else 0.0
            self.stats.append((row.rel_fro_err, row.reference_err, rn2, row.max_abs_err, row.max_rel_err))

    def aggregate(self) -> Check:
        """One row over all parameter gradients concatenated (informational; each was judged alone)."""
        import math

        num_p = num_h = den = 0.0
        max_abs = max_rel = 0.0
        for rp, rh, rn2, ma, mr in self.stats:
            num_p += rp ** 2 * rn2
            num_h += rh ** 2 * rn2
            den += rn2
            max_abs, max_rel = max(max_abs, ma), max(max_rel, mr)
        rp = math.sqrt(num_p / den) if den else 0.0
        rh = math.sqrt(num_h / den) if den else 0.0
        bound = self.tol.bound(rh)
        return Check("end-to-end", "", "", f"grad (all {len(self.stats)} parameters)", max_abs, max_rel, rp, rh,
                     bound, rp <= bound, "each parameter judged separately")


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, getattr(torch, "OutOfMemoryError", ())) or isinstance(e, MemoryError):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg.lower() or "can't allocate memory" in msg
                                            or "not enough memory" in msg.lower())


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
    override the tolerance rule of :mod:`patchdsl.parity.compare`.  ``layers``: keep only the
    first N decoder layers (a quick check of a large model at its real widths; the report says
    so).  ``reference``: "whole" (a float64 copy of the whole model), "streamed" (one decoder
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
        kept, of = truncate_layers(base, layers)
        layers_info = {"used": kept, "of": of}
        say(f"kept the first {kept} of {of} decoder layers")
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


def _site_tolerances(live, dtype: str, tol: Tolerance, floor: float | None) -> dict[str, Tolerance]:
    """Per site: ``tol``, or (unless ``floor`` was given explicitly) the op's own floor
    (:meth:`patchdsl.ops.base.Op.parity_floor`) where it states one, or the loosest floor of the
    sites its module runs (an MLP site whose projections are fp8 sites: its output carries their error)."""
    from ..ops.registry import get_op

    own = {}
    for s in live:
        op = get_op(s.op)
        f = op.parity_floor(s.flag_dict, dtype) if op is not None and floor is None else None
        if f is not None:
            own[s.path] = float(f)
    out = {}
    for s in live:      # by the site's module (an LM head's check runs the head alone, on captured hidden states)
        inner = [f for p, f in own.items() if p == s.path or s.path == "" or p.startswith(s.path + ".")]
        out[s.path] = Tolerance(tol.factor, max(max(inner), tol.floor)) if inner else tol
    return out


def _park(model: Any, grads: dict[str, Any], device: Any) -> dict[str, Any]:
    """The gradients, moved to the host when ``device`` is a GPU; the model's ``.grad`` cleared
    (the streamed reference's float64 copies of it then carry none)."""
    if device.type == "cuda":
        grads = {n: (g.to("cpu") if g is not None else None) for n, g in grads.items()}
    for q in model.parameters():
        q.grad = None
    return grads


def _source_device(model: Any, default: Any) -> Any:
    p = next(model.parameters(), None)
    return p.device if p is not None else default


def _first_step(report: ParityReport, stream: Any, models, gen, vocab, batch, seq, device, tol,
                extra: dict[str, Any] | None, router_off: dict[str, Any] | None = None) -> None:
    """``steps=1`` with the streamed reference: step 1's loss is taken before any update, so it
    needs no float64 optimizer (see :data:`.stream._STEPS_MSG` for more steps)."""
    import torch

    b = {**_batch(gen, vocab, batch, seq, device), **(router_off or {})}
    losses = []
    for m in models:
        p0 = next(m.parameters(), None)
        kw = cast_to(extra, p0.dtype, device) if extra and p0 is not None else {}
        out = m(**b, **kw)
        losses.append(out.loss.detach())
        del out
    kw = cast_to(extra, torch.float64, device) if extra else {}
    r = stream.loss({**b, **kw})
    report.rows.append(_check("step", "", "", "loss step 1", losses[1], losses[0], r, tol))


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
           extra: dict[str, Any] | None = None, recipe: Any = None) -> None:
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
        b = recipe.batch(gen, batch, seq, device) if recipe is not None else _batch(gen, vocab, batch, seq, device)
        say(f"step {i + 1}/{steps}")
        for k, m in enumerate(models):
            for q in params[k]:
                q.grad = None
            p0 = next(m.parameters(), None)
            kw = cast_to(extra, p0.dtype, device) if extra and p0 is not None else {}
            with _ctx(m):
                out = m(**_typed(b, p0.dtype if p0 is not None else None), **kw)
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


def _router_loss_off(model: Any) -> dict[str, Any]:
    """``{"output_router_logits": False}`` when ``model`` is a MoE causal LM whose config turns its router
    logits (and so its auxiliary loss) on: the streamed float64 reference runs the decoder layers one
    at a time outside the model, where transformers' output recorders do not see the routers, so it
    has no router logits to add the loss from; ``{}`` otherwise."""
    import inspect

    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return {}
    cfg = getattr(model, "config", None)
    if "output_router_logits" in params and getattr(cfg, "output_router_logits", False) is True:
        return {"output_router_logits": False}
    return {}


def _is_router(p: Any, path: str) -> bool:
    info = p.infos.get(path)
    return bool(info is not None and "Router" in info.kinds)


def _is_causal_lm(p: Any, host: str) -> bool:
    info = p.infos.get(host)
    return bool(info is not None and "CausalLM" in info.kinds)
