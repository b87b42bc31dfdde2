"""fused_swiglu: the elementwise silu(gate) * up of a gated MLP, forward and backward.

The matmuls stay in cuBLAS: the patched forward calls the module's own projection modules
(``gate_proj`` / ``up_proj``, or Phi-3's ``gate_up_proj``, and ``down_proj``), so bias, PEFT LoRA
and quantised linears all keep working; only ``act(gate) * up`` between them is replaced by the
generated kernel (``templates/fused_glu.py.j2``, shared with fused_geglu).

Memory: eager PyTorch keeps gate, up and act(gate) for backward; the fused op keeps gate and up
(or the one gate_up buffer) and recomputes the activation.  With ``in_place=true`` (default) the
backward also writes d_gate / d_up over those saved buffers instead of allocating new ones.  That
is safe because the buffers are the fresh outputs of the projection modules, passed to nothing
but the kernel: nn.Linear (and PEFT's LoRA, which adds its delta to the base output) saves its
INPUT and weight for backward, never its output.  The kernel's autograd function further refuses
to overwrite a leaf tensor, a view, or a buffer it had to copy, and raises if a retained graph
runs the backward a second time.  Caveat, documented: a forward hook on a projection module that
keeps its output tensor will see it overwritten after backward; set ``in_place=false`` then.

Bias: a projection with bias is accepted.  The bias is applied by the projection module itself,
before the kernel, so the result is exact; nothing in the kernel assumes bias-free projections.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX
from ..model.info import ModuleInfo
from .registry import register
from .common import next_pow2, row_block

# Largest single-pass block on the GPU; longer rows loop over tiles of CUDA_LOOP_BLOCK.  Measured on
# an H200 (bf16, 50M elements): every choice from 1024 to 8192 is within ~3% of torch.mul's
# bandwidth; 4096 / 8 warps was best for I = 3072, 8192 and 14336.
CUDA_MAX_BLOCK = 4096
CUDA_LOOP_BLOCK = 4096
# Elements one program should cover when rows are short (several rows per program).
CUDA_TILE = 4096
INTERP_TILE = 1024

def glu_config(inter: int, target: str, block: Any = "auto") -> dict[str, Any]:
    """BLOCK, single pass or loop, rows per program and warps for rows of ``inter`` elements."""
    if block != "auto":
        b = next_pow2(int(block))
        single = b >= inter
    elif target == "interpreter":
        b, single = row_block(inter, target)
    else:
        b = next_pow2(inter)
        single = b <= CUDA_MAX_BLOCK
        if not single:
            b = CUDA_LOOP_BLOCK
    tile = INTERP_TILE if target == "interpreter" else CUDA_TILE
    rows = max(1, min(32, tile // b)) if single else 1
    warps = max(1, min(8, (rows * b) // 512))
    return {"BLOCK": b, "single_pass": single, "n_tiles": -(-inter // b), "ROWS": rows, "num_warps": warps,
            **GLU_TUNING}


# Kernel choices the kernel sweep of bench/NOTES.md timed against each other (template parameters, not user
# flags; the defaults are the measured best so far):
#   glu_layout  rows: a program per row (tile) of the intermediate size, as above;
#               flat: separate gate/up only -- the row-contiguous tensors as one flat array,
#               FLAT_BLOCK elements per program, masked only at the end (what Inductor generates)
#   evict       evict_first on the streamed loads
# H200 sweep (bench/results/h200-2026-12-03-r3run2, kern_sweep): flat 1024/4 warps 422.3 us vs rows 429.1 at
# GeGLU 16384x6912 (the floor at its read:write mix 425.1), 191.9 vs 192.9 at SwiGLU 16384x3072 (= torch.compile).
GLU_TUNING = {"glu_layout": "flat", "FLAT_BLOCK": 1024, "evict": False}
FLAT_WARPS = 4          # warps of a flat program (the rows layout keeps glu_config's choice)


class FusedGLU(Op):
    """Shared by fused_swiglu and fused_geglu; subclasses set the kind and how to pick the activation."""

    template = "fused_glu.py.j2"
    placements = ("columns",)
    kind: str = ""
    fn: str = ""       # name of the generated entry point: swiglu / geglu
    cls_name: str = ""

    def activation(self, facts: Mapping[str, Any], flags: Mapping[str, Any]) -> str:
        raise NotImplementedError

    # ---- planning ---------------------------------------------------------------
    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts(self.kind)
        if not f:
            raise ValueError(f"{self.name}: {info.path or '<module>'} ({info.cls}) is not a {self.kind} MLP")
        inter = int(f["intermediate"])
        act = self.activation(f, flags)
        cfg = glu_config(inter, target, flags.get("block", "auto"))
        fused = bool(f["fused_gate_up"])
        if flags.get("block", "auto") != "auto":
            cfg["glu_layout"] = "rows"          # an explicit row tile asks for the rows layout
        elif cfg["glu_layout"] == "flat" and not fused:
            cfg["num_warps"] = FLAT_WARPS
        return {
            "dtype": dtype, "intermediate": inter, "hidden": int(f["hidden"]), "activation": act,
            "fused_gate_up": fused, "fn": self.fn, "cls": self.cls_name, "target": target,
            "tag": f"{act}_mul_i{inter}" + ("_gate_up" if fused else ""), **cfg,
        }

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        parts = [self.name, params["activation"], params["dtype"], f"i{params['intermediate']}"]
        if params["fused_gate_up"]:
            parts.append("gate_up")
        parts.append(params["target"])
        return "_".join(parts)

    # ---- runtime ----------------------------------------------------------------
    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        where = f"{info.path or '<module>'} ({info.cls})"
        f = info.facts(self.kind)
        if not f:
            for other in ("SwiGLU", "GeGLU"):
                g = info.facts(other)
                if g and other != self.kind:
                    better = "fused_geglu" if other == "GeGLU" else "fused_swiglu"
                    return (f"{where} computes {g['activation']}(gate) * up, a {other} MLP, not {self.kind}; "
                            f"use {better}")
            return (f"{where} is not a {self.kind} MLP (needs gate_proj + up_proj or gate_up_proj, down_proj "
                    f"and an act_fn / activation_fn computing {self.kind_activation_text()})")
        names = ("gate_up_proj", "down_proj") if f["fused_gate_up"] else glu_names(f)
        missing = [n for n in names if getattr(module, n, None) is None]
        if missing:
            return f"{where} has no {', '.join(missing)} (the index says it should; was it changed after indexing?)"
        # The probe checks the module against the activation it was recognised with; a GeGLU
        # approximate= override then deliberately changes only the kernel's formula.
        return probe_forward(module, f, f["activation"], where)

    def kind_activation_text(self) -> str:
        return "silu" if self.kind == "SwiGLU" else "gelu"

    def make_forward(self, module, kernels, flags, info):
        """``down_proj(glu(gate_proj(x), up_proj(x)))`` or ``down_proj(glu(gate_up_proj(x)))``.

        The projection MODULES are called (never their weights read), so bias, PEFT LoRA and
        quantised layers behave as in the original forward.  The kernel module is picked by the
        projections' output dtype (autocast gives bf16 there for fp32 inputs); a dtype without a
        kernel (float64) falls back to the same formula in plain torch.  No host sync.
        """
        import torch

        f = info.facts(self.kind)
        in_place = bool(flags.get("in_place", True))
        supported = (torch.float32, torch.bfloat16, torch.float16)
        eager_act = _reference_activation(self.activation(f, flags))
        if output_dropout(module):
            return self._with_output_dropout(module, kernels, flags, info)

        if f["fused_gate_up"]:
            def forward(self, x, *args, **kwargs):
                gu = self.gate_up_proj(x)
                if gu.dtype not in supported:
                    gate, up = gu.chunk(2, dim=-1)
                    return self.down_proj(eager_act(gate) * up)
                return self.down_proj(kernels(gu.dtype).glu(gu, in_place=in_place))
        elif glu_names(f) != DEFAULT_GLU_NAMES:
            # other child names (LFM2's / Mixtral's w1 = gate, w3 = up, w2 = down): the same, by name
            gn, un, dn = glu_names(f)

            def forward(self, x, *args, **kwargs):
                gate = getattr(self, gn)(x)
                up = getattr(self, un)(x)
                if gate.dtype != up.dtype:
                    dt = torch.promote_types(gate.dtype, up.dtype)
                    gate, up = gate.to(dt), up.to(dt)
                if gate.dtype not in supported:
                    return getattr(self, dn)(eager_act(gate) * up)
                return getattr(self, dn)(kernels(gate.dtype).glu(gate, up, in_place=in_place))
        else:
            def forward(self, x, *args, **kwargs):
                gate = self.gate_proj(x)
                up = self.up_proj(x)
                if gate.dtype != up.dtype:       # e.g. one projection wrapped in an fp32 adapter
                    dt = torch.promote_types(gate.dtype, up.dtype)
                    gate, up = gate.to(dt), up.to(dt)
                if gate.dtype not in supported:
                    return self.down_proj(eager_act(gate) * up)
                return self.down_proj(kernels(gate.dtype).glu(gate, up, in_place=in_place))

        return forward


    def _with_output_dropout(self, module, kernels, flags, info):
        """The forward of an MLP that ends in ``F.dropout(out, p=self.<attr>, training=self.training)``
        (Seed-OSS): the plain forward, then the same dropout call at the same place (same RNG draws)."""
        import torch.nn.functional as F

        plain = self.make_forward(_NoDropout(module), kernels, flags, info)
        attr = next(a for a in OUTPUT_DROPOUT_ATTRS if isinstance(getattr(module, a, None), float))

        def forward(self, x, *args, **kwargs):
            return F.dropout(plain(self, x, *args, **kwargs), p=getattr(self, attr), training=self.training)

        return forward


class _NoDropout:
    """``module`` as make_forward sees it, minus its output dropout (so the plain forward is built)."""

    def __init__(self, module):
        self._m = module

    def __getattr__(self, name):
        if name in OUTPUT_DROPOUT_ATTRS:
            return 0.0
        return getattr(self._m, name)


DEFAULT_GLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def glu_names(facts: Mapping[str, Any]) -> tuple[str, str, str]:
    """(gate, up, down) child names of a separate-projection gated MLP (the kind's ``names`` fact)."""
    n = facts.get("names")
    return tuple(n) if n else DEFAULT_GLU_NAMES


def _reference_activation(name: str):
    import torch.nn.functional as F

    return {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[name]


def probe_forward(module: Any, facts: Mapping[str, Any], activation: str, where: str) -> str | None:
    """Run the module's own class ``forward`` on a tiny float64 stand-in (its projections replaced by
    small random Linears, everything else kept) and compare with down(act(gate(x)) * up(x)).

    Catches what the structural recogniser cannot see: an MLP whose forward swaps gate and up,
    chunks gate_up the other way round, adds dropout or scaling, or uses another activation.
    Returns None if it matches, else the reason.  Never touches the module's own tensors.
    """
    import torch

    with torch.random.fork_rng(devices=[]):    # building Linears and a dropout must not move the caller's RNG
        return _probe(module, facts, activation, where)


def _probe(module: Any, facts: Mapping[str, Any], activation: str, where: str) -> str | None:
    import torch

    from ..model.kinds.probe import stand_in

    g = torch.Generator().manual_seed(7)
    h, i = 8, 12
    fused = bool(facts["fused_gate_up"])
    gn, un, dn = ("gate_proj", "up_proj", "down_proj") if fused else glu_names(facts)

    def lin(n_in, n_out, bias):
        m = torch.nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)
        with torch.no_grad():
            m.weight.copy_(torch.randn(n_out, n_in, generator=g, dtype=torch.float64) / n_in ** 0.5)
            if bias:
                m.bias.copy_(torch.randn(n_out, generator=g, dtype=torch.float64) * 0.1)
        return m

    def has_bias(name):
        from ..model.modules import linear_like
        lin_ = linear_like(getattr(module, name, None))
        return lin_ is not None and lin_.bias is not None

    # The stand-in and shallow copies of its other children (the activation, a dropout, ...) run in
    # training mode, the mode the patched forward will replace: a dropout with p > 0 that the
    # fused forward would skip makes the outputs differ.  Nothing of ``module`` is mutated.
    clone = stand_in(module, training=True)
    for k, v in module._modules.items():
        if k not in (gn, un, "gate_up_proj", dn) and v is not None:
            c = copy.copy(v)
            c.__dict__["training"] = True
            clone._modules[k] = c
    projs = {dn: lin(i, h, has_bias(dn))}
    if fused:
        projs["gate_up_proj"] = lin(h, 2 * i, has_bias("gate_up_proj"))
    else:
        projs[gn] = lin(h, i, has_bias(gn))
        projs[un] = lin(h, i, has_bias(un))
    clone._modules.update(projs)
    x = torch.randn(3, h, generator=g, dtype=torch.float64)
    p_drop = output_dropout(module)
    try:
        with torch.no_grad():
            torch.manual_seed(11)
            out = type(module).forward(clone, x)
    except Exception as e:  # a forward that needs more than (x) or real sizes
        return f"{where}: could not probe its forward on a small stand-in ({type(e).__name__}: {e})"
    act = _reference_activation(activation)
    with torch.no_grad():
        if fused:
            gate, up = projs["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            gate, up = projs[gn](x), projs[un](x)
        ref = projs[dn](act(gate) * up)
        if p_drop:
            # dropout on the output (Seed-OSS's residual_dropout): the replacement makes the same
            # F.dropout call at the same place, so under the same seed it draws the same mask
            torch.manual_seed(11)
            ref = torch.nn.functional.dropout(ref, p=p_drop, training=True)

    def same(a):
        return isinstance(a, torch.Tensor) and a.shape == ref.shape and torch.allclose(a, ref, rtol=1e-9, atol=1e-12)

    if not same(out):
        layout = "gate_up_proj(x) split gate-first" if fused else f"{gn}(x), {un}(x)"
        # the true reason when only training mode differs: randomness (dropout) the op does not reproduce
        clone.__dict__["training"] = False
        for c in clone._modules.values():
            if c is not None:
                c.__dict__["training"] = False
        try:
            with torch.no_grad():
                ev = type(module).forward(clone, x)
        except Exception:  # noqa: BLE001
            ev = None
        if not p_drop and isinstance(ev, torch.Tensor) and ev.shape == ref.shape \
                and torch.allclose(ev, ref, rtol=1e-9, atol=1e-12):
            return (f"{where}: its forward does not compute down_proj({activation}(gate) * up) in training mode: "
                    f"it is random there (dropout with p > 0 somewhere other than an output-dropout attribute "
                    f"the op reproduces) and matches only in eval mode; not patched")
        return (f"{where}: its forward does not compute down_proj({activation}(gate) * up) with "
                f"{layout}" + (f" followed by dropout(p={p_drop})" if p_drop else "") + "; not patched")
    return None


# float attributes an MLP's forward uses as dropout on its output (Seed-OSS: residual_dropout)
OUTPUT_DROPOUT_ATTRS = ("residual_dropout",)


def output_dropout(module: Any) -> float:
    """p of the dropout the MLP applies to its output (``F.dropout(down, p=self.residual_dropout,
    training=self.training)``), 0.0 when it has none; the probe checks that this is what the forward does."""
    for a in OUTPUT_DROPOUT_ATTRS:
        v = getattr(module, a, None)
        if isinstance(v, float) and v > 0:
            return v
    return 0.0


GLU_FLAGS = (
    FlagSpec("in_place", "bool", True,
             "backward writes d_gate/d_up over the saved projection outputs (no allocation); "
             "false if a hook keeps those outputs"),
    FlagSpec("block", "int", "auto", "row tile in elements (rounded up to a power of two); giving it selects the "
             "row layout (a program per row tile); auto = the flat layout (separate gate/up: 1024 elements per "
             "program) or a row tile by intermediate size (fused gate_up)", auto_ok=True, min=16, max=BLOCK_MAX),
)


class FusedSwiGLU(FusedGLU):
    name = "fused_swiglu"
    kinds = ("SwiGLU",)
    kind = "SwiGLU"
    fn = "swiglu"
    cls_name = "SwiGLU"
    doc = ("silu(gate) * up fused, forward and backward; saves gate and up only (activation recomputed), "
           "optionally writes the gradients over them; projections stay the module's own (cuBLAS, LoRA ok).")
    flags = GLU_FLAGS

    def activation(self, facts, flags):
        return "silu"


register(FusedSwiGLU())
