"""The lm_head site and its causal LM at plan time: which module is the host, whether the head is
a plain linear layer the fused losses can read, the vocabulary and hidden sizes (the scalings the
host's forward applies: :mod:`patchdsl.model.forward.logits`)."""

from __future__ import annotations

from typing import Any

from ...model.info import ModuleInfo

# --------------------------------------------------------------------------- planning time
def causal_lm_host(info: ModuleInfo, index: Any) -> str:
    """Path of the nearest module (``info`` itself or an ancestor) with the CausalLM kind."""
    if "CausalLM" in info.kinds:
        return info.path
    if index is not None:
        for anc in index.ancestors(info.path):
            if "CausalLM" in anc.kinds:
                return anc.path
    return info.path


def lm_head_misfit(op: str, info: ModuleInfo, index: Any) -> str | None:
    """None when ``info`` is the lm_head of a causal LM (the loss ops' only home), else why not."""
    host = causal_lm_host(info, index)
    hinfo = index.infos.get(host) if index is not None else None
    if hinfo is None or "CausalLM" not in hinfo.kinds:
        return f"{op} fits only the lm_head of a causal LM, and no causal LM holds this module"
    if info.path != (f"{host}.lm_head" if host else "lm_head"):
        return f"{op} fits only the causal LM's lm_head"
    return None


def head_module_reason(head: Any, host: Any = None) -> str:
    """Why no causal-LM loss op fits an lm_head that is not a plain linear layer (``head``, held by
    ``host``), read from its structure: a head that transforms the hidden states before its vocabulary
    projection (BERT-style ``dense -> act -> layer_norm -> decoder``: RoBERTa ...), one that only wraps
    that projection (BertGeneration), one whose output is not the vocabulary (ModernBERT decoder:
    ``self.decoder(self.lm_head(h))``), or whatever else it is."""
    import torch

    cls = type(head).__name__
    owner = f"{type(host).__name__}'s " if host is not None else ""
    vocab = getattr(getattr(host, "config", None), "vocab_size", None)
    children = list(head.named_children()) if isinstance(head, torch.nn.Module) else []
    proj = next((n for n, c in children if isinstance(c, torch.nn.Linear) and c.out_features == vocab), None)
    if proj is None:
        if any(isinstance(c, torch.nn.Linear) for _, c in children) or children:
            return (f"{owner}lm_head is a {cls} whose output is not the vocabulary ({vocab} entries): the "
                    "forward projects onto the vocabulary elsewhere, which the fused loss does not reproduce")
        return f"{owner}lm_head is a {cls}, not an nn.Linear: no causal-LM loss op fits it"
    before = [n for n, _ in children if n != proj]
    if not before:
        return (f"{owner}lm_head is a {cls} wrapping its vocabulary projection {proj} (not an nn.Linear itself); "
                "the fused loss takes the lm_head as an nn.Linear")
    return (f"{owner}lm_head is a {cls}, not an nn.Linear: it transforms the hidden states ({', '.join(before)}) "
            f"before its vocabulary projection {proj}; the fused loss takes a linear lm_head "
            "(a transform run outside the fused projection is not implemented)")


def vocab_of(info: ModuleInfo) -> int:
    f = info.facts("CausalLM")
    if f:
        return int(f["vocab"])
    return int(info.facts("Linear")["out_features"])


def hidden_of(info: ModuleInfo) -> int:
    f = info.facts("CausalLM")
    if f:
        return int(f["hidden"])
    return int(info.facts("Linear")["in_features"])
