"""Vocabulary-parallel fused linear cross entropy: the LM head colwise (each rank holds vocab / ranks rows
of the weight), the logits never whole on any rank.

Per chunk of tokens each rank computes its slice's logits z (the model's scalings and softcap applied),
their logsumexp, the target logit where the label falls in its slice, and (for label smoothing) their
sum; one all-gather of those three numbers per token combines the slices: lse = logsumexp over ranks,
target and sum added.  The loss per token is the single-device op's

    (1 - eps) * (lse - z_y) + eps * (lse - sum(z) / V) + z_loss * lse^2

reduced as HF does (sum / num_items_in_batch when given, else the mean over non-ignored tokens; or the
sum).  The gradients are computed in the same pass (d loss / d z = softmax * (1 + 2 z_loss lse) -
eps / V - (1 - eps) onehot, through softcap and the scalings), as the single-device chunked op does;
the backward scales them by grad_output and sums grad_hidden over the ranks (one all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LossSpec:
    """The loss semantics of a fused_linear_cross_entropy site (its kernel parameters' loss part)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    logit_multiplier: float | None = None
    logits_scaling: float | None = None
    reduction: str = "mean"
    chunk: int = 1024

    @classmethod
    def of(cls, params: dict) -> "LossSpec":
        chunk = params.get("chunk")
        return cls(int(params.get("ignore_index", -100)), float(params.get("label_smoothing") or 0.0),
                   float(params.get("z_loss") or 0.0), params.get("softcap") or None,
                   params.get("logit_multiplier") or None, params.get("logits_scaling") or None,
                   str(params.get("reduction", "mean")), int(chunk) if isinstance(chunk, int) and chunk > 0 else 1024)


_FN = None


def _function():
    import torch
    import torch.distributed as dist

    class VocabParallelLinearCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, b, labels, num_items, spec, group, lo, vocab):
            if spec.reduction == "none":
                raise ValueError("reduction=none is not vocabulary-parallel (refused at apply time)")
            n_tok, hidden = h.shape
            ranks = dist.get_world_size(group)
            valid = labels != spec.ignore_index
            mine = valid & (labels >= lo) & (labels < lo + w.shape[0])
            idx = torch.where(mine, labels - lo, 0)
            if spec.reduction == "sum":
                denom = torch.ones((), dtype=torch.float32, device=h.device)
            elif num_items is not None:
                denom = torch.as_tensor(num_items, dtype=torch.float32, device=h.device)
            else:
                denom = valid.sum().clamp_min(1).to(torch.float32)
            eps, zl, cap = spec.label_smoothing, spec.z_loss, spec.softcap
            scale = (spec.logit_multiplier or 1.0) / (spec.logits_scaling or 1.0)
            need = ctx.needs_input_grad
            losses = torch.zeros(n_tok, dtype=torch.float32, device=h.device)
            gh = torch.zeros(n_tok, hidden, dtype=torch.float32, device=h.device) if need[0] else None
            gw = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need[1] else None
            gb = torch.zeros(w.shape[0], dtype=torch.float32, device=h.device) if b is not None and need[2] else None
            wf = w.float()
            for s in range(0, n_tok, spec.chunk):
                e = min(n_tok, s + spec.chunk)
                hc = h[s:e]
                x = (hc @ w.t()).float()
                if b is not None:
                    x = x + b.float()
                if scale != 1.0:
                    x = x * scale
                t = torch.tanh(x / cap) if cap else None
                z = cap * t if cap else x
                m = z.max(-1).values
                lse_l = m + torch.log(torch.exp(z - m[:, None]).sum(-1))
                tgt_l = torch.where(mine[s:e], z.gather(1, idx[s:e, None])[:, 0], 0.0)
                sum_l = z.sum(-1) if eps else torch.zeros_like(m)
                stats = torch.stack([lse_l, tgt_l, sum_l]).contiguous()
                parts = [torch.empty_like(stats) for _ in range(ranks)]
                dist.all_gather(parts, stats, group=group)
                allst = torch.stack(parts)
                lse = torch.logsumexp(allst[:, 0], 0)
                tgt = allst[:, 1].sum(0)
                per = (1 - eps) * (lse - tgt) + zl * lse * lse
                if eps:
                    per = per + eps * (lse - allst[:, 2].sum(0) / vocab)
                v = valid[s:e]
                losses[s:e] = torch.where(v, per, 0.0)
                if gh is None and gw is None and gb is None:
                    continue
                g = torch.exp(z - lse[:, None]) * (1 + 2 * zl * lse)[:, None]
                if eps:
                    g = g - eps / vocab
                rows = torch.nonzero(mine[s:e])[:, 0]
                g[rows, idx[s:e][rows]] -= (1 - eps)
                g = g * (v.to(torch.float32) / denom)[:, None]
                if cap:
                    g = g * (1 - t * t)
                if scale != 1.0:
                    g = g * scale
                if gh is not None:
                    gh[s:e] = g @ wf
                if gw is not None:
                    gw += g.t() @ hc.float()
                if gb is not None:
                    gb += g.sum(0)
            ctx.group = group
            ctx.dtypes = (h.dtype, w.dtype, b.dtype if b is not None else None)
            ctx.save_for_backward(*(x if x is not None else torch.empty(0) for x in (gh, gw, gb)))
            ctx.present = (gh is not None, gw is not None, gb is not None)
            return losses.sum() / denom

        @staticmethod
        def backward(ctx, go):
            gh, gw, gb = ctx.saved_tensors
            has_h, has_w, has_b = ctx.present
            go = go.to(torch.float32)
            dh = dw = db = None
            if has_h:
                dh = (gh * go).contiguous()
                dist.all_reduce(dh, group=ctx.group)
                dh = dh.to(ctx.dtypes[0])
            if has_w:
                dw = (gw * go).to(ctx.dtypes[1])
            if has_b:
                db = (gb * go).to(ctx.dtypes[2])
            return dh, dw, db, None, None, None, None, None, None

    return VocabParallelLinearCE


def vocab_parallel_linear_cross_entropy(hidden: Any, weight: Any, bias: Any, labels: Any, num_items: Any,
                                        spec: LossSpec, cast: Any = None) -> Any:
    """The loss of ``hidden`` (batch..., hidden; whole on every rank, or a DTensor made so) under an LM head
    whose ``weight`` (and ``bias``) are DTensors sharded over the vocabulary (Shard(0)), as a scalar on every
    rank; ``cast``: the autocast dtype the head's matmul would run in."""
    global _FN
    if _FN is None:
        _FN = _function()
    if any(c.__name__ == "DTensor" for c in type(hidden).__mro__):
        from torch.distributed.tensor import Replicate

        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    mesh = weight.device_mesh
    ranks, coord = mesh.size(), mesh.get_coordinate()[0]
    vocab = int(weight.shape[0])
    lo = min(coord * -(-vocab // ranks), vocab)
    w = weight.to_local()
    b = bias.to_local() if bias is not None else None
    if cast is not None:
        w = w.to(cast)
        b = b.to(cast) if b is not None else None
    h = hidden.reshape(-1, hidden.shape[-1])
    return _FN.apply(h, w, b, labels.reshape(-1), num_items, spec, mesh.get_group(), lo, vocab)
