"""A sharded lm_head (FSDP2, DeepSpeed ZeRO-3): how its weight is gathered, and calling a fused
loss as the head's own forward so the weight is whole while the loss reads it."""

from __future__ import annotations

from typing import Any, Callable

# --------------------------------------------------------------------------- sharded lm_head
def head_gather(lm: Any) -> str | None:
    """Whether ``lm``'s weight is whole only inside ``lm``'s own call, and by whose doing.

    The fused loss runs in the causal LM's forward, outside ``lm_head``'s.  That is fine when the
    weight is a plain tensor, or when FSDP2 shards it as part of an enclosing unit (``fully_shard``
    on the causal LM gathers it before the LM's forward).  It is not when something gathers it
    only around ``lm_head``'s own forward:

    * ``"fsdp2"``: ``lm_head`` is an FSDP2 unit of its own (``fully_shard(model.lm_head)``);
    * ``"zero3"``: the weight is a DeepSpeed ZeRO-3 partition (``ds_status``/``ds_shape`` set),
      gathered by ZeRO-3's hooks on the module that owns it.

    Then the loss is computed by :func:`call_as_forward` inside ``lm_head``'s call.
    """
    # fully_shard swaps the module's class for a subclass of FSDPModule (no import of torch.distributed)
    if any(c.__name__ == "FSDPModule" for c in type(lm).__mro__):
        return "fsdp2"
    w = getattr(lm, "weight", None)
    if w is not None and hasattr(w, "ds_status") and hasattr(w, "ds_shape"):
        return "zero3"
    return None


def unsharded_reason(w: Any, name: str = "lm_head.weight", hint: str | None = None) -> str | None:
    """Why ``w`` (read where it should be whole) is not the whole weight; None when it is."""
    if hasattr(w, "ds_shape") and tuple(w.shape) != tuple(w.ds_shape):
        return (f"{name} is a DeepSpeed ZeRO-3 partition of shape {tuple(w.shape)} (whole: "
                f"{tuple(w.ds_shape)}) where it should have been gathered; "
                + (hint or "is lm_head called by ZeRO-3's hooks?"))
    if type(w).__name__ == "DTensor":
        return (f"{name} is a DTensor (sharded) where it should be whole; " + (hint or
                "shard with fully_shard per decoder layer and then the causal LM (or lm_head as its own "
                "unit): docs/distributed.md"))
    return None


def call_as_forward(module: Any, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` run as ``module``'s forward, through ``module(*args)``, so the hooks that make its
    parameters whole (FSDP2's unshard/reshard and pre-backward hooks, ZeRO-3's gather/release and
    gradient hooks) run around it exactly as around ``module``'s own forward."""
    had = "forward" in module.__dict__
    prev = module.__dict__.get("forward")
    module.__dict__["forward"] = fn
    try:
        return module(*args)
    finally:
        if had:
            module.__dict__["forward"] = prev
        else:
            del module.__dict__["forward"]
