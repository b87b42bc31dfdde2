"""verify after the first forward and backward: per-site tolerances, each patched site re-run on the
float64 run's inputs, and the optimizer steps compared step by step."""

from __future__ import annotations

import copy
from typing import Any

from .compare import Tolerance
from .hooks import cast_to
from .report import ParityReport
from .inputs import _batch, _check, _ctx, _typed


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
