"""Mutation tests of ``patchdsl verify`` (issue 5's "Done when").

For every op, deliberately broken variants of its generated kernel (eps ignored, a masked tail
left unwritten, the weight gradient halved, a wrong sign in a backward formula, ...) must make
verify fail and name a site of that op -- and only sites of that op -- while the unbroken
kernels pass on the same model and spec.

How a kernel is broken without touching shipped code: the test replaces
``patchdsl.runtime.patch.load_kernel`` (the loader the runtime's per-site kernel getter calls)
with one that renders the op's template as usual, applies the mutation to the rendered source
(each edit is a regular expression that must match EXACTLY ONCE in its scope, so the test fails
loudly instead of silently testing an unmutated kernel when a template changes), writes it to a
temporary file and imports it from there.  Kernels of other ops load normally.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import patchdsl
import patchdsl.runtime.patch as runtime_patch
from patchdsl.codegen import render
from patchdsl.ops.registry import get_op
from tests.kernels.helpers import DEVICE

_counter = itertools.count()


# ---------------------------------------------------------------- tiny models
def tiny_qwen3():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3", hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=64,
        tie_word_embeddings=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():      # norm weights initialise to 1: make them matter (and differ)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.3)
    return model


def tiny_gemma3():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gemma3_text", hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=64,
        sliding_window=16, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():      # Gemma initialises norm weights to 0 (scale 1 + w): make w matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
    return model


def tiny_phi():
    """Phi-2 architecture: LayerNorm with bias (the LayerNorm family's representative)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "phi", hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=160, max_position_embeddings=64, partial_rotary_factor=0.5,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():      # LayerNorm initialises w = 1, b = 0: make both matter
        for n, p in model.named_parameters():
            if "layernorm" in n:
                p.normal_(0.5 if n.endswith("weight") else 0.0, 0.3)
    return model


def tiny_qwen3_moe():
    """Qwen3-MoE (issue 24): 4 experts, top 2, concatenated gate/up, SiLU."""
    from ..moe_families import tiny_moe_model

    return tiny_moe_model("qwen3_moe")


def tiny_gpt_oss():
    """gpt-oss (issue 24): transposed experts, interleaved gate/up, biases, the clamped SwiGLU."""
    from ..moe_families import tiny_moe_model

    return tiny_moe_model("gpt_oss")


def tiny_mixtral():
    """Mixtral (issue 24): a router that renormalises its top-k weights and keeps them in float32."""
    from ..moe_families import tiny_moe_model

    return tiny_moe_model("mixtral")


def tiny_deepseek_v3():
    """DeepSeek-V3 (issue 37): the sigmoid grouped top-k router, 8 experts in 4 groups, 2 kept, top 3, with a
    random score-correction bias and router weight (they initialise to zero and near zero)."""
    from ..moe_families import tiny_moe_model

    m = tiny_moe_model("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in m.model.layers:
            gate = layer.mlp.gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 2 / gate.weight.shape[1] ** 0.5)
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.3)
    return m


def tiny_qwen3_next():
    """Qwen3-Next (issue 25): a linear-attention layer whose output goes through the gated RMSNorm."""
    from ..model.test_gated_norms import tiny_qwen3_next as build

    return build()


MODELS = {"qwen3": tiny_qwen3, "gemma3": tiny_gemma3, "phi": tiny_phi, "qwen3_moe": tiny_qwen3_moe,
          "gpt_oss": tiny_gpt_oss, "mixtral": tiny_mixtral, "qwen3_next": tiny_qwen3_next,
          "deepseek_v3": tiny_deepseek_v3}

SPECS = {
    "fused_rmsnorm": "*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n",
    "fused_swiglu": "*.mlp: SwiGLU -> fused_swiglu\n",
    "fused_geglu": "*.mlp: GeGLU -> fused_geglu\n",
    "fused_mlp": "*.mlp: MLP -> fused_mlp\n",
    "fused_add_rmsnorm": "model.layers.*: DecoderLayer -> fused_add_rmsnorm\n",
    "fused_layernorm": "*.input_layernorm, model.final_layernorm: LayerNorm -> fused_layernorm\n",
    "fused_rope": "*.self_attn: Attention -> fused_rope\n",
    "fused_qk_norm_rope": "*.self_attn: Attention -> fused_qk_norm_rope\n",
    "fused_cross_entropy": "lm_head: Linear -> fused_cross_entropy\n",
    "fused_linear_cross_entropy": "lm_head: Linear -> fused_linear_cross_entropy(chunk=16)\n",
    "fused_linear_logprobs": "lm_head: Linear -> fused_linear_logprobs(chunk=16)\n",
    "fused_linear_jsd": "lm_head: Linear -> fused_linear_jsd(chunk=16)\n",
    # emulated: the recipe's numerics on the CPU (fp8 matmuls are refused off Hopper); verify's floor is the recipe's
    "fp8_linear": "*.mlp.{gate_proj,up_proj,down_proj}, *.self_attn.{q_proj,o_proj}: Linear -> fp8_linear(emulate=true)\n",
    "fused_experts": "*.mlp.experts: Experts -> fused_experts\n",
    "fused_router": "*.mlp.gate: Router -> fused_router\n",
    "fused_rmsnorm_gated": "*.linear_attn.norm: GatedRMSNorm -> fused_rmsnorm_gated\n",
}


# ---------------------------------------------------------------- the mutation machinery
@dataclass(frozen=True)
class Edit:
    pattern: str            # a regular expression (re.MULTILINE) that must match exactly once in scope
    replacement: str
    scope: str | None = None  # regex of the definition line the edit is confined to (up to the next one)
    count: int = 1            # how many times the pattern must match in scope ...
    nth: int = 0              # ... and which match (0-based) is replaced


@dataclass(frozen=True)
class Mutation:
    op: str
    name: str
    edits: tuple[Edit, ...]
    model: str = "qwen3"
    dtype: str = "bf16"
    expect: tuple[str, ...] = ()    # quantities that must be among the failing site checks
    spec: str | None = None         # the spec verified (default: SPECS[op])

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}-{self.model}-{self.dtype}"


_TOP = re.compile(r"^(?=@|def |class |[A-Za-z_][A-Za-z_0-9]* = )", re.M)


def _scope(src: str, scope: str | None) -> tuple[int, int]:
    if scope is None:
        return 0, len(src)
    starts = [m.start() for m in re.finditer(scope, src, re.M)]
    assert len(starts) == 1, f"scope {scope!r} found {len(starts)} times"
    start = starts[0]
    nxt = _TOP.search(src, start + 1)
    return start, (nxt.start() if nxt else len(src))


def apply_edits(src: str, edits: tuple[Edit, ...]) -> str:
    for e in edits:
        a, b = _scope(src, e.scope)
        region = src[a:b]
        hits = list(re.finditer(e.pattern, region, flags=re.M))
        assert len(hits) == e.count, (
            f"mutation pattern {e.pattern!r} matched {len(hits)} times (want exactly {e.count}) in "
            f"{e.scope or 'the kernel module'}; the template changed: update the mutation")
        h = hits[e.nth]
        region = region[:h.start()] + h.expand(e.replacement) + region[h.end():]
        src = src[:a] + region + src[b:]
    return src


@pytest.fixture
def mutate(monkeypatch, tmp_path):
    """``mutate(mutation)`` -> list that collects the names of the kernels it broke."""

    def activate(mutation: Mutation) -> list[str]:
        orig = runtime_patch.load_kernel
        broken: list[str] = []

        def load(key):
            if key.op != mutation.op:
                return orig(key)
            text = apply_edits(render(key), mutation.edits)
            path = Path(tmp_path) / f"{key.name}__{mutation.name}.py"
            path.write_text(text)
            modname = f"patchdsl_mutants.{path.stem}_{next(_counter)}"
            spec = importlib.util.spec_from_file_location(modname, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
            broken.append(key.name)
            return mod

        monkeypatch.setattr(runtime_patch, "load_kernel", load)
        return broken

    return activate


# ---------------------------------------------------------------- the mutations
RMS_FWD = r"^def rmsnorm_fwd_"
RMS_BWD = r"^def rmsnorm_bwd_"
ADD_FWD = r"^def add_rmsnorm_fwd_"
ADD_BWD = r"^def add_rmsnorm_bwd_"
GN_FWD = r"^def rmsnorm_gated_fwd_"
GN_BWD = r"^def rmsnorm_gated_bwd_"
LN_FWD = r"^def layernorm_fwd_"
LN_BWD = r"^def layernorm_bwd_"
ROPE_FWD = r"^def rope_fwd_"
ROPE_BWD = r"^def rope_bwd_"
QKNR_FWD = r"^def qk_norm_rope_fwd_"
QKNR_BWD = r"^def qk_norm_rope_bwd_"
CE_ROW = r"^def ce_row_"
GLU_FWD = r"^def \w+_mul_\w+_fwd\("
GLU_BWD = r"^def \w+_mul_\w+_bwd\("

ALL_MUTATIONS = [
    # ---- fused_rmsnorm (hidden 48: one block of 64, masked tail)
    Mutation("fused_rmsnorm", "eps_ignored", (Edit(r"^EPS = .*$", "EPS = 0.0"),), dtype="fp32",
             expect=("output",)),
    Mutation("fused_rmsnorm", "tail_unwritten",
             (Edit(r"^(\s*)m = cols < HIDDEN$", r"\1m = cols < HIDDEN - 1", RMS_FWD),
              Edit(r"y = torch\.empty_like\(", "y = torch.zeros_like(", r"^def rmsnorm_forward\(")),
             expect=("output",)),
    Mutation("fused_rmsnorm", "dw_halved",
             (Edit(r"^(\s*)return dx, dw$", r"\1return dx, dw * 0.5", r"^def rmsnorm_backward\("),),
             expect=("grad_weight",)),
    Mutation("fused_rmsnorm", "dx_sign",
             (Edit(r"\(g - xhat \*", "(g + xhat *", RMS_BWD),), expect=("grad_input",)),
    Mutation("fused_rmsnorm", "offset_dropped",
             (Edit(r"\(w \+ 1\.0\)\[None, :\]", "w[None, :]", RMS_FWD),),
             model="gemma3", expect=("output",)),
    # ---- fused_add_rmsnorm (on the decoder layer; covers post_attention_layernorm)
    Mutation("fused_add_rmsnorm", "residual_not_added",
             (Edit(r"s = \(x \+ r\)\.to\(", "s = (x).to(", ADD_FWD),), expect=("output",)),
    Mutation("fused_add_rmsnorm", "residual_grad_dropped",
             (Edit(r"\) \+ ds$", ")", ADD_BWD),), expect=("grad_input",)),
    Mutation("fused_add_rmsnorm", "dw_halved",
             (Edit(r"^(\s*)return dx, dw$", r"\1return dx, dw * 0.5",
                   r"^def add_rmsnorm_backward\("),), dtype="fp32",
             expect=("grad_post_attention_layernorm.weight",)),
    # ---- fused_rmsnorm_gated (issue 25; Qwen3-Next's linear-attention output norm: silu gate, llama casts)
    Mutation("fused_rmsnorm_gated", "gate_ignored", (Edit(r"^(\s*)y = h \* a$", r"\1y = h", GN_FWD),),
             model="qwen3_next", dtype="fp32", expect=("output",)),
    # (the gate's gradient is the norm's second input: a site check compares the first input's gradient only,
    # so a broken dgate fails verify end to end, naming no site; tests/kernels/test_rmsnorm_gated.py checks it)
    Mutation("fused_rmsnorm_gated", "dx_mean_term_dropped",
             (Edit(r"\(dn - xhat \* \(tl\.sum", "(dn - 0.0 * xhat * (tl.sum", GN_BWD),),
             model="qwen3_next", dtype="fp32", expect=("grad_input",)),
    Mutation("fused_rmsnorm_gated", "dw_halved",
             (Edit(r"^(\s*)return dx, dg, dw$", r"\1return dx, dg, dw * 0.5", r"^def rmsnorm_gated_backward\("),),
             model="qwen3_next", dtype="fp32"),
    # ---- fused_layernorm (Phi-2: with bias; hidden 48 in a block of 64)
    Mutation("fused_layernorm", "padding_in_variance",
             (Edit(r"xc = tl\.where\(m\[None, :\], x - mean\[:, None\], 0\.0\)", "xc = x - mean[:, None]", LN_FWD),),
             model="phi", dtype="fp32", expect=("output",)),
    Mutation("fused_layernorm", "dx_mean_term_dropped",
             (Edit(r" - c2\[:, None\]\)", ")", LN_BWD),), model="phi", expect=("grad_input",)),
    Mutation("fused_layernorm", "dbias_dropped",
             (Edit(r"db \+= tl\.where\(valid\[:, None\], dy, 0\.0\)", "db += tl.where(valid[:, None], dy * 0.0, 0.0)",
                   LN_BWD),), model="phi", expect=("grad_bias",)),
    # ---- fused_rope (Qwen3 attention: 4 q heads, 2 kv heads, head_dim 16)
    Mutation("fused_rope", "q_forward_sign",
             (Edit(r"y1 = x1 \* c1 - x2 \* s1", "y1 = x1 * c1 + x2 * s1", ROPE_FWD, count=2, nth=0),),
             expect=("output", "grad_q_proj.weight")),
    Mutation("fused_rope", "k_backward_sign",
             (Edit(r"y2 = x2 \* c2 - x1 \* s1", "y2 = x2 * c2 + x1 * s1", ROPE_BWD, count=2, nth=1),),
             expect=("grad_input", "grad_k_proj.weight")),
    Mutation("fused_rope", "position_ignored",
             (Edit(r"\(tok - b \* seq_len\) \* stride_cs", "0 * stride_cs", ROPE_FWD),), dtype="fp32",
             expect=("grad_q_proj.weight",)),
    # ---- fused_qk_norm_rope (Qwen3: q_norm/k_norm fused with RoPE)
    Mutation("fused_qk_norm_rope", "k_uses_q_norm_weight",
             (Edit(r"\* wk1\)", "* wq1)", QKNR_FWD),), expect=("output", "grad_k_proj.weight")),
    Mutation("fused_qk_norm_rope", "q_rms_over_half_head",
             (Edit(r"/ HEAD_DIM \+ EPS\)", "/ HALF + EPS)", QKNR_FWD, count=2, nth=0),), expect=("output",)),
    Mutation("fused_qk_norm_rope", "k_backward_rotation_sign",
             (Edit(r"dn2 = dy2 \* c2 - dy1 \* s1", "dn2 = dy2 * c2 + dy1 * s1", QKNR_BWD, count=2, nth=1),),
             expect=("grad_k_proj.weight", "grad_k_norm.weight")),
    Mutation("fused_qk_norm_rope", "dwk_half_dropped",
             (Edit(r"dwk2 \+= ", "dwk2 += 0.0 * ", QKNR_BWD),), dtype="fp32", expect=("grad_k_norm.weight",)),
    # ---- fused_cross_entropy (on lm_head, hosted by the causal LM; vocab 160 in a block of 256).
    # HF shifts the labels and pads each sequence's end with -100, so every batch has ignored rows.
    # The ignore_index mutants run with check_labels=false: with the check on, the label range check
    # meets the -100 labels the broken branch lets through and raises IndexError (see
    # test_ignore_index_mutant_trips_the_label_check); off, verify's numbers must catch the bug alone.
    Mutation("fused_cross_entropy", "ignore_index_not_ignored",
             (Edit(r"if label == IGNORE_INDEX:", "if label == IGNORE_INDEX + 1:", CE_ROW),),
             expect=("loss", "grad_input", "grad_weight"),
             spec="lm_head: Linear -> fused_cross_entropy(check_labels=false)\n"),
    Mutation("fused_cross_entropy", "padding_in_logsumexp",
             (Edit(r"^(\s*)(\w+) = tl\.where\(msk, z, float\(\"-inf\"\)\)$", r"\1\2 = z", CE_ROW),), expect=("loss",)),
    Mutation("fused_cross_entropy", "label_grad_sign",
             (Edit(r"g - 1\.0", "g + 1.0", CE_ROW),), expect=("grad_input", "grad_weight")),
    # ---- fused_linear_cross_entropy (24 rows in chunks of 16: two chunks)
    Mutation("fused_linear_cross_entropy", "ignore_index_not_ignored",
             (Edit(r"if label == IGNORE_INDEX:", "if label == IGNORE_INDEX + 1:", CE_ROW),),
             expect=("loss", "grad_input", "grad_weight"),
             spec="lm_head: Linear -> fused_linear_cross_entropy(chunk=16, check_labels=false)\n"),
    Mutation("fused_linear_cross_entropy", "grad_w_first_chunk_only",
             (Edit(r"^(\s*)if need_w:\n", r"\1if need_w and i == 0:\n", r"^def _chunks\("),),
             dtype="fp32", expect=("grad_weight",)),
    Mutation("fused_linear_cross_entropy", "grad_not_divided_by_token_count",
             (Edit(r"^\s*g = g \* scale\n", "", CE_ROW),), expect=("grad_input", "grad_weight")),
    # ---- fused_linear_logprobs (verify's training call with labels: the loss from the log-probs;
    #      22 shifted rows in chunks of 16: two chunks; no ignored target reaches the kernel here, so
    #      ignore_index handling is covered by tests/kernels/test_linear_logprobs.py instead)
    Mutation("fused_linear_logprobs", "logprob_not_normalised",
             (Edit(r"zt - lse\)", "zt - m)", r"^def logprob_fwd_"),), expect=("loss",)),
    Mutation("fused_linear_logprobs", "target_grad_sign",
             (Edit(r"g \+ g_lp, g\)", "g - g_lp, g)", r"^def logprob_bwd_"),), expect=("grad_input", "grad_weight")),
    Mutation("fused_linear_logprobs", "grad_w_first_chunk_only",
             (Edit(r"^(\s*)if need_w:\n", r"\1if need_w and s == 0:\n", r"^def linear_logprobs_backward\("),),
             dtype="fp32", expect=("grad_weight",)),
    # ---- fused_linear_jsd (verify gives a synthetic teacher, Op.parity_kwargs; beta 0.5; 22 shifted
    #      rows in chunks of 16: two chunks)
    Mutation("fused_linear_jsd", "student_not_normalised",
             (Edit(r"lse_s = ms \+ tl\.log\(ss\)", "lse_s = ms", r"^def jsd_rows_"),), expect=("loss",)),
    Mutation("fused_linear_jsd", "softmax_jacobian_dropped",
             (Edit(r"\(g - ps \* acc_g\) \* g_scale", "g * g_scale", r"^def jsd_rows_"),),
             expect=("grad_input", "grad_weight")),
    Mutation("fused_linear_jsd", "grad_w_first_chunk_only",
             (Edit(r"^(\s*)if need_w:\n", r"\1if need_w and s == 0:\n", r"^def linear_jsd_forward\("),),
             dtype="fp32", expect=("grad_weight",)),
    # ---- fused_swiglu (intermediate 80: one block of 128, masked tail)
    Mutation("fused_swiglu", "dgate_sign",
             (Edit(r"s \* \(1\.0 \+ g \* \(1\.0 - s\)\)", "s * (1.0 - g * (1.0 - s))",
                   r"^def _act_and_grad\("),), expect=("grad_input", "grad_gate_proj.weight")),
    Mutation("fused_swiglu", "dup_without_activation",
             (Edit(r"\(dy \* a\)", "(dy * g)", GLU_BWD),), expect=("grad_up_proj.weight",)),
    Mutation("fused_swiglu", "tail_unwritten",
             (Edit(r"m = offs < n_elem$", "m = offs < n_elem - 1", GLU_FWD),     # the flat layout (default)
              Edit(r"out = torch\.empty_like\(", "out = torch.zeros_like(", r"^def swiglu_forward\(")),
             dtype="fp32", expect=("output",)),
    # ---- fp8_linear (rowwise, emulated): a dequantisation factor off by 2 is an O(1) error, beyond the
    #      recipe's bound (0.25 + the dtype floor) that a correct fp8 projection stays well within
    Mutation("fp8_linear", "grad_weight_scale_doubled",
             (Edit(r"dw = scaled_mm\(dtq, dts, xtq, xts,", "dw = scaled_mm(dtq, dts, xtq, 2 * xts,",
                   r"^def fp8_linear_backward\("),), expect=("grad_weight",)),
    Mutation("fp8_linear", "weight_scale_not_inverted",
             (Edit(r"y = scaled_mm\(xq, xs, wq, ws,", "y = scaled_mm(xq, xs, wq, ws.reciprocal(),",
                   r"^def fp8_linear_forward\("),), dtype="fp32", expect=("output",)),
    # ---- fused_experts (issue 24; Qwen3-MoE: 4 experts top 2; gpt-oss: transposed, interleaved, biases, clamp)
    Mutation("fused_experts", "dgate_sign",
             (Edit(r"s \* \(1\.0 \+ g \* \(1\.0 - s\)\)", "s * (1.0 - g * (1.0 - s))", r"^def _act_grad\("),),
             model="qwen3_moe", expect=("grad_input", "grad_gate_up_proj")),
    Mutation("fused_experts", "routing_weight_ignored",
             (Edit(r"y = y \* tl\.load\(W \+ slot", "y = y + 0.0 * tl.load(W + slot", r"^def _combine_kernel\("),),
             model="qwen3_moe", expect=("output",)),
    Mutation("fused_experts", "router_grad_dropped",
             (Edit(r"dw\[r\.perm\] = dw_sorted", "dw[r.perm] = dw_sorted * 0.0", r"^def experts_backward\("),),
             model="qwen3_moe", expect=("grad_top_k_weights",)),
    Mutation("fused_experts", "dw_down_halved",
             (Edit(r"tl\.store\(gp \+ n\[None, :\], \(h \* w", "tl.store(gp + n[None, :], (0.5 * h * w", r"^def _act_bwd_kernel\("),),
             model="qwen3_moe", dtype="fp32", expect=("grad_down_proj",)),
    Mutation("fused_experts", "up_plus_one_dropped",
             (Edit(r"return \(uc \+ 1\.0\) \* \(gc", "return (uc) * (gc", r"^def _act\("),),
             model="gpt_oss", expect=("output",)),
    Mutation("fused_experts", "gate_up_bias_grad_dropped",
             (Edit(r"acc \+= tl\.sum\(a, axis=0\)", "acc += 0.0 * tl.sum(a, axis=0)", r"^def _segsum_kernel\("),),
             model="gpt_oss", dtype="fp32", expect=("grad_gate_up_proj_bias", "grad_down_proj_bias")),
    # ---- fused_router (issue 24; Qwen3-MoE: softmax top-2 of 4, not renormalised; Mixtral: renormalised)
    Mutation("fused_router", "softmax_denominator_dropped",
             (Edit(r"w = tl\.exp\(sel_v - mx\[:, None\]\) / den\[:, None\]", "w = tl.exp(sel_v - mx[:, None])",
                   r"^def router_fwd_kernel\("),), model="qwen3_moe", expect=("top_k_weights",)),
    Mutation("fused_router", "softmax_grad_mean_dropped",
             (Edit(r"dl = p \* \(G - s\[:, None\]\)", "dl = p * G", r"^def router_bwd_kernel\("),),
             model="qwen3_moe", expect=("grad_input_via_weights", "grad_weight_via_weights")),
    Mutation("fused_router", "renormalised_grad_mean_dropped",
             (Edit(r"c = w \* \(g - tl\.sum\(g \* w, 1\)\[:, None\]\)", "c = w * g", r"^def router_bwd_kernel\("),),
             model="mixtral", dtype="fp32", expect=("grad_input_via_weights",)),
    Mutation("fused_router", "second_choice_repeats_the_first",
             (Edit(r"work = tl\.where\(cols\[None, :\] == i\[:, None\], float\(\"-inf\"\), work\)", "work = work",
                   r"^def router_fwd_kernel\("),), model="mixtral", expect=("top_k_index",)),
    # ---- fused_router's sigmoid grouped top-k (issue 37; DeepSeek-V3: 8 experts, 4 groups, 2 kept, top 3)
    Mutation("fused_router", "correction_bias_ignored_in_the_choice",
             (Edit(r"c = s \+ tl\.load\(B \+ cols", "c = s + 0.0 * tl.load(B + cols", r"^def grouped_fwd_kernel\("),),
             model="deepseek_v3", expect=("top_k_index",)),
    Mutation("fused_router", "correction_bias_in_the_weights",
             (Edit(r"s, 0\.0\), 1\)        # its un-biased score", "c, 0.0), 1)", r"^def grouped_fwd_kernel\("),),
             model="deepseek_v3", expect=("top_k_weights",)),
    Mutation("fused_router", "groups_ranked_by_their_best",
             (Edit(r"\(m1 \+ m2\)\[:, None\]", "m1[:, None]", r"^def grouped_fwd_kernel\("),),
             model="deepseek_v3", expect=("top_k_index",)),
    Mutation("fused_router", "sigmoid_derivative_dropped",
             (Edit(r"c = ds \* ssel \* \(1\.0 - ssel\)", "c = ds * ssel", r"^def grouped_bwd_kernel\("),),
             model="deepseek_v3", dtype="fp32", expect=("grad_input_via_weights", "grad_weight_via_weights")),
    # ---- fused_geglu (Gemma 3: tanh GELU)
    Mutation("fused_geglu", "dup_without_activation",
             (Edit(r"\(dy \* a\)", "(dy * g)", GLU_BWD),), model="gemma3", expect=("grad_up_proj.weight",)),
    Mutation("fused_geglu", "up_ignored",
             (Edit(r"\(_act\(g\) \* u\)", "_act(g)", GLU_FWD),), model="gemma3", dtype="fp32",
             expect=("output",)),
    # ---- fused_mlp (Phi-2: fc1 -> gelu_new (tanh GELU) -> fc2, both with bias; intermediate 80)
    Mutation("fused_mlp", "act_derivative_dropped",
             (Edit(r"return h \* s, s \+ h \* s \* \(1\.0 - s\) \* \(", "return h * s, s + 0.0 * (", r"^def _act_and_grad\("),),
             model="phi", expect=("grad_input", "grad_fc1.weight")),
    Mutation("fused_mlp", "recomputed_act_is_preactivation",
             (Edit(r"tl\.store\(A \+ offs, a\.to\(", "tl.store(A + offs, h.to(", r"^def \w+_bwd\("),),
             model="phi", expect=("grad_fc2.weight",)),
    Mutation("fused_mlp", "down_bias_grad_halved",
             (Edit(r"db = dy2\.sum\(0\) if need_db", "db = dy2.sum(0) * 0.5 if need_db", r"^def mlp_down_backward\("),),
             model="phi", expect=("grad_fc2.bias",)),
    Mutation("fused_mlp", "forward_without_activation",
             (Edit(r"tl\.store\(A \+ offs, _act\(h\)\.to\(", "tl.store(A + offs, (h).to(", r"^def \w+_fwd\("),),
             model="phi", dtype="fp32", expect=("output",)),
]


def _template_of(op: str) -> str | None:
    o = get_op(op)
    if o is None:
        return None
    from patchdsl.util.resources import templates_dir

    return o.template if (templates_dir() / o.template).is_file() else None


MUTATIONS = [m for m in ALL_MUTATIONS if _template_of(m.op)]
BASELINES = sorted({(m.op, m.model, m.dtype) for m in MUTATIONS})


def _verify(op: str, model: str, dtype: str, spec: str | None = None):
    return patchdsl.verify(spec or SPECS[op], MODELS[model], dtype=dtype, batch=2, seq=12, seed=3, device=DEVICE)


def _site_ops(report) -> dict[str, str]:
    return {s["path"]: s["op"] for s in report.sites}


@pytest.mark.parametrize("op,model,dtype", BASELINES, ids=["-".join(b) for b in BASELINES])
def test_unbroken_kernels_pass(op, model, dtype):
    report = _verify(op, model, dtype)
    assert report.sites and all(s["op"] == op for s in report.sites)
    assert report.passed, [(r.path, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_broken_kernel_fails_and_names_the_site(mutation, mutate):
    broken = mutate(mutation)
    report = _verify(mutation.op, mutation.model, mutation.dtype, mutation.spec)
    assert broken, "the mutated kernel was never loaded"
    assert not report.passed and report.exit_code() == 1
    failed = report.failed_sites()
    assert failed, f"{mutation.id}: verify failed only end to end, naming no site"
    ops = _site_ops(report)
    assert {ops[p] for p in failed} == {mutation.op}
    for p in failed:
        assert f"{p or '<model>'} ({mutation.op})" in report.verdict or "..." in report.verdict
    bad_q = {r.quantity for r in report.failures() if r.kind == "site"}
    missing = set(mutation.expect) - bad_q
    assert not missing, f"{mutation.id}: expected {sorted(missing)} to fail too; failed: {sorted(bad_q)}"


@pytest.mark.parametrize("op", ["fused_cross_entropy", "fused_linear_cross_entropy"])
def test_ignore_index_mutant_trips_the_label_check(op, mutate):
    """With check_labels on (the default), a kernel whose ignore branch is broken meets HF's -100
    padding as a label out of [0, vocab): the kernel's range check clears the flag while the host
    finds every label valid, and the error says the kernel is wrong (never a made-up label)."""
    mutation = next(m for m in MUTATIONS if m.op == op and m.name == "ignore_index_not_ignored")
    assert "check_labels=false" in mutation.spec
    broken = mutate(mutation)
    with pytest.raises(IndexError, match=r"out of bounds that the host check does not.*the kernel is wrong"):
        _verify(op, mutation.model, mutation.dtype)
    assert broken


def test_every_registered_op_has_a_mutation():
    """An op whose template exists must have at least one mutation here."""
    from patchdsl.ops.registry import ops

    have = {m.op for m in MUTATIONS}
    missing = [name for name in ops() if _template_of(name) and name not in have]
    assert not missing, f"no mutation test for {missing}"


def test_a_pattern_that_does_not_match_is_an_error():
    with pytest.raises(AssertionError, match="matched 0 times"):
        apply_edits("x = 1\n", (Edit(r"^y = 1$", "y = 2"),))
    with pytest.raises(AssertionError, match="matched 2 times"):
        apply_edits("x = 1\nx = 1\n", (Edit(r"^x = 1$", "x = 2"),))
    assert apply_edits("x = 1\nx = 1\n", (Edit(r"^x = (1)$", r"x = \g<1>2", count=2, nth=1),)) == "x = 1\nx = 12\n"
    src = "def f():\n    a = 1\n\n\ndef g():\n    a = 1\n"
    assert apply_edits(src, (Edit(r"a = 1", "a = 2", r"^def g\("),)) == src[:-2] + "2\n"
