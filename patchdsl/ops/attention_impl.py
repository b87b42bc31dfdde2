"""The ``attention`` directive: the model's attention implementation, per model instance.

    attention sdpa            # or eager, flash_attention_2, flash_attention_3, flex_attention

transformers picks the attention function from ``config._attn_implementation`` in every
attention module (``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
...)``) and the mask builder reads the same field.  ``model.set_attn_implementation`` writes it
into the config object, which other model instances built from the same config share.  patchdsl
instead gives the patched instance its own shallow copy of the config with the chosen
implementation and points every module of that instance that held the old config at the copy
(assignments the runtime records, so ``undo`` restores the original object).  The process-wide
``ALL_ATTENTION_FUNCTIONS`` registry is never written, and no other instance sees a change.

An implementation that cannot run on this machine is an error when the plan is made
(``unavailable``), naming what is missing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

KNOWN = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_SUPPORT_ATTR = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                 "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


@dataclass(frozen=True)
class AttentionChoice:
    impl: str
    span: str = ""        # file:line of the directive

    def to_json(self) -> dict[str, Any]:
        return {"impl": self.impl, "rule": self.span}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "AttentionChoice":
        return cls(d["impl"], d.get("rule", ""))

    # ---- this machine --------------------------------------------------------------
    def unavailable(self, target: str, model_cls: type | None = None) -> str | None:
        """Why this implementation cannot run here (None if it can)."""
        import torch

        if model_cls is not None:
            attr = _SUPPORT_ATTR.get(self.impl)
            if attr and getattr(model_cls, attr, True) is False:
                return f"{model_cls.__name__} does not support {self.impl} ({attr} is False)"
        if self.impl == "eager":
            return None
        if self.impl == "sdpa":
            return None if hasattr(torch.nn.functional, "scaled_dot_product_attention") else \
                "this torch has no scaled_dot_product_attention"
        if self.impl == "flex_attention":
            from transformers.utils import is_torch_flex_attn_available

            if not is_torch_flex_attn_available():
                return "this torch build has no flex_attention"
            if target != "cuda" or not torch.cuda.is_available():
                # measured: torch raises "FlexAttention does not support backward on CPU"
                return "needs a CUDA GPU for training (torch's FlexAttention has no backward on the CPU)"
            return None
        if self.impl in ("flash_attention_2", "flash_attention_3"):
            from transformers.utils import import_utils as iu

            pkg = "flash-attn" if self.impl == "flash_attention_2" else "flash-attn-3 (flash_attn_interface)"
            missing = []
            if target != "cuda" or not torch.cuda.is_available():
                missing.append("a CUDA GPU (this machine has none)")
            check = iu.is_flash_attn_2_available if self.impl == "flash_attention_2" else iu.is_flash_attn_3_available
            try:
                ok = check()
            except Exception:
                ok = False
            if not ok:
                missing.append(f"the {pkg} package (pip install {pkg.split()[0]})")
            return ("needs " + " and ".join(missing)) if missing else None
        return f"unknown attention implementation {self.impl!r}"

    # ---- runtime -------------------------------------------------------------------
    def install(self, model: Any) -> list[tuple[Any, str, Any]]:
        """Assignments giving ``model`` (one instance) its own config with ``_attn_implementation`` set."""
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "_attn_implementation"):
            raise ValueError(f"{type(model).__name__} has no transformers config; the attention directive needs one")
        mine = copy.copy(cfg)
        # sub-configs (vision / text) are shared objects too: copy them before the setter recurses
        for key in getattr(mine, "sub_configs", {}) or {}:
            sub = getattr(mine, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                object.__setattr__(mine, key, copy.copy(sub))
        mine._attn_implementation = self.impl
        out = []
        for m in model.modules():
            if m.__dict__.get("config") is cfg:
                out.append((m, "config", mine))
        return out


def attention_problem(impl: str) -> str | None:
    """Why ``impl`` is no implementation the directive can choose (None if it is); the one name check
    of a spec's directive and a plan file's ``attention``.  Pure."""
    if impl in KNOWN:
        return None
    if "/" in impl:
        return f"Hub attention kernels ({impl}) are not supported by the attention directive"
    return f"unknown attention implementation {impl!r}"


def choose_attention(directive: Any) -> AttentionChoice:
    """The plan's AttentionChoice for an ``attention`` directive (pure; unknown names are SpecErrors)."""
    from ..syntax.errors import SpecError, did_you_mean

    impl = directive.impl
    why = attention_problem(impl)
    if why:
        if "/" in impl:
            raise SpecError(why, directive.span,
                            hint="transformers registers them in its process-wide AttentionInterface, which patchdsl "
                                 "does not change; pass attn_implementation= to from_pretrained instead")
        raise SpecError(why, directive.span, hint=did_you_mean(impl, KNOWN) or f"one of {', '.join(KNOWN)}")
    if directive.flags:
        raise SpecError("the attention directive takes no flags", directive.flags[0].span)
    return AttentionChoice(impl, directive.span.short)
