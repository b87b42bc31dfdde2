"""Runtime: the only code that mutates a model.

``apply(plan_or_spec, model)`` patches module INSTANCES (a new ``forward`` bound with
``types.MethodType``, or whatever attribute assignments an op's ``install`` asks for) and
returns a :class:`PatchHandle` whose ``undo()`` puts every attribute back exactly as it was.
Nothing process-wide is touched: no class, no name in a transformers modeling module, nothing
in ``torch.nn.functional``.  Parameters are never copied or replaced, so ``state_dict()``,
optimizers built before patching, and checkpoints are unaffected.

(Training a patched model faster -- CUDA graphs of a step, torch.compile -- is :mod:`patchdsl.training`.)
"""

from .patch import PatchError, PatchHandle, Refusal, UnsupportedDtype, apply, patch_module, placements, unpatch

__all__ = ["PatchError", "PatchHandle", "Refusal", "UnsupportedDtype", "apply", "patch_module", "placements",
           "unpatch"]
