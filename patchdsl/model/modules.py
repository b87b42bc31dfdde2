"""Module structure: PEFT wrappers unwrapped to the module doing the work, the nn.Linear under a layer,
the decoder layers of a model; torch imported on first use."""

from __future__ import annotations

from typing import Any


def _torch():
    import torch
    return torch


def linear_like(m: Any) -> Any | None:
    """The nn.Linear holding the weight of ``m`` (``m`` itself, or a PEFT layer's base_layer)."""
    torch = _torch()
    seen = 0
    while m is not None and seen < 4:
        if isinstance(m, torch.nn.Linear):
            return m
        m = getattr(m, "base_layer", None)
        seen += 1
    return None


def unwrap(m: Any) -> Any:
    """Unwrap PEFT's ModulesToSaveWrapper-style wrappers to the module doing the work."""
    for attr in ("original_module",):
        inner = getattr(m, attr, None)
        if inner is not None and hasattr(m, "modules_to_save"):
            active = getattr(m, "active_adapters", None) or getattr(m, "active_adapter", None)
            if isinstance(active, (list, tuple)):
                active = active[0] if active else None
            if active is not None and active in m.modules_to_save:
                return m.modules_to_save[active]
            return inner
    return m


def decoder_layers(model: Any) -> tuple[str, Any] | None:
    """(path, ModuleList) of the model's decoder layers: the ``nn.ModuleList`` holding the most
    parameters (``model.layers`` in Llama-like models), or None when there is none."""
    import torch

    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = (name, m), n
    return best
