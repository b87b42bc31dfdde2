"""patchdsl: declarative fused-kernel patching for Hugging Face transformers models.

    import patchdsl
    spec = patchdsl.load_spec("specs/qwen3.kpatch")
    plan = patchdsl.plan(spec, model)
    with patchdsl.apply(plan, model) as handle:
        ...train...

Heavy modules (torch, triton, transformers) are imported on first use.
"""

from . import _interp  # noqa: F401  (must run before anything imports triton)
from ._version import __version__
from .syntax import SpecError, load_spec, parse_spec

__all__ = ["__version__", "SpecError", "load_spec", "parse_spec", "plan", "apply", "unpatch", "verify"]


def plan(spec, model, **kwargs):
    from .planner import plan as _plan
    return _plan(spec, model, **kwargs)


def apply(plan_or_spec, model, **kwargs):
    from .runtime import apply as _apply
    return _apply(plan_or_spec, model, **kwargs)


def unpatch(model):
    """Remove patchdsl's patches from ``model`` (e.g. a deepcopy of a patched model); see runtime."""
    from .runtime import unpatch as _unpatch
    return _unpatch(model)


def verify(spec, model_or_factory, **kwargs):
    from .parity import verify as _verify
    return _verify(spec, model_or_factory, **kwargs)
