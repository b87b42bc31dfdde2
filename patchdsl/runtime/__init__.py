"""Runtime: the only code that mutates a model.

``apply(plan_or_spec, model)`` patches module INSTANCES (a new ``forward`` bound with
``types.MethodType``, or whatever attribute assignments an op's ``install`` asks for) and
returns a :class:`PatchHandle` whose ``undo()`` puts every attribute back exactly as it was.
Nothing process-wide is touched: no class, no name in a transformers modeling module, nothing
in ``torch.nn.functional``.  Parameters are never copied or replaced, so ``state_dict()``,
optimizers built before patching, and checkpoints are unaffected.

``graph_step(model, optimizer, example_batch)`` (:mod:`.graphs`: the step, its capture and replay;
:mod:`.graph_checks`: what may be captured, decided before; :mod:`.graph_capture`: transformers'
decisions made as in an eager step) captures a whole training step of a (patched) model as one
CUDA graph; it changes no module, only the parameters' ``.grad``.
"""

from .graphs import GraphedStep, GraphStepError, UnpatchedModelWarning, graph_step
from .patch import PatchError, PatchHandle, Refusal, UnsupportedDtype, apply, patch_module, unpatch

__all__ = ["PatchError", "PatchHandle", "Refusal", "UnsupportedDtype", "apply", "patch_module", "unpatch",
           "GraphedStep", "GraphStepError", "UnpatchedModelWarning", "graph_step"]
