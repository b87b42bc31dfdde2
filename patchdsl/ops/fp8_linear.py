"""fp8_linear: a projection (nn.Linear) whose three matmuls run in fp8 with dynamic scales.

``*.mlp.{gate_proj,up_proj,down_proj}, *.self_attn.{q_proj,k_proj,v_proj,o_proj}: Linear -> fp8_linear(recipe=rowwise)``

Recipes (the scaling of torchao.float8's training recipes of the same names):

* ``tensorwise``: one scale per tensor (amax / fp8 max), activations and weights in e4m3, the
  output gradient in e5m2 (more range, one mantissa bit less).
* ``rowwise``: one scale per row of each operand along the matmul's reduction dimension (for the
  forward: per token of x, per output channel of W; the backward re-quantises along its own
  reduction dimensions), every operand in e4m3, scales rounded down to powers of two.
* ``rowwise_with_gw_hp``: ``rowwise`` for the forward and grad_input; grad_weight (dW = dy^T x, a
  reduction over every token) in the model's own dtype, as torchao's recipe of that name: the
  accuracy recipe, one matmul of three left in bf16.

Forward and backward call ``torch._scaled_mm`` (fp8 tensor cores: compute capability >= 8.9, i.e.
Hopper/Ada).  Where fp8 matmuls cannot run the op is refused at plan time, naming the site:
the Triton interpreter / CPU, a GPU below sm_89, a torch without ``_scaled_mm``.  ``emulate=true``
runs the same quantisation and an fp32 matmul of the dequantised fp8 values instead (CPU, tests,
older GPUs: numerics of the recipe, not its speed).

Not bit-exact by nature: ``verify`` judges fp8 sites with :func:`tolerance_floor` (the recipe's
bound) instead of the dtype's floor.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import DTYPE_FLOORS, FlagSpec, Op
from ..model.info import ModuleInfo
from .registry import register

# Unit roundoff (half the spacing at 1) of the fp8 formats: e4m3 has 3 mantissa bits, e5m2 has 2.
UNIT_ROUNDOFF = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
# (input, weight, grad_output) formats of each recipe (torchao.float8's recipes of the same names)
RECIPES = {"rowwise": ("e4m3", "e4m3", "e4m3"), "tensorwise": ("e4m3", "e4m3", "e5m2"),
           "rowwise_with_gw_hp": ("e4m3", "e4m3", "e4m3")}
# each recipe's scaling: "rowwise" (a power-of-two scale per row along each matmul's reduction
# dimension) or "tensorwise" (one scale per tensor)
SCALING = {"rowwise": "rowwise", "tensorwise": "tensorwise", "rowwise_with_gw_hp": "rowwise"}
# recipes whose grad_weight matmul (dy^T x) runs in the model's dtype, not in fp8
HP_GRAD_WEIGHT = frozenset({"rowwise_with_gw_hp"})
MIN_CAPABILITY = (8, 9)
ALIGN = 16          # torch._scaled_mm: both dimensions of the weight multiples of 16


def tolerance_floor(recipe: str, dtype: str) -> float:
    """verify's floor for an fp8 site: twice the worst-case relative rounding of the two fp8
    operands of its least precise matmul, 2 (u_a + u_b + u_a u_b), plus the dtype's own floor.

    Per element, an fp8 product's error is at most (u_a + u_b + u_a u_b) sum_k |a_k b_k| (plus
    subnormal terms), and on verify's random inputs the rounding errors add up like a random walk,
    so the relative Frobenius error measured is ~0.3-0.4 of that (e4m3 x e4m3: ~0.05); the factor 2
    leaves room for cancellation in sum_k a_k b_k.  A wrong scale, a dropped dequantisation or a
    transposed operand is off by O(1).  e4m3 x e4m3: 0.254 + floor; e5m2 x e4m3: 0.383 + floor.
    A recipe that keeps grad_weight in high precision leaves out that matmul's pair (dy, x)."""
    fmts = RECIPES[recipe]
    pairs = [(fmts[0], fmts[1]), (fmts[2], fmts[1])] + ([] if recipe in HP_GRAD_WEIGHT else [(fmts[2], fmts[0])])
    worst = 0.0
    for a, b in pairs:
        ua, ub = UNIT_ROUNDOFF[a], UNIT_ROUNDOFF[b]
        worst = max(worst, ua + ub + ua * ub)
    return 2.0 * worst + DTYPE_FLOORS.get(dtype, 0.0)


def fp8_unavailable(target: str, emulate: bool) -> str | None:
    """Why fp8 matmuls cannot run here (None if they can, or if emulated)."""
    if emulate:
        return None
    fix = "; fp8_linear(emulate=true) runs the recipe's numerics without fp8 matmuls (slow: tests only)"
    if target != "cuda":
        return ("fp8 matmuls need a CUDA GPU with fp8 tensor cores (compute capability >= 8.9: Hopper, Ada); "
                "this plan targets the Triton interpreter (no GPU)" + fix)
    import torch

    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm / float8 dtypes" + fix
    if not torch.cuda.is_available():
        return "fp8 matmuls need a CUDA GPU with compute capability >= 8.9, and none is visible" + fix
    cap = tuple(torch.cuda.get_device_capability())
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return (f"fp8 matmuls need compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Hopper, Ada); "
                f"this GPU ({name}) is {cap[0]}.{cap[1]}" + fix)
    return None


class FP8Linear(Op):
    name = "fp8_linear"
    kinds = ("Linear",)
    placements = ()          # its scales are per tensor: a shard would need the whole tensor's amax
    template = "fp8_linear.py.j2"
    triton_kernels = True        # the rowwise quantisation kernels (tensorwise: torch ops and torch._scaled_mm only)
    doc = ("a projection's forward and backward matmuls in fp8 (torch._scaled_mm) with dynamic tensorwise or rowwise "
           "scales; refused where fp8 matmuls cannot run; verify judges it against the recipe's bound")
    flags = (
        FlagSpec("recipe", "choice", "rowwise", "tensorwise: one scale per tensor, grads in e5m2; rowwise: a scale "
                 "per row along each matmul's reduction dimension, all e4m3, power-of-two scales; rowwise_with_gw_hp: "
                 "rowwise with grad_weight in the model's dtype (the accuracy recipe)",
                 choices=tuple(RECIPES)),
        FlagSpec("emulate", "bool", False, "run the quantisation with an fp32 matmul of the dequantised fp8 values "
                 "instead of fp8 matmuls (CPU / older GPUs: the recipe's numerics, not its speed)"),
    )
    positional = ("recipe",)

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Linear")
        if not f:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not a Linear")
        recipe = flags.get("recipe", "rowwise")
        return {"dtype": dtype, "in_features": int(f["in_features"]), "out_features": int(f["out_features"]),
                "bias": bool(f["bias"]), "recipe": recipe, "formats": "_".join(RECIPES[recipe]),
                "scaling": SCALING[recipe],
                "hp_grad_weight": recipe in HP_GRAD_WEIGHT,
                "emulate": bool(flags.get("emulate", False)), "target": target}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        emu = "_emulated" if params["emulate"] else ""
        return (f"{self.name}_{params['recipe']}_{params['dtype']}_k{params['in_features']}_n{params['out_features']}"
                f"{emu}_{params['target']}")

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        f = info.facts("Linear")
        bad = [f"{n}={f[n]}" for n in ("in_features", "out_features") if f and int(f[n]) % ALIGN]
        if bad:
            return (f"fp8 matmuls (torch._scaled_mm) need both weight dimensions to be multiples of {ALIGN}: "
                    f"{', '.join(bad)}; leave this projection in bf16")
        return None

    def unavailable(self, params: Mapping[str, Any]) -> str | None:
        return fp8_unavailable(params["target"], bool(params["emulate"]))

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        import torch

        if not isinstance(module, torch.nn.Linear):
            return f"{type(module).__name__} is not a plain nn.Linear (a LoRA delta or a quantised layer would be missed)"
        return self.misfit(info, None)

    def make_forward(self, module, kernels, flags, info):
        import torch

        supported = (torch.float32, torch.bfloat16, torch.float16)

        def forward(self, x, *args, **kwargs):
            if x.dtype not in supported or self.weight.dtype != x.dtype:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            return kernels(x.dtype).fp8_linear(x, self.weight, self.bias)

        return forward

    def parity_floor(self, flags: Mapping[str, Any], dtype: str) -> float | None:
        """verify's floor for this op's sites (None: the dtype's)."""
        return tolerance_floor(flags.get("recipe", "rowwise"), dtype)


register(FP8Linear())
