"""patchdsl: declarative fused-kernel patching for Hugging Face transformers models.

    import patchdsl
    spec = patchdsl.load_spec("specs/qwen3.kpatch")
    plan = patchdsl.plan(spec, model)
    with patchdsl.apply(plan, model) as handle:
        ...train...

Heavy modules (torch, triton, transformers) are imported on first use: ``PatchdslArguments``,
``TrainingArguments``, ``PatchdslCallback`` and ``patch_for_training`` are resolved by the
module-level ``__getattr__`` below, so ``import patchdsl`` does not import transformers.

In a training script (see docs/training.md):

    parser = HfArgumentParser((TrainingArguments, patchdsl.PatchdslArguments))
    training_args, kpatch_args = parser.parse_args_into_dataclasses()
    trainer = Trainer(..., callbacks=[patchdsl.PatchdslCallback.from_args(kpatch_args)])
"""

from .kernel_support import interp as _interp  # noqa: F401  (must run before anything imports triton)
from ._version import __version__
from .syntax import SpecError, load_spec, parse_spec

__all__ = ["__version__", "SpecError", "load_spec", "parse_spec", "plan", "apply", "unpatch", "verify",
           "suggest", "inspect_model",
           "PatchdslArguments", "TrainingArguments", "PatchdslCallback", "patch_for_training",
           "graph_step", "GraphStepError", "compile_model", "compile_layers"]

_LAZY = {
    "PatchdslArguments": ("patchdsl.training.args", "PatchdslArguments"),
    "PatchdslCallback": ("patchdsl.training.trainer", "PatchdslCallback"),
    "patch_for_training": ("patchdsl.training.trainer", "patch_for_training"),
    "graph_step": ("patchdsl.training.graphs", "graph_step"),           # CUDA-graph capture of a training step
    "GraphStepError": ("patchdsl.training.graphs", "GraphStepError"),
    "compile_model": ("patchdsl.training.compile", "compile_model"),     # torch.compile, mask as in eager
    "compile_layers": ("patchdsl.training.compile", "compile_layers"),   # regional compile: each decoder layer
}


def __getattr__(name: str):
    if name == "TrainingArguments":
        from .training.args import training_arguments_class

        value = training_arguments_class()
    elif name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
    else:
        raise AttributeError(f"module 'patchdsl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def plan(spec, model, **kwargs):
    from .planning.planner import plan as _plan
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


def suggest(model, **kwargs):
    """The spec that patches everything patchdsl can on ``model`` (see :mod:`patchdsl.planning.suggestion`):
    ``patchdsl.suggest(model).text``; ``.patched``, ``.unpatched`` (path -> reason), ``.counts()``."""
    from .planning.suggestion import suggest as _suggest
    return _suggest(model, **kwargs)


def inspect_model(model, **kwargs):
    """``model``'s modules with their structural kinds and facts, repeated layers folded (the JSON of
    ``patchdsl inspect``; see :mod:`patchdsl.model.inspection`)."""
    from .model.inspection import inspect_model as _inspect
    return _inspect(model, **kwargs)
