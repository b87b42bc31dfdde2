"""verify's inputs and bookkeeping: the three copies prepared (cast, moved, train mode, dropout off),
the synthetic batch (and an image batch for vision-language models), one forward and backward, a
judged check, the gradients kept on the host."""

from __future__ import annotations

import copy
from typing import Any, Callable

from .compare import Errors, Tolerance, errors, judge
from .moe import eager_experts
from .reference import float64_mode
from .report import Check
from .stream import VerifyError


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
    # every op returns the dtypes the module it replaces returns (the one place this is checked, for every op,
    # site output and gradient): a kernel that promotes where the model casts back (or the reverse) changes
    # what the rest of the model computes in, even where its values are close
    pd, hd = getattr(patched, "dtype", None), getattr(hf, "dtype", None)
    if pd is not None and hd is not None and pd != hd:
        return Check(kind, path, op, quantity, ep.max_abs, ep.max_rel, ep.rel_fro, eh.rel_fro, float("nan"), False,
                     (note + "; " if note else "") + f"dtype {str(pd).replace('torch.', '')} where the unpatched "
                     f"model gives {str(hd).replace('torch.', '')}")
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
