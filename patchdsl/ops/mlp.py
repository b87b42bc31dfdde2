"""fused_mlp: the plain (non-gated) MLP ``down(act(up(x)))``, forward and backward.

Recognised by the ``MLP`` kind (:func:`patchdsl.model.kinds.mlp.mlp_probe`): an up/down projection pair
(``up_proj/down_proj``, ``fc1/fc2``, ``c_fc/c_proj``, ``dense_h_to_4h/dense_4h_to_h``, ...) whose module
forward computes ``down(act(up(x)))``, the activation probed: exact GELU, tanh GELU (``gelu_new``,
``gelu_pytorch_tanh``), ReLU, squared ReLU (Nemotron, Persimmon, Arcee), SiLU, quick GELU.  Any other
activation (Apertus's xIELU) is refused naming it.

The projections stay cuBLAS matmuls.  The up projection is the module's own (bias, LoRA, quantised
layers keep working).  The kernel (``templates/fused_mlp.py.j2``) computes act(h) in fp32 and rounds once
to the input dtype (as the eager activation does); with ``recompute=true`` (default) the down projection
runs inside the op's autograd function, which saves only h = up(x): its backward recomputes act(h) in the
same pass that applies act'(h) (eager PyTorch keeps both h and act(h)).  That needs the down projection
to be a plain ``nn.Linear`` (or GPT-2's ``Conv1D``) with no instance forward and no hooks, read at call
time (FSDP2 per decoder layer has it whole there); any other down projection (PEFT LoRA, fp8_linear, a hook,
a DeepSpeed ZeRO-3 partitioned weight) is called as the module it is, on the kernel's act(h) (then its own
backward keeps act(h)).

Bias: the up projection's bias is added by the up projection itself (cuBLAS adds it in the GEMM's
epilogue, so a Triton pass for it would only cost bandwidth); the down projection's bias is passed to
``F.linear`` and its gradient is a sum over the rows.

Dropout on the output (GPT-2's ``self.dropout``, StarCoder2's ``F.dropout(..., p=residual_dropout)``) is
reproduced by making the same call at the same place, so under one seed it draws the same mask.  Dropout
anywhere else (between the activation and the down projection) is refused with that reason; the op's
check runs the module's own forward in training mode on a stand-in to tell which it is.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op
from ..model.info import ModuleInfo
from .registry import register

FLAT_BLOCK = 1024          # elements per program (the GLU kernels' measured flat layout)
FLAT_WARPS = 4
OUTPUT_DROPOUT_ATTRS = ("residual_dropout",)


class FusedMLP(Op):
    name = "fused_mlp"
    kinds = ("MLP",)
    placements = ()
    template = "fused_mlp.py.j2"
    doc = ("plain (non-gated) MLP down(act(up(x))): the activation (gelu, gelu_tanh, relu, relu2, silu, "
           "quick_gelu) fused; with recompute the down projection runs inside the op, so only up(x) is saved "
           "and act(up(x)) is recomputed in the backward's one elementwise pass; projections stay GEMMs.")
    flags = (
        FlagSpec("recompute", "bool", True,
                 "save only up(x) and recompute act(up(x)) in backward (the down projection runs inside the op; "
                 "needs a plain nn.Linear / Conv1D down projection, else the module is called); false = the "
                 "down projection module keeps act(up(x)) as eager does"),
    )

    # ---- planning ---------------------------------------------------------------
    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        f = info.facts("MLP")
        if f and not f.get("activation"):
            from ..model.kinds.mlp import MLP_ACTIVATIONS
            return (f"{info.path or '<module>'} ({info.cls}): its activation {f.get('act_class') or 'unknown'} is "
                    f"none of the activations fused_mlp computes ({', '.join(MLP_ACTIVATIONS)})")
        return None

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("MLP")
        if not f or not f.get("activation"):
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not an MLP with an activation "
                             f"fused_mlp computes")
        inter, act = int(f["intermediate"]), str(f["activation"])
        return {"dtype": dtype, "intermediate": inter, "hidden": int(f["hidden"]), "activation": act,
                "fn": "mlp", "target": target, "FLAT_BLOCK": FLAT_BLOCK, "num_warps": FLAT_WARPS,
                "tag": f"{act}_i{inter}"}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return "_".join([self.name, params["activation"], params["dtype"], f"i{params['intermediate']}",
                         params["target"]])

    # ---- runtime ----------------------------------------------------------------
    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        where = f"{info.path or '<module>'} ({info.cls})"
        f = info.facts("MLP")
        if not f:
            for other, op in (("SwiGLU", "fused_swiglu"), ("GeGLU", "fused_geglu")):
                if info.facts(other):
                    return f"{where} is a gated {other} MLP; use {op}"
            from ..model.kinds.mlp import mlp_probe
            return f"{where} is not a plain MLP down(act(up(x))): {mlp_probe(module)[1]}"
        why = self.misfit(info, None)
        if why:
            return why
        missing = [n for n in (f["up"], f["down"]) if getattr(module, n, None) is None]
        if missing:
            return f"{where} has no {', '.join(missing)} (the index says it should; was it changed after indexing?)"
        return probe_training(module, f, where)[1]

    def make_forward(self, module, kernels, flags, info):
        """``down(act(up(x)))`` [then the module's output dropout]; see the module doc.  The kernel module is
        picked by up(x)'s dtype; float64 (no kernel) runs the same formula in plain torch.  No host sync."""
        import torch

        from ..model.reference import mlp_activation_reference

        f = info.facts("MLP")
        up, down = f["up"], f["down"]
        recompute = bool(flags.get("recompute", True))
        eager_act = mlp_activation_reference(f["activation"])
        supported = (torch.float32, torch.bfloat16, torch.float16)
        post = probe_training(module, f, "")[0]
        Linear = torch.nn.Linear
        try:
            from transformers.pytorch_utils import Conv1D
        except Exception:  # noqa: BLE001  pragma: no cover - transformers always has it
            Conv1D = ()

        def core(self, x):
            h = getattr(self, up)(x)
            d = getattr(self, down)
            if h.dtype not in supported:
                return d(eager_act(h))
            k = kernels(h.dtype)
            # a plain projection, read here (DeepSpeed ZeRO-3 gathers a weight only inside its own module's
            # forward: a partitioned one, marked ds_id, is left to the module)
            if recompute and (type(d) is Linear or type(d) is Conv1D) and "forward" not in d.__dict__ \
                    and not d._forward_hooks and not d._forward_pre_hooks and not hasattr(d.weight, "ds_id"):
                w = d.weight.t() if type(d) is Conv1D else d.weight
                b = d.bias
                if w.dtype != h.dtype:          # autocast's cast of the weight, as F.linear would make it
                    w = w.to(h.dtype)
                if b is not None and b.dtype != h.dtype:
                    b = b.to(h.dtype)
                return k.mlp_down(h, w, b)
            return d(k.mlp_act(h))

        if post is None:
            def forward(self, x, *args, **kwargs):
                return core(self, x)
        elif post[0] == "module":
            name = post[1]

            def forward(self, x, *args, **kwargs):
                return getattr(self, name)(core(self, x))
        else:
            import torch.nn.functional as F
            attr = post[1]

            def forward(self, x, *args, **kwargs):
                return F.dropout(core(self, x), p=getattr(self, attr), training=self.training)
        return forward


def _post_candidates(module: Any) -> list:
    """What may follow the down projection: an nn.Dropout child (called), a float dropout attribute
    (``F.dropout(out, p=self.<attr>, training=self.training)``), or nothing."""
    import torch

    out: list = [("module", n) for n, c in module._modules.items() if isinstance(c, torch.nn.Dropout)]
    out += [("attr", a) for a in OUTPUT_DROPOUT_ATTRS if isinstance(module.__dict__.get(a), float)]
    return out + [None]


def probe_training(module: Any, facts: Mapping[str, Any], where: str) -> tuple[Any, str | None]:
    """(what follows the down projection, None) if the module's own forward in training mode equals
    ``post(down(act(up(x))))`` under the same seed for one of :func:`_post_candidates`; else (None, why not)."""
    import torch

    from ..model.reference import mlp_activation_reference
    from ..model.kinds.mlp import mlp_stand_in

    with torch.random.fork_rng(devices=[]):      # the stand-in and the dropout draws must not move the caller's RNG
        clone, lu, ld, x = mlp_stand_in(module, facts, training=True)
        try:
            with torch.no_grad():
                torch.manual_seed(11)
                out = type(module).forward(clone, x)
        except Exception as e:  # noqa: BLE001
            return None, f"{where}: could not probe its forward in training mode ({type(e).__name__}: {e})"
        act = mlp_activation_reference(facts["activation"])
        with torch.no_grad():
            base = ld(act(lu(x)))
            for post in _post_candidates(module):
                torch.manual_seed(11)
                if post is None:
                    ref = base
                elif post[0] == "module":
                    ref = clone._modules[post[1]](base)
                else:
                    ref = torch.nn.functional.dropout(base, p=module.__dict__[post[1]], training=True)
                if isinstance(out, torch.Tensor) and out.shape == ref.shape \
                        and torch.allclose(out, ref, rtol=1e-9, atol=1e-12):
                    return post, None
    return None, (f"{where}: its forward is random in training mode where fused_mlp cannot reproduce it "
                  f"(dropout with p > 0 between {facts['up']} and {facts['down']}, or on its input; only a "
                  f"dropout on the output is reproduced); it matches {facts['down']}({facts['activation']}("
                  f"{facts['up']}(x))) only in eval mode; not patched")


register(FusedMLP())
