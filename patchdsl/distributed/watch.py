"""The other order: a tensor-parallel plan applied AFTER patchdsl.apply.

A site patched on unsharded parameters has kernels specialised for every head / the whole width; a
``parallelize_module`` afterwards would hand them a rank's part (the first forward then fails deep in a
kernel, or computes on a shard as if it were whole).  ``parallelize_module`` registers each DTensor
parameter with ``register_parameter``, which calls torch's global parameter-registration hooks: the hook
here refuses, there and then, a DTensor parameter on a module of a site that is still patched for whole
parameters.  Nothing runs per forward call; the hook looks up a weak dictionary when a parameter is
registered (model construction, parallelisation).  FSDP2's ``fully_shard`` sets its parameters without
registering them (its shards are gathered whole before each forward: patch-then-shard is supported).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_WATCHED: "weakref.WeakKeyDictionary[Any, tuple[str, str, Callable[[], bool]]]" = weakref.WeakKeyDictionary()
_HANDLE = None


def _is_dtensor(t: Any) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


class ParallelisedAfterPatch(RuntimeError):
    """A tensor-parallel plan sharded a parameter of a site patched for whole parameters."""


def _hook(module: Any, name: str, param: Any) -> None:
    entry = _WATCHED.get(module)
    if entry is None or param is None or not _is_dtensor(param):
        return None
    path, what, still_patched = entry
    if not still_patched():
        _WATCHED.pop(module, None)
        return None
    placements = ", ".join(type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "()")
                           for p in getattr(param, "placements", ()))
    raise ParallelisedAfterPatch(
        f"{what} was patched for unsharded parameters, and a parallel plan now makes "
        f"{path + '.' if path else ''}{name} a DTensor ({placements}): its kernels would get this rank's part of the "
        "heads or widths.  Parallelise first, then patchdsl.apply (handle.undo() now, parallelize_module, apply "
        "again; docs/distributed.md)")


def watch(modules: list[tuple[str, Any]], what: str, still_patched: Callable[[], bool]) -> None:
    """Refuse a DTensor parameter registered on any of ``modules`` ((path, module) pairs) while
    ``still_patched()``; ``what`` names the site in the message."""
    global _HANDLE
    if _HANDLE is None:
        from torch.nn.modules.module import register_module_parameter_registration_hook

        _HANDLE = register_module_parameter_registration_hook(_hook)
    for path, m in modules:
        _WATCHED[m] = (path, what, still_patched)
