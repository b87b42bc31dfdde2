"""fused_geglu: the elementwise gelu(gate) * up of a gated MLP (Gemma, ...), forward and backward.

Same kernel family and module patching as fused_swiglu (``templates/fused_glu.py.j2``, see
:mod:`patchdsl.ops.swiglu` for the memory, in-place and bias notes); only the activation differs:

* ``approximate=none``: exact GELU, g * Phi(g) with erf;
* ``approximate=tanh``: the tanh approximation (Gemma's ``gelu_pytorch_tanh``), evaluated as
  g * sigmoid(2z) -- the identity 0.5 * (1 + tanh(z)) = sigmoid(2z), so no tanh is called;
* ``approximate=auto`` (default): whichever the module's own activation computes (probed).
"""

from __future__ import annotations

from .base import FlagSpec
from .registry import register
from .swiglu import GLU_FLAGS, FusedGLU


class FusedGeGLU(FusedGLU):
    name = "fused_geglu"
    kinds = ("GeGLU",)
    kind = "GeGLU"
    fn = "geglu"
    cls_name = "GeGLU"
    doc = ("gelu(gate) * up fused (exact erf or tanh approximation), forward and backward; saves gate and up "
           "only (activation recomputed), optionally writes the gradients over them.")
    flags = (
        FlagSpec("approximate", "choice", "auto",
                 "tanh: tanh-approximate GELU; none: exact erf GELU; auto = what the module computes",
                 choices=("tanh", "none"), auto_ok=True),
    ) + GLU_FLAGS

    def activation(self, facts, flags):
        approx = flags.get("approximate", "auto")
        if approx == "auto":
            approx = facts.get("approximate") or ("tanh" if facts.get("activation") == "gelu_tanh" else "none")
        return "gelu_tanh" if approx == "tanh" else "gelu"


register(FusedGeGLU())
