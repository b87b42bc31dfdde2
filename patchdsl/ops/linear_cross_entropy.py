"""fused_linear_cross_entropy: LM head + causal-LM loss without materialising the logits.

Selected on ``lm_head`` (kind Linear); replaces the forward of the causal LM that owns it
(see :mod:`patchdsl.ops.loss_path`).  Two modes (flag ``mode``):

* ``chunked``: tokens are processed in chunks: a matmul gives the chunk's logits, a Triton kernel
  turns them into d(loss)/d(logits) in place, two more matmuls give the chunk's grad_hidden and add
  its share of grad_weight (3 matmul-equivalents, one (chunk, vocab) logits buffer);
* ``fused``: the logits never reach memory.  The forward is one Triton matmul whose tiles keep
  the online max / sum-exp and the target logit (softmax statistics -> logsumexp, loss); the
  backward recomputes the logits one vocab band at a time in a Triton matmul whose epilogue turns
  them into d(loss)/d(logits) for the band (a buffer of <= 32 MiB), and two cuBLAS matmuls give the
  band's grad_weight rows (written once) and its share of grad_hidden (fp32 accumulation):
  4 matmul-equivalents, bounded extra memory (the template's docstring has the arithmetic).
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, CHUNK_MAX, SIZE_MAX
from ..model.info import ModuleInfo
from .cross_entropy import LOSS_FLAGS, ce_block, loss_kernel_name, loss_params, num_tag
from .registry import register
from ..util.vocab import DTYPE_BYTES

# Auto chunk on the GPU: the largest power-of-two token count whose logits fit this many bytes.
# H200, bf16, 16384 x 1024 x 151936, fwd+bwd: 208 tokens (64 MB) 42.2 ms, 512 30.1 ms, 1024 27.5 ms,
# 2048 25.9 ms: small chunks re-read W and re-write grad_W (bf16, 311 MB) once per chunk.
CHUNK_BUDGET = 640 * 2**20
FP32_ACC_BUDGET = 64 * 2**20  # an fp32 copy of grad_weight is kept when it is at most this big
INTERP_CHUNK = 16             # tokens per chunk on the interpreter (small, so tests see several chunks)
MAX_CHUNK = 8192


def auto_chunk(vocab: int, dtype: str, target: str) -> int:
    if target == "interpreter":
        return INTERP_CHUNK
    rows = CHUNK_BUDGET // (vocab * DTYPE_BYTES.get(dtype, 4))
    chunk = 16
    while chunk * 2 <= min(rows, MAX_CHUNK):
        chunk *= 2
    return chunk


# The chunking flags of every op that runs the LM head chunk by chunk (linear CE, linear log-probs).
CHUNK_FLAGS = (
    FlagSpec("chunk", "int", "auto", "tokens per chunk; auto = the largest power of two whose logits "
             "fit 640 MiB on the GPU (2048 at vocab 151,936 in bf16)", auto_ok=True, min=1, max=CHUNK_MAX),
    FlagSpec("accumulate", "choice", "auto",
             "grad_weight accumulation across chunks: fp32 (an fp32 copy of grad_weight) or weight "
             "(the weight's dtype, in place); auto = fp32 when that copy is <= 64 MB",
             choices=("fp32", "weight"), auto_ok=True),
)


# ---- fused mode ------------------------------------------------------------------------------
# Tile choices of the two fused kernels (the forward statistics and the backward band): BLOCK_M
# tokens x BLOCK_N vocab entries per program, BLOCK_K hidden per step, warps, pipeline stages.
# the tile sweep of bench/NOTES.md (script removed; results in bench/results/) timed every one of them on the GPU; auto picks the DEFAULT_TILE of the dtype.
FUSED_TILES = {
    "m128n256k64w8s3": (128, 256, 64, 8, 3),
    "m128n256k64w8s4": (128, 256, 64, 8, 4),
    "m256n128k64w8s3": (256, 128, 64, 8, 3),
    "m128n128k64w8s4": (128, 128, 64, 8, 4),
    "m128n128k64w4s4": (128, 128, 64, 4, 4),
    "m128n128k128w8s3": (128, 128, 128, 8, 3),
    "m64n256k64w4s4": (64, 256, 64, 4, 4),
    "m64n128k64w4s4": (64, 128, 64, 4, 4),
    "m64n64k32w4s3": (64, 64, 32, 4, 3),          # fp32 (IEEE dot: bigger tiles spill)
    "m32n32k16w4s1": (32, 32, 16, 4, 1),          # the interpreter (small, so tests see ragged edges)
}
DEFAULT_TILE = {"bf16": "m128n256k64w8s3", "fp16": "m128n256k64w8s3", "fp32": "m64n64k32w4s3"}
INTERP_TILE = "m32n32k16w4s1"
EXTRA_BUDGET = 64 * 2**20     # extra bytes the fused backward stays within (band + fp32 grad_h excess + stats)
INTERP_BAND = 2               # vocab tiles per band on the interpreter (tests see several bands)

FUSED_FLAGS = (
    FlagSpec("mode", "choice", "auto",
             "chunked: token chunks with their logits in memory (cuBLAS, 3 matmuls); fused: the logits "
             "never reach memory (softmax statistics in the matmul's tiles, 4 matmuls, <= 64 MiB extra); "
             "auto = chunked (faster at the Qwen3 head when 594 MiB are available)",
             choices=("chunked", "fused"), auto_ok=True),
    # str, not choice: a tile is a launch choice for the tile sweep (bench/NOTES.md), not a mode
    # every compile test should build; `validate` names the known tiles
    FlagSpec("tile", "str", "auto", "fused mode: tile of the forward statistics kernel, one of FUSED_TILES "
             "(m<BLOCK_M>n<BLOCK_N>k<BLOCK_K>w<warps>s<stages>, e.g. m128n256k64w8s3); auto = by dtype",
             auto_ok=True),
    FlagSpec("grad_tile", "str", "auto", "fused mode: tile of the backward band kernel (as tile)", auto_ok=True),
    FlagSpec("flatten", "bool", False, "fused mode: the forward kernel's vocab and hidden loops as one "
             "pipelined loop (tl.range(flatten=True)); measured by the tile sweep (bench/NOTES.md)"),
    FlagSpec("band", "int", "auto", "fused mode: vocab columns per backward band (rounded to the tile); "
             "auto = the most that keep the backward's extra memory within 64 MiB at the call's token count", auto_ok=True, min=1,
             max=SIZE_MAX),
)


def fused_params(flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
    """The fused mode's key parameters: mode, both tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), band."""
    mode = flags.get("mode", "auto")
    mode = "chunked" if mode == "auto" else mode
    out: dict[str, Any] = {"mode": mode}
    if mode != "fused":
        return out
    for flag, prefix in (("tile", "fwd"), ("grad_tile", "bwd")):
        name = flags.get(flag, "auto")
        if name == "auto":
            name = INTERP_TILE if target == "interpreter" else DEFAULT_TILE[dtype]
        bm, bn, bk, warps, stages = FUSED_TILES[name]
        out.update({f"{prefix}_tile": name, f"{prefix}_bm": bm, f"{prefix}_bn": bn, f"{prefix}_bk": bk,
                    f"{prefix}_warps": warps, f"{prefix}_stages": stages})
    out["fwd_flatten"] = bool(flags.get("flatten", False))
    band = flags.get("band", "auto")
    out["band"] = 0 if band == "auto" else int(band)            # 0: decided per call from the token count
    out["extra_budget"] = EXTRA_BUDGET
    out["interp_band"] = INTERP_BAND if target == "interpreter" else 0
    return out


def head_sizes(info: ModuleInfo) -> tuple[int, int, bool]:
    """(vocab, hidden, bias) of the LM head a chunked op is planned on."""
    from .loss_path import hidden_of, vocab_of

    facts = info.facts("CausalLM")
    bias = bool(facts["bias"]) if facts else bool(info.facts("Linear").get("bias"))
    return vocab_of(info), hidden_of(info), bias


def chunk_params(vocab: int, hidden: int, flags: Mapping[str, Any], dtype: str, target: str) -> tuple[int, str]:
    """(tokens per chunk, grad_weight accumulation) from the CHUNK_FLAGS."""
    chunk = flags.get("chunk", "auto")
    chunk = auto_chunk(vocab, dtype, target) if chunk == "auto" else int(chunk)
    acc = flags.get("accumulate", "auto")
    if acc == "auto":
        acc = "fp32" if vocab * hidden * 4 <= FP32_ACC_BUDGET else "weight"
    if dtype == "fp32":
        acc = "weight"      # same thing: the weight is fp32
    return chunk, acc


def lm_head_linear_reason(module: Any, info: ModuleInfo, facts: Mapping[str, Any]) -> str | None:
    """Why ``module`` (selected as a Linear) is not the plain lm_head of its causal LM, or None."""
    import torch
    if not isinstance(module, torch.nn.Linear):
        return f"{type(module).__name__} is not a plain nn.Linear (a LoRA delta would be missed)"
    if (info.path.rsplit(".", 1)[-1] != "lm_head" or module.out_features != facts["vocab"]
            or module.in_features != facts["hidden"]):
        return "this Linear is not the causal LM's lm_head"
    return None


class ChunkedHeadOp(Op):
    """What the chunked LM-head ops that take the logits as they are (no softcapping or scaling)
    share: fused_linear_logprobs and fused_linear_jsd.  Each adds its flags, template and forward;
    ``extra_params`` / ``name_tags`` add its own kernel parameters and name parts."""

    placements = ()          # a vocabulary-parallel form of log-probs / JSD is not written

    wraps_instance_forward = True      # calls the op does not compute go to the forward found on the instance
    kinds = ("Linear",)

    def host(self, info: ModuleInfo, index: Any) -> str:
        from .loss_path import causal_lm_host
        return causal_lm_host(info, index)

    def extra_params(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def name_tags(self, params: Mapping[str, Any]) -> list[str]:
        return []

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        vocab, hidden, bias = head_sizes(info)
        block, _, warps = ce_block(vocab, flags, target)
        chunk, acc = chunk_params(vocab, hidden, flags, dtype, target)
        return {"dtype": dtype, "w_dtype": dtype, "vocab": int(vocab), "hidden": int(hidden), "bias": bias,
                "BLOCK": block, "n_tiles": -(-vocab // block), "num_warps": warps, "chunk": chunk,
                "accumulate": acc, "ignore_index": int(flags.get("ignore_index", -100)),
                **self.extra_params(flags), "target": target, "tag": f"v{vocab}"}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        parts = [self.name, params["dtype"], f"h{params['hidden']}", f"v{params['vocab']}", *self.name_tags(params),
                 f"c{params['chunk']}"]
        if params["bias"]:
            parts.append("bias")
        parts.append(f"acc{params['accumulate']}")
        if params["ignore_index"] != -100:
            parts.append(f"ign{num_tag(params['ignore_index'])}")
        if params["n_tiles"] > 1:
            parts.append(f"b{params['BLOCK']}")
        parts.append(params.get("target", "cuda"))
        return "_".join(str(p) for p in parts)

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        from ..model.forward.causal_lm import host_reason, looks_causal_lm
        from ..model.forward.logits import transforms_logits
        f = info.facts("CausalLM")
        if not f:
            return "no enclosing causal LM (a module with model, lm_head and config) was found"
        what = transforms_logits(f)
        if what:
            return f"the model's forward transforms its logits ({what}), which {self.name} does not reproduce"
        if looks_causal_lm(module):
            return host_reason(module, info, flags, self.name)
        return lm_head_linear_reason(module, info, f)


class FusedLinearCrossEntropy(Op):
    # the loss-path forward calls an instance-level forward it finds (accelerate's mixed-precision
    # convert_outputs_to_fp32, TRL's head) for every call it does not compute itself
    wraps_instance_forward = True
    name = "fused_linear_cross_entropy"
    loss_role = "fused_linear_cross_entropy"      # what loss_path checks the host for (shared with liger.* loss ops)
    kinds = ("Linear",)
    placements = ("vocab",)
    template = "fused_linear_cross_entropy.py.j2"
    doc = ("lm_head matmul + cross entropy, never materialising the (tokens, vocab) logits. mode=chunked "
           "(default): token chunks with their logits in a buffer (cuBLAS), gradients computed in the forward "
           "and scaled by grad_output in the backward without a host sync. mode=fused: the logits never reach "
           "memory (softmax statistics in the Triton matmul's tiles; the backward recomputes them per vocab "
           "band, extra memory <= 64 MiB at 16384 x 1024 tokens x hidden); every loss flag is supported.")
    flags = LOSS_FLAGS[:3] + (
        FlagSpec("softcap", "float", "auto",
                 "final-logit softcapping cap*tanh(logits/cap); auto = the config's final_logit_softcapping "
                 "(Gemma); must match what the model's forward does", auto_ok=True, none_ok=True, min=0.0),
    ) + LOSS_FLAGS[3:] + CHUNK_FLAGS + FUSED_FLAGS

    def misfit(self, info: ModuleInfo, index: Any) -> str | None:
        from .loss_path import lm_head_misfit
        return lm_head_misfit(self.name, info, index)

    def host(self, info: ModuleInfo, index: Any) -> str:
        from .loss_path import causal_lm_host
        return causal_lm_host(info, index)

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        from ..model.forward.logits import resolve_multiplier, resolve_scaling, resolve_softcap
        facts = info.facts("CausalLM")
        vocab, hidden, bias = head_sizes(info)
        p = loss_params(vocab, flags, dtype, target, resolve_softcap(flags, facts), resolve_scaling(facts),
                        resolve_multiplier(facts))
        chunk, acc = chunk_params(vocab, hidden, flags, dtype, target)
        p.update({"hidden": hidden, "w_dtype": dtype, "bias": bias, "chunk": chunk, "accumulate": acc})
        p.update(fused_params(flags, dtype, target))
        return p

    def validate(self, flags: Mapping[str, Any]) -> str | None:
        """Flags of one mode given with the other mode (they would be silently ignored)."""
        fused = flags.get("mode", "auto") == "fused"
        for k in ("tile", "grad_tile"):
            if flags.get(k, "auto") != "auto" and flags[k] not in FUSED_TILES:
                return f"{k}={str(flags[k])[:60]!r} is not a known tile; known: {', '.join(FUSED_TILES)}"
        own = ("tile", "grad_tile", "band", "flatten") if not fused else ("chunk", "accumulate", "block", "programs_per_sm")
        given = [f"{k}={flags[k]}" for k in own if flags.get(k, "auto") not in ("auto", False)]
        if not given:
            return None
        if fused:
            return (f"{', '.join(given)} only apply to mode=chunked (token chunks and their row kernel); "
                    "mode=fused has no logits buffer: drop them or use mode=chunked")
        return (f"{', '.join(given)} only apply to mode=fused (the logits-free kernels); "
                f"mode={flags.get('mode', 'auto')} runs token chunks: add mode=fused or drop them")

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        name = loss_kernel_name(self.name, params)
        tgt = params.get("target", "cuda")
        if params.get("mode") == "fused":
            band = f"_band{params['band']}" if params["band"] else ""
            extra = (f"fused_{params['fwd_tile']}{'f' if params.get('fwd_flatten') else ''}_{params['bwd_tile']}{band}"
                     + ("_bias" if params["bias"] else ""))
        else:
            extra = f"c{params['chunk']}" + ("_bias" if params["bias"] else "") + f"_acc{params['accumulate']}"
        return name[: -len(tgt)] + extra + "_" + tgt

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        from ..model.forward.causal_lm import host_reason, looks_causal_lm
        from ..model.forward.logits import resolve_softcap
        f = info.facts("CausalLM")
        if not f:
            return "no enclosing causal LM (a module with model, lm_head and config) was found"
        if looks_causal_lm(module):
            return host_reason(module, info, flags, self.loss_role)
        why = lm_head_linear_reason(module, info, f)
        if why:
            return why
        got, want = resolve_softcap(flags, f), (float(f["softcap"]) if f.get("softcap") else None)
        if got != want:
            return (f"softcap={flags.get('softcap')} resolves to {got} but the model applies "
                    f"{'final_logit_softcapping=' + str(want) if want else 'no softcapping'}")
        return None

    def make_forward(self, module, kernels, flags, info):
        from .loss_path import make_forward
        return make_forward(module, kernels, flags, "linear")

    def install(self, host, kernels, flags, info):
        from ..model.forward.causal_lm import require_host
        from .loss_path import install_forward
        require_host(host, info, flags, self.loss_role)
        return install_forward(host, kernels, flags, "linear", self.vocab_parallel(info, flags))

    def vocab_parallel(self, info: ModuleInfo, flags: Mapping[str, Any]) -> Any:
        """The loss spec of the vocabulary-parallel loss when apply found the LM head sharded over the
        vocabulary (``Placement`` layout ``vocab``), else None (the kernel, as on one device)."""
        if info.facts("Placement").get("layout") != "vocab":
            return None
        import torch

        from ..distributed.vocab import LossSpec
        target = "cuda" if torch.cuda.is_available() else "interpreter"     # the chunk: as the kernel's
        return LossSpec.of(self.key_params(info, flags, info.dtype or "fp32", target))

    def placement_reason(self, flags: Mapping[str, Any], layout: str) -> str | None:
        if layout == "vocab" and flags.get("reduction", "mean") == "none":
            return "reduction=none is not vocabulary-parallel (one loss per token would need its gradient rows rescaled)"
        return None


register(FusedLinearCrossEntropy())
