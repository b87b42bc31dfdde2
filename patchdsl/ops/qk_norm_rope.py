"""fused_qk_norm_rope: per-head q_norm/k_norm (RMSNorm over head_dim) + RoPE in one kernel.

Qwen3 (Llama casting) and Gemma3 (offset 1, Gemma casting) normalise each head of q and k with
their own RMSNorm before the rotation.  This op fuses both norms and the rotation of q and k into
one launch forward and one backward (which also produces q_norm.weight / k_norm.weight grads as
device-side partial sums).  Like fused_rope it replaces the attention module's forward
(:mod:`patchdsl.ops.attention_forward`); it covers the q_norm and k_norm children, whose weights
it reads at call time (``unwrap(self.q_norm).weight``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX
from ..model.info import ModuleInfo
from .common import next_pow2, resolve_auto
from .registry import register
from .rope import ROPE_FLAGS, SUPPORTED_DTYPES, attention_reason, rope_geometry

# q_norm / k_norm are read from the attention's forward, not their own: a sharder that gathers a
# weight only inside its owner's forward must leave these (head_dim elements) whole
NOT_GATHERED_HINT = ("it is read in the attention's forward, where ZeRO-3 does not gather it; keep it persistent "
                     "(stage3_param_persistence_threshold above its size: the default, 100000, is) or leave "
                     "fused_qk_norm_rope out")


def _norm_facts(f: Mapping[str, Any], flags: Mapping[str, Any]) -> tuple[float, float, str]:
    n = f.get("qk_norm") or {}
    eps = flags.get("eps", "auto")
    offset = flags.get("offset", "auto")
    casting = flags.get("casting", "auto")
    eps = float(n.get("eps", 1e-6) if eps == "auto" else eps)
    offset = float(n.get("offset", 0.0) if offset == "auto" else offset)
    casting = n.get("casting", "llama") if casting == "auto" else casting
    return eps, offset, ("llama" if casting == "unknown" else casting)


# H200, bf16, 8x2048 tokens, 16 q / 8 kv heads of 128, fwd+bwd: 4 programs per SM 0.347 ms,
# 16: 0.280 ms, 32: 0.276 ms (and 0.374 vs 0.384 ms at 32 q heads, where 32 was slower).
BWD_PROGRAMS_PER_SM = 16
# Same shape: every kernel in 4-head tiles (2 warps) 0.232 ms vs 0.280 ms with all 16 q heads in one
# tile (4 warps; 8 warps: 0.395 ms); the backward alone in 4-head tiles: 0.222 ms (fwd+bwd).
CUDA_BWD_BLOCK = 256

# Kernel shapes that the kernel sweep of bench/NOTES.md timed against each other (template
# parameters, not user flags; the defaults are the shipped kernels):
#   fwd_layout  per_token: a program per tokens_per_program token(s), each token's heads in tiles of
#               ``block`` elements; block: a program per ``fwd_tokens`` tokens, one 3-D tile of
#               (tokens x all heads x rotary half), cos/sin loaded once per token
#   bwd_layout  per_token: the persistent backward walks its tokens one at a time, heads in tiles of
#               ``bwd_block`` (adding each tile's dW terms across threads every step); block: it walks
#               them ``bwd_tokens`` at a time in one (tokens x all heads x half) tile, the dW terms
#               accumulated in fp32 tiles and reduced once per program
#   bwd_prefetch  block backward only: the next step's loads are issued before this step's arithmetic
#               (software pipelining by hand: twice the loaded values live in registers)
QK_TUNING = {"fwd_layout": "per_token", "fwd_tokens": 1, "bwd_layout": "per_token", "bwd_tokens": 1,
             "bwd_prefetch": False}

# The CUDA backward (H200 sweep, bench/results/h200-2026-12-03-r3run4/qk, 32768 tokens, d128, bf16):
# the block layout, one token x all heads per step, 4 warps, as many programs per SM as fit by
# registers (ptxas -v, bench/NOTES.md): 16 q / 8 kv heads 193.0 us (3 per SM) vs 308.7 shipped before;
# 32 / 8 heads 332.7 us (2 per SM) vs 467.9.  A tile of more than 32 heads of 128 would spill: those
# (and the interpreter) keep the per-token layout.
CUDA_BWD_BLOCK_LAYOUT = {"bwd_layout": "block", "bwd_tokens": 1}
CUDA_BWD_BLOCK_WARPS = 4
BLOCK_MAX_HALF_ELEMS = 32 * 64          # q heads (padded) x rotary half in one tile


def _block_bwd_programs_per_sm(q_heads_pad: int) -> int:
    return 3 if q_heads_pad <= 16 else 2


class FusedQKNormRope(Op):
    name = "fused_qk_norm_rope"
    kinds = ("Attention",)
    template = "fused_qk_norm_rope.py.j2"
    covers = ("q_norm", "k_norm")
    doc = ("Per-head q_norm/k_norm RMSNorm (Qwen3, Gemma3) + RoPE of q and k in one kernel, forward and "
           "backward with norm-weight grads reduced on the device; replaces the attention forward.")
    flags = (
        FlagSpec("eps", "float", "auto", "epsilon of q_norm/k_norm; auto = the modules' own", auto_ok=True, min=0.0),
        FlagSpec("offset", "float", "auto", "norm scale is (offset + w); auto = probed (0 Qwen3, 1 Gemma3)",
                 auto_ok=True),
        FlagSpec("casting", "choice", "auto",
                 "llama: cast then scale; gemma: scale in fp32 then cast; auto = probed from q_norm",
                 choices=("llama", "gemma"), auto_ok=True),
    ) + ROPE_FLAGS + (
        FlagSpec("bwd_programs_per_sm", "int", "auto",
                 "backward: programs per SM of the persistent grid whose per-program fp32 rows hold the "
                 "q_norm/k_norm weight-gradient partial sums; auto = 16 for the per-token backward, 3 (<= 16 q heads) or 2 "
                 "for the CUDA block backward (what fits by registers)", auto_ok=True, min=1, max=64),
        FlagSpec("bwd_block", "int", "auto",
                 "backward tile in elements (heads x rotary_dim/2, power of two), heads looped in tiles of that "
                 "size; auto = 256 on cuda (4 heads of 128, 2 warps: measured faster than all heads in one tile), the "
                 "forward's tile on the interpreter", auto_ok=True, min=16, max=BLOCK_MAX),
        FlagSpec("bwd_warps", "int", "auto", "backward: warps per program; auto = by the backward tile",
                 auto_ok=True, min=1, max=16),
    )

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Attention")
        g = rope_geometry(f, flags, target)
        bwd_block = flags.get("bwd_block", "auto")
        if bwd_block == "auto":
            bwd_block = CUDA_BWD_BLOCK if target != "interpreter" else flags.get("block", "auto")
        gb = rope_geometry(f, {**flags, "block": bwd_block}, target)
        g.update({f"bwd_{k}": gb[k] for k in ("q_block_heads", "q_loop", "q_head_mask",
                                              "k_block_heads", "k_loop", "k_head_mask")})
        eps, offset, casting = _norm_facts(f, flags)
        tag = f"d{g['head_dim']}_r{g['rotary_dim']}_q{g['n_q_heads']}k{g['n_kv_heads']}_{casting}"
        q_pad = next_pow2(g["n_q_heads"])
        tuning, pps, warps = dict(QK_TUNING), BWD_PROGRAMS_PER_SM, gb["num_warps"]
        if (target != "interpreter" and flags.get("bwd_block", "auto") == "auto"
                and q_pad * (g["rotary_dim"] // 2) <= BLOCK_MAX_HALF_ELEMS):
            tuning.update(CUDA_BWD_BLOCK_LAYOUT)
            pps, warps = _block_bwd_programs_per_sm(q_pad), CUDA_BWD_BLOCK_WARPS
        out_cast = f.get("rotary_out_dtype") == "input"
        if out_cast:
            tag += "_cast"
        return {"dtype": dtype, **g, "eps": eps, "offset": offset, "casting": casting, "out_cast": out_cast, **tuning,
                "q_heads_pad": q_pad, "k_heads_pad": next_pow2(g["n_kv_heads"]),
                "bwd_programs_per_sm": int(resolve_auto(flags, "bwd_programs_per_sm", pps)),
                "bwd_warps": int(resolve_auto(flags, "bwd_warps", warps)), "target": target, "tag": tag}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return f"{self.name}_{params['dtype']}_{params['tag']}_{params['target']}"

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        from ..model.forward.attention import analyse
        from .attention_forward import probe
        from ..model.reference import reference_rmsnorm, reference_rope
        from ..model.kinds.norms import rmsnorm
        from ..model.modules import unwrap

        f = info.facts("Attention")
        reason = attention_reason(f)
        if reason:
            return reason
        if "qk_norm" not in f:
            return "no q_norm/k_norm RMSNorms over head_dim to fuse (use fused_rope)"
        if f.get("rotary_layout", "rotate_half") != "rotate_half":
            return (f"its rotary layout is {f['rotary_layout']}; fused_qk_norm_rope computes the rotate_half "
                    f"layout only (use fused_rope)")
        an = analyse(type(module))
        if isinstance(an, str):
            return an
        if not an.qk_norm:
            return f"{type(module).__name__}.forward does not call self.q_norm/self.k_norm"
        fq, fk = rmsnorm(unwrap(module.q_norm)), rmsnorm(unwrap(module.k_norm))
        if not fq or not fk:
            return "q_norm/k_norm are not RMSNorms"
        if (fq["eps"], fq["offset"], fq["casting"]) != (fk["eps"], fk["offset"], fk["casting"]) \
                and all(flags.get(n, "auto") == "auto" for n in ("eps", "offset", "casting")):
            return "q_norm and k_norm differ in eps, offset or casting; set the flags explicitly"
        if f["qk_norm"]["casting"] == "unknown" and flags.get("casting", "auto") == "auto":
            return "q_norm's forward matches neither the Llama nor the Gemma cast order; set casting= explicitly"

        # The stand-in comparison checks the STRUCTURE (where the norms and the rotation sit), so
        # its reference uses the stand-in's own norms' facts; eps/offset/casting flags are the
        # user's deliberate overrides and are not second-guessed here.
        def qk_ref(self, q, k, cos, sin):
            out = []
            for x, norm in ((q, unwrap(self.q_norm)), (k, unwrap(self.k_norm))):
                nf = rmsnorm(norm)
                if not nf:
                    raise ValueError("the stand-in's q_norm/k_norm are not RMSNorms")
                out.append(reference_rmsnorm(x, norm.weight, nf["eps"], nf["offset"], nf["casting"]))
            return reference_rope(out[0], out[1], cos, sin)

        return probe(module, dict(f), an, qk_ref, "qk_norm_rope")

    def make_forward(self, module, kernels, flags, info):
        from ..model.forward.attention import analyse
        from .attention_forward import build_forward
        from ..model.reference import reference_rmsnorm, reference_rope
        from ..model.modules import unwrap
        from .loss_path import unsharded_reason

        an = analyse(type(module))
        if isinstance(an, str):
            raise ValueError(f"fused_qk_norm_rope cannot patch {type(module).__name__}: {an}")
        eps, offset, casting = _norm_facts(info.facts("Attention"), flags)
        out_cast = info.facts("Attention").get("rotary_out_dtype") == "input"

        def qk(self, q, k, cos, sin):
            wq, wk = unwrap(self.q_norm).weight, unwrap(self.k_norm).weight
            for name, w in (("q_norm", wq), ("k_norm", wk)):
                why = unsharded_reason(w, f"{name}.weight", NOT_GATHERED_HINT)
                if why:       # never launch a kernel on a partition (it would read out of bounds)
                    raise RuntimeError(f"fused_qk_norm_rope: {why}")
            if cos.requires_grad or sin.requires_grad or str(q.dtype) not in SUPPORTED_DTYPES or q.dtype != k.dtype:
                # learned cos/sin or an unsupported dtype: the same arithmetic in plain torch
                nq, nk = reference_rmsnorm(q, wq, eps, offset, casting), reference_rmsnorm(k, wk, eps, offset, casting)
                qo, ko = reference_rope(nq, nk, cos, sin)
                return (qo.to(nq.dtype), ko.to(nk.dtype)) if out_cast else (qo, ko)
            return kernels(q.dtype).qk_norm_rope(q, k, wq, wk, cos, sin)

        return build_forward(an, qk)


register(FusedQKNormRope())
