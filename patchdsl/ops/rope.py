"""fused_rope: RoPE of q and k in one launch (rotate_half or interleaved pairs, any GQA head counts, partial rotary).

The op replaces the ATTENTION module's forward (see :mod:`patchdsl.ops.attention_forward`):
the projections run through the projection modules, q_norm/k_norm (Qwen3, Gemma3) are called as
modules (they may be patched themselves), and the kernel rotates q and k in the contiguous
(batch, seq, heads, head_dim) projection layout before HF's transpose.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX
from ..model.info import ModuleInfo
from .registry import register
from .common import next_pow2

SUPPORTED_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


def rope_geometry(f: Mapping[str, Any], flags: Mapping[str, Any], target: str) -> dict[str, Any]:
    """Tile shapes for the rope kernels (shared with fused_qk_norm_rope).

    A tile is (heads x rotary half); all heads of a token fit one tile when
    heads * half <= block (auto: 4096 elements on cuda, 1024 on the interpreter), else the
    heads are looped in tiles.  Short tokens are packed several per program on cuda.
    """
    d = int(f["head_dim"])
    r = int(f["rotary_dim"])
    nq, nk = int(f["n_heads"]), int(f["n_kv_heads"])
    half = r // 2
    half_pad = next_pow2(half)
    pass_dim = d - r
    pass_pad = next_pow2(pass_dim) if pass_dim else 0
    block = flags.get("block", "auto")
    cap = (1024 if target == "interpreter" else 4096) if block == "auto" else next_pow2(int(block))
    max_heads = max(1, cap // half_pad)

    def tiling(nh: int) -> tuple[int, bool, bool]:
        bh = min(next_pow2(nh), max_heads)
        loop = bh < nh
        return bh, loop, nh % bh != 0 if loop else bh != nh

    bq, q_loop, q_mask = tiling(nq)
    bk, k_loop, k_mask = tiling(nk)
    tpp = flags.get("tokens_per_program", "auto")
    if tpp == "auto":
        per_token = (nq + nk) * d
        if target == "interpreter":
            tpp = 2
        else:
            # measured on H200 (bf16, 8x2048 tokens): one token per program is best from 2048
            # elements per token (Qwen3-0.6B: 3072); shorter tokens are packed
            tpp = 1 if per_token >= 2048 else 2 if per_token >= 1024 else 4
    tile = max(bq, bk) * half_pad * 2
    warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    return {
        "head_dim": d, "rotary_dim": r, "half": half, "half_pad": half_pad, "half_mask": half_pad != half,
        "pass_dim": pass_dim, "pass_pad": pass_pad, "pass_mask": pass_pad != pass_dim,
        "n_q_heads": nq, "n_kv_heads": nk,
        "q_block_heads": bq, "q_loop": q_loop, "q_head_mask": q_mask,
        "k_block_heads": bk, "k_loop": k_loop, "k_head_mask": k_mask,
        "tokens_per_program": int(tpp), "num_warps": warps,
    }


def attention_reason(f: Mapping[str, Any]) -> str | None:
    if not f:
        return "not an attention module with rotary embeddings (needs q/k/v/o projections, head_dim and heads)"
    r, d = int(f.get("rotary_dim", 0)), int(f["head_dim"])
    if r <= 0 or r > d or r % 2:
        return f"rotary_dim {r} must be even and in 1..head_dim ({d})"
    if int(f["n_heads"]) % max(1, int(f["n_kv_heads"])):
        return f"{f['n_heads']} query heads are not a multiple of {f['n_kv_heads']} key/value heads"
    return None


def norm_scope(module: Any, f: Mapping[str, Any]) -> str | None:
    """What the attention's q_norm/k_norm normalise: "head" (each head, head_dim wide: Qwen3), "projection"
    (the whole q / k projection, heads x head_dim wide: OLMo 2/3), or None (neither: refused)."""
    from ..model.modules import unwrap

    d, nq, nk = int(f["head_dim"]), int(f["n_heads"]), int(f["n_kv_heads"])
    widths = []
    for n in ("q_norm", "k_norm"):
        w = getattr(unwrap(getattr(module, n, None)), "weight", None)
        if w is None or w.dim() != 1:
            return None
        widths.append(int(w.shape[0]))
    if widths == [d, d]:
        return "head"
    if widths == [nq * d, nk * d]:
        return "projection"
    return None


def apply_qk_norms(self: Any, q: Any, k: Any, scope: str | None):
    """q_norm/k_norm called as modules on (batch, seq, heads, head_dim) q and k: per head, or over the
    whole projection (the contiguous heads x head_dim of each token, as the projection produced it)."""
    if scope == "projection":
        qs, ks = q.shape, k.shape
        return (self.q_norm(q.reshape(*qs[:-2], qs[-2] * qs[-1])).view(qs),
                self.k_norm(k.reshape(*ks[:-2], ks[-2] * ks[-1])).view(ks))
    return self.q_norm(q), self.k_norm(k)


ROPE_FLAGS = (
    FlagSpec("block", "int", "auto",
             "tile size in elements (heads x rotary_dim/2, power of two); all heads of a token in one tile "
             "when they fit, else heads are looped; auto = 4096 on cuda, 1024 on the interpreter",
             auto_ok=True, min=16, max=BLOCK_MAX),
    FlagSpec("tokens_per_program", "int", "auto",
             "tokens each program rotates (more for short heads); auto = by (q heads + k heads) x head_dim",
             auto_ok=True, min=1, max=64),
)


def kernel_facts(f: Mapping[str, Any]) -> dict[str, Any]:
    """The Attention facts as the fused_rope kernel sees them: where the model slices q/k to the rotary
    dims before calling apply_rotary_pos_emb (Phi, StableLM, Persimmon), the kernel's heads are
    rotary_dim wide (no pass-through: the model concatenates the rest back itself)."""
    f = dict(f)
    if f.get("rope_input") == "rotary":
        f["head_dim"] = f["rotary_dim"]
    return f


def rope_route(module: Any, f: Mapping[str, Any]):
    """How fused_rope patches ``module``: ``("rebuild", analysis, norm scope)`` (the forward rebuilt
    around the kernel, attention_forward), ``("swap", RopeSwap)`` (the original forward with its
    apply_rotary_pos_emb resolved to the kernel, attention_swap), or a refusal reason (str)."""
    from ..model.forward.attention import analyse
    from .attention_forward import probe
    from .attention_swap import analyse_swap, probe_swap
    from ..model.forward.rotary import reference_rotary

    layout = f.get("rotary_layout", "rotate_half")
    an = analyse(type(module))
    first = an if isinstance(an, str) else None
    if first is None:
        scope = norm_scope(module, f) if an.qk_norm else None
        if an.qk_norm and scope is None:
            first = ("its q_norm/k_norm normalise neither each head (head_dim) nor the whole q/k projection "
                     "(heads x head_dim), so the replacement cannot call them")
            from ..model.modules import unwrap
            if all(getattr(getattr(unwrap(getattr(module, n, None)), "weight", None), "dim", lambda: 0)() == 1
                   for n in ("q_norm", "k_norm")):
                return first        # weights of another width: this module's own structure is inconsistent
        else:
            def qk_ref(self, q, k, cos, sin):
                if an.qk_norm:
                    q, k = apply_qk_norms(self, q, k, scope)
                return reference_rotary(q, k, cos, sin, layout)

            first = probe(module, dict(f), an, qk_ref, f"rope_{layout}",
                          lambda self, q, k: apply_qk_norms(self, q, k, scope) if an.qk_norm else (q, k))
            if first is None:
                return ("rebuild", an, scope)
    sw = analyse_swap(type(module))
    if isinstance(sw, str):
        return first
    why = probe_swap(module, dict(f), sw)
    return ("swap", sw) if why is None else why


class FusedRope(Op):
    name = "fused_rope"
    kinds = ("Attention",)
    template = "fused_rope.py.j2"
    doc = ("RoPE of q and k in one launch, forward and backward: rotate_half (Llama), interleaved pairs "
           "(Cohere; GLM's half-width cos), partial rotary; replaces the attention forward, keeping "
           "projections, q/k norms, KV cache and attention interface (or runs the model's own forward "
           "with its apply_rotary_pos_emb resolved to the kernel: Phi, GPT-NeoX, StableLM, Persimmon).")
    flags = ROPE_FLAGS

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        f = info.facts("Attention")
        g = rope_geometry(kernel_facts(f), flags, target)
        layout = f.get("rotary_layout", "rotate_half")
        tag = f"d{g['head_dim']}_r{g['rotary_dim']}_q{g['n_q_heads']}k{g['n_kv_heads']}"
        if layout != "rotate_half":
            tag += "_" + layout
        # the model's apply_rotary_pos_emb casts its result back to q's dtype (OLMo 2/3) or returns the promotion
        out_cast = f.get("rotary_out_dtype") == "input"
        if out_cast:
            tag += "_cast"
        return {"dtype": dtype, **g, "rotary_layout": layout, "out_cast": out_cast, "target": target, "tag": tag}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return f"{self.name}_{params['dtype']}_{params['tag']}_{params['target']}"

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        f = info.facts("Attention")
        reason = attention_reason(f)
        if reason:
            return reason
        route = rope_route(module, f)
        return route if isinstance(route, str) else None

    def make_forward(self, module, kernels, flags, info):
        from .attention_forward import build_forward
        from .attention_swap import build_swapped_forward
        from ..model.forward.rotary import reference_rotary

        f = info.facts("Attention")
        layout = f.get("rotary_layout", "rotate_half")
        route = rope_route(module, f)
        if isinstance(route, str):
            raise ValueError(f"{self.name} cannot patch {type(module).__name__}: {route}")

        out_cast = f.get("rotary_out_dtype") == "input"

        def fused(q, k, cos, sin):
            if cos.requires_grad or sin.requires_grad or str(q.dtype) not in SUPPORTED_DTYPES or q.dtype != k.dtype:
                qo, ko = reference_rotary(q, k, cos, sin, layout)  # learned cos/sin or an unsupported dtype: plain torch
                return (qo.to(q.dtype), ko.to(k.dtype)) if out_cast else (qo, ko)
            return kernels(q.dtype).rope(q, k, cos, sin)

        if route[0] == "swap":
            return build_swapped_forward(route[1], fused)
        an, scope = route[1], route[2]
        norm = an.qk_norm

        def qk(self, q, k, cos, sin):
            if norm:
                q, k = apply_qk_norms(self, q, k, scope)
            return fused(q, k, cos, sin)

        return build_forward(an, qk, lambda self, q, k: apply_qk_norms(self, q, k, scope) if norm else (q, k))


register(FusedRope())
