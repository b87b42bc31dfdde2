"""Compile every op's cuda-target kernels for sm_90 on the CPU, discovered by running the ops.

The Triton interpreter (the CPU tests) accepts code the GPU compiler rejects (plain Python
globals read inside a kernel, loop-carried values changing type, ...).  This module finds every
kernel launch the cuda-target code makes, generically, and hands each one to Triton's own
compiler for sm_90 (ptxas ships with the triton wheel; no GPU is needed):

1. build a one-layer causal LM of a real family at real widths on the meta device, move it to
   CPU memory without initialising it (values are irrelevant: nothing is computed by a kernel);
2. for each registered op: install it (the op's own ``check``/``install``, kernels rendered for
   target ``cuda``) on every module of the index it accepts, run the model forward with labels
   and backward, and undo;
3. meanwhile ``kernel[grid](*args, **kwargs)`` records the launch instead of running it; each
   recorded launch gives a signature (tensor dtypes, int widths, constexpr values, num_warps)
   that is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``.

Adding an op needs no edit here: the registry, the index and the op's install do the work.
Every ``@triton.jit`` function of every generated module must end up compiled (launched, or
called from a launched kernel), so a kernel the run never reaches is reported, not skipped.

Runs in a subprocess (``python tests/kernels/cuda_compile.py <json>``) because TRITON_INTERPRET
is fixed when triton is imported; the tests set it to 0 there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Real widths of the families the specs ship for (one layer; vocab smaller than the real one
# where the real one only costs CPU memory and time and changes no specialisation).
VARIANTS = {
    # Qwen/Qwen3-0.6B: q_norm/k_norm (fused_qk_norm_rope), SwiGLU, tied 151936 vocab
    "qwen3": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                            rms_norm_eps=1e-6)),
    # google/gemma-3-1b widths: (1 + w) norms with fp32 scaling, gelu_tanh GeGLU, softcapping
    "gemma3": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, vocab_size=32000,
                                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                                   sliding_window=512, final_logit_softcapping=30.0)),
    # Phi-3-mini widths: fused gate_up_proj and qkv_proj, partial rotary 0.5, vocab 32064
    "phi3": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32064, partial_rotary_factor=0.5,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # stabilityai/stablelm-2-1_6b widths: LayerNorm with bias, partial rotary 0.25
    "stablelm": ("stablelm", dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                                  num_key_value_heads=32, vocab_size=100352, partial_rotary_factor=0.25)),
    # THUDM/glm-4-9b attention widths (intermediate cut to 4096): fused_rope with the interleaved layout, half-width
    # cos (GLM's repeat_interleave), partial rotary 0.5, 32 q / 2 kv heads (issue 25; Cohere's interleaved layout
    # differs only in loading cos/sin at the pairs' own offsets, the loads GLM's q/k use)
    "glm4": ("glm4", dict(hidden_size=4096, intermediate_size=4096, num_attention_heads=32, num_key_value_heads=2,
                          head_dim=128, vocab_size=4096, partial_rotary_factor=0.5, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)),
    # Qwen3-30B-A3B layer widths (hidden 2048, moe_intermediate 768), 8 of its 128 experts, top 2:
    # fused_experts with concatenated gate/up, SiLU, no bias
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=8,
                                    num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=4,
                                    head_dim=128, vocab_size=4096, decoder_sparse_step=1, mlp_only_layers=[])),
    # gpt-oss-20b widths (hidden 2880, intermediate 2880), 2 experts: transposed, interleaved gate/up,
    # biases, the clamped SwiGLU
    "gpt_oss": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=2,
                                num_experts_per_tok=2, num_attention_heads=64, num_key_value_heads=8,
                                head_dim=64, vocab_size=4096)),
    # bigcode/starcoder2-3b widths (hidden 3072, intermediate 12288, vocab cut to 4096): a plain MLP c_fc ->
    # gelu_tanh -> c_proj with biases (fused_mlp), LayerNorm with bias
    "starcoder2": ("starcoder2", dict(hidden_size=3072, intermediate_size=12288, num_attention_heads=24,
                                      num_key_value_heads=2, vocab_size=4096, use_bias=True)),
    # Qwen/Qwen3-Next-80B-A3B linear-attention layer widths (hidden 2048, 16 key / 32 value heads of 128), 4 of its
    # 512 experts: the gated RMSNorm (fused_rmsnorm_gated, head_v_dim 128, silu gate, llama casts; issue 25)
    "qwen3_next": ("qwen3_next", dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                                      linear_key_head_dim=128, linear_value_head_dim=128, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=512, num_attention_heads=16,
                                      num_key_value_heads=2, head_dim=256, vocab_size=4096, use_cache=False)),
    # deepseek-ai/DeepSeek-V3's router widths (256 experts in 8 groups, 4 kept, top 8; issue 37): the sigmoid
    # grouped top-k with the score-correction bias (fused_router); the rest of the layer cut down
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=1024, moe_intermediate_size=256, intermediate_size=1024,
                                        n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                                        n_shared_experts=1, first_k_dense_replace=0, num_attention_heads=8,
                                        num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=256,
                                        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, vocab_size=4096)),
}

# Variants that exist for a few ops compile only those (the other ops' kernels are compiled on the variants
# above; a Qwen3-Next layer with every op installed costs minutes of CPU in its torch delta-rule fallback).
VARIANT_OPS = {"qwen3_next": ("fused_rmsnorm_gated",), "deepseek_v3": ("fused_router",)}

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PTR = {"torch.float32": "*fp32", "torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.int64": "*i64",
       "torch.int32": "*i32", "torch.int16": "*i16", "torch.int8": "*i8", "torch.uint8": "*u8",
       "torch.bool": "*i1", "torch.float64": "*fp64",
       "torch.float8_e4m3fn": "*fp8e4nv", "torch.float8_e5m2": "*fp8e5"}      # fp8_linear's quantisation kernels
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


# ------------------------------------------------------------------------------------ child
def build_model(variant: str, dtype: str, meta: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = VARIANTS[variant]
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=1, max_position_embeddings=4096, **kw)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:1]
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=getattr(torch, TORCH_DTYPES[dtype]))
    if meta:
        return m
    m = m.to_empty(device="cpu")
    head = m.get_output_embeddings().weight
    with torch.no_grad():
        for p in m.parameters():      # small finite values (uninitialised memory may hold NaN)
            p.fill_(0.01)
            # matrices other than the LM head need no gradient (the backward kernels are reached
            # through the activations; 1-D norm weights and biases keep theirs): saves CPU time
            p.requires_grad_(p.dim() < 2 or p is head)
        for b in m.buffers():
            b.fill_(0.01) if b.is_floating_point() else b.zero_()
    return m.train()


def accepted_sites(op, model, index, flags):
    """(site path, merged info, host module, host path) of every module ``op`` accepts, one per
    host, chosen the way the runtime does: the op's kinds, its ``host``, its ``check``."""
    from patchdsl.model.modules import unwrap

    out, hosts = [], set()
    for info in index:
        if not any(k in info.kinds for k in op.kinds):
            continue
        host_path = op.host(info, index)
        if host_path in hosts:        # one op per host, as the runtime does
            continue
        minfo = info.with_host(index.infos.get(host_path))
        module = model.get_submodule(info.path) if info.path else model
        host = model.get_submodule(host_path) if host_path else model
        reason = op.check(unwrap(module), minfo, flags)
        if reason is None and host is not module:
            reason = op.check(unwrap(host), minfo, flags)
        if reason is None:
            out.append((info.path, minfo, host, host_path))
            hosts.add(host_path)
    return out


def resolved_flags(op, overrides):
    return {**op.default_flags(), **{k: op.flag(k).coerce(v) for k, v in overrides.items()}}


def _arg_type(v):
    """Triton signature type of a runtime argument (None: it is a constexpr)."""
    import torch

    if isinstance(v, torch.Tensor):
        return PTR[str(v.dtype)]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    return None


def launch_spec(fn, args, kwargs):
    """(signature, constexprs, options) of ``fn[grid](*args, **kwargs)``."""
    import triton.language as tl

    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    unknown = [k for k in kwargs if k not in fn.arg_names and k not in LAUNCH_OPTIONS]
    if unknown:
        raise TypeError(f"{fn.__name__}: unknown launch keyword(s) {unknown}")
    opts = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    sig, consts = {}, {}
    for p in fn.params:
        if p.name not in bound:
            if not p.has_default:
                raise TypeError(f"{fn.__name__}: argument {p.name} not passed")
            bound[p.name] = p.default
        v = bound[p.name]
        if isinstance(v, tl.constexpr):
            v = v.value
        t = None if p.is_constexpr else _arg_type(v)
        if t is None:
            sig[p.name] = "constexpr"
            consts[p.name] = v
        else:
            sig[p.name] = t
    return sig, consts, opts


def flag_variants(op) -> list[dict]:
    """Flag settings besides the defaults that select other compiled-in modes, one change at a
    time: every other choice of a choice flag, the other value of a bool flag, a non-zero value of
    a float flag that defaults to 0 (label smoothing, z-loss), both ends of a float flag on [0, 1]
    that defaults to neither (the JSD's beta), and a small ``block`` (forces the
    looped variants of kernels whose rows fit one block at real sizes)."""
    out = []
    for f in op.flags:
        if f.type == "choice":
            out += [{f.name: c} for c in f.choices if c != f.default]
        elif f.type == "bool":
            out.append({f.name: not f.default})
        elif f.type == "float" and f.default == 0.0:
            out.append({f.name: 0.1})
        elif f.type == "float" and f.min == 0.0 and f.max == 1.0 and f.default not in (0.0, 1.0):
            out += [{f.name: 0.0}, {f.name: 1.0}]      # the ends select other compiled-in modes (JSD's beta)
        elif f.type == "int" and f.name == "block":
            out.append({f.name: 256})
    # a flag of one mode alone is refused by the op (fused_linear_cross_entropy's flatten=true
    # without mode=fused): pair it with the first other variant that makes it valid
    fixed = []
    for v in out:
        if op.validate(resolved_flags(op, v)):
            v = next((dict(o, **v) for o in out if o is not v and not op.validate(resolved_flags(op, dict(o, **v)))), None)
        if v is not None and v not in fixed:
            fixed.append(v)
    return fixed


def _jit_functions(mod):
    from triton.runtime.jit import JITFunction

    return {name: fn for name, fn in vars(mod).items()
            if isinstance(fn, JITFunction) and getattr(fn.fn, "__module__", None) == mod.__name__}


def _stub_cuda_queries():
    """The cuda-target host code asks for the SM count; answer as an H200 would."""
    import types

    import torch

    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=132, name="NVIDIA H200 (stub)", total_memory=141 * 2**30)


def _generated_ops():
    """The registered ops whose Triton kernels patchdsl generates (external hub/liger ops load
    third-party ones; an op with ``triton_kernels = False`` generates host code around torch's own)."""
    from patchdsl.ops.registry import ops

    return [op for op in ops().values() if not op.external and op.triton_kernels]


_UNTOUCHED = 64 << 20     # bytes: glibc serves allocations this large with fresh mmap pages


def _no_matmul_mode():
    """A dispatch mode under which matrix products return zeros of the right shape, dtype and device
    (unwritten memory from _UNTOUCHED bytes up) instead of being computed.  The recording run needs only the shapes and dtypes that reach the
    kernel launches, and CPU bf16 matmuls at real widths (LM head, MLP) take many minutes on CPUs
    without native bf16 support (a fresh CI machine spent over 900 s in them)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    # fp8_linear's torch._scaled_mm too: emulated on the CPU, one fp8 LM-head product at a 100k vocab
    # took 10 s, once per flag variant
    products = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
    # the fp8 experts' grouped products: torch has no CPU kernel for _scaled_grouped_mm (the meta one
    # gives the shape; nothing of its values reaches a launch)
    products |= {aten._scaled_grouped_mm} if hasattr(aten, "_scaled_grouped_mm") else set()

    def to_meta(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    class NoMatmul(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket not in products:
                return func(*args, **kwargs)
            shape = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            out = kwargs.get("out")
            if out is not None:
                out.resize_(shape.shape)
                return out if out.numel() * out.element_size() >= _UNTOUCHED else out.zero_()
            if shape.numel() * shape.element_size() >= _UNTOUCHED:
                # a weight gradient at a real vocab (the LM head's [V, H]): writing zeros into it cost a
                # third of the run.  Left unwritten (no value of a product reaches a recorded launch's
                # specialisation, only shapes and dtypes do), and fresh mmap pages read as zeros anyway
                return torch.empty(shape.shape, dtype=shape.dtype, device=args[0].device)
            return torch.zeros(shape.shape, dtype=shape.dtype, device=args[0].device)

    return NoMatmul()


def flag_homes() -> dict[str, list[tuple[str, dict]]]:
    """variant -> the (op name, flag overrides) whose flag variant is compiled with that variant: the
    first variant (in VARIANTS order) with a site for it.  A compiled-in mode (label smoothing, fp8,
    a small block...) is compiled once, at the first family that has it, not at every family again
    (the flag variants were two thirds of the whole compile test's time); every family still compiles
    every op's default kernels in its own facts and widths."""
    from patchdsl.model.index import build_index

    homes: dict[str, list] = {v: [] for v in VARIANTS}
    models = {}
    for op in _generated_ops():
        for fv in flag_variants(op):
            flags = resolved_flags(op, fv)
            for v in VARIANTS:
                if op.name not in VARIANT_OPS.get(v, (op.name,)):
                    continue
                if v not in models:
                    m = build_model(v, "bf16", meta=True)
                    models[v] = (m, build_index(m))
                if accepted_sites(op, *models[v], flags):
                    homes[v].append((op.name, fv))
                    break
    return homes


def run_variant(variant: str, dtypes: list[str], out: str, flag_variants_too: bool | list = True) -> dict:
    """Record and compile ``variant``'s launches; ``flag_variants_too``: True (every op's flag
    variants, with the first dtype), False (none), or a list of [op name, overrides] to run."""
    os.environ.setdefault("PATCHDSL_CACHE", os.path.join(out, "kernels"))
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import KernelInterface

    from patchdsl.model.index import build_index
    from patchdsl.runtime.patch import kernel_getter

    assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"
    _stub_cuda_queries()
    launches: list = []
    modules: dict[str, object] = {}          # generated module name -> module
    orig_getitem = KernelInterface.__getitem__

    def record(self, grid):
        def launch(*args, **kwargs):
            launches.append((self, args, kwargs))
        return launch

    report = {"variant": variant, "sites": {}, "compiled": [], "uncompiled": [], "errors": []}
    KernelInterface.__getitem__ = record
    t_start = time.time()
    no_matmul = _no_matmul_mode()
    no_matmul.__enter__()
    try:
        for dtype in dtypes:
            torch.manual_seed(0)
            model = build_model(variant, dtype)
            index = build_index(model)
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (2, 8))
            embeds = torch.full((2, 8, model.config.hidden_size), 0.01, dtype=model.dtype, requires_grad=True)
            gen = [op for op in _generated_ops() if op.name in VARIANT_OPS.get(variant, (op.name,))]
            passes = [(op, {}) for op in gen]
            if flag_variants_too is True and dtype == dtypes[0]:
                passes += [(op, fv) for op in gen for fv in flag_variants(op)]
            elif flag_variants_too and dtype == dtypes[0]:
                by_name = {op.name: op for op in gen}
                passes += [(by_name[n], fv) for n, fv in flag_variants_too if n in by_name]
            for op, overrides in passes:
                undo, sites = [], []
                flags = resolved_flags(op, overrides)
                try:
                    for path, minfo, host, _ in accepted_sites(op, model, index, flags):
                        base = kernel_getter(op, minfo, flags, "cuda")

                        def kernels(dt, base=base):
                            m = base(dt)
                            modules[m.__name__] = m
                            return m

                        for obj, attr, value in op.install(host, kernels, flags, minfo):
                            undo.append((obj, attr, obj.__dict__.get(attr, undo)))
                            setattr(obj, attr, value)
                        sites.append(path)
                    if sites:
                        extra = {}
                        if op.name == "fused_linear_jsd":      # a distillation call: self-distillation, any teacher
                            extra = {"teacher_hidden_states": embeds.detach(), "teacher_head": model.lm_head}
                        res = model(inputs_embeds=embeds, labels=ids, **extra)
                        loss = res.loss if res.loss is not None else res.logits.float().sum()
                        loss.float().sum().backward()
                        model.zero_grad(set_to_none=True)
                        embeds.grad = None
                finally:
                    for obj, attr, old in reversed(undo):
                        if old is undo:
                            delattr(obj, attr)
                        else:
                            setattr(obj, attr, old)
                label = op.name + "".join(f" {k}={v}" for k, v in overrides.items())
                report["sites"].setdefault(label, {})[dtype] = sites
            del model
    finally:
        no_matmul.__exit__(None, None, None)
        KernelInterface.__getitem__ = orig_getitem

    target = GPUTarget("cuda", 90, 32)
    done: dict = {}
    compiled_src: dict[str, set] = {}        # module name -> names of jit functions compiled
    t_compile = time.time()
    for fn, args, kwargs in launches:
        sig, consts, opts = launch_spec(fn, args, kwargs)
        # Triton's cache key covers the function's source, the functions it calls and the globals it
        # reads: two generated modules with the same kernel text and constants compile to the same
        # binary, so the second is recorded as compiled with the first's result (fp8_linear emits one
        # module per projection shape with identical quantisation kernels)
        key = (fn.cache_key, json.dumps(sig), repr(sorted(consts.items())), repr(sorted(opts.items())))

        def compiled(seconds, **extra):
            compiled_src.setdefault(fn.fn.__module__, set()).add(fn.__name__)
            report["compiled"].append({"module": fn.fn.__module__, "kernel": fn.__name__, "signature": sig,
                                       "constexprs": {k: repr(v) for k, v in consts.items()}, "options": opts,
                                       "seconds": seconds, **extra})

        if key in done:
            if done[key] is not None:
                compiled(0.0, same_as_earlier=True)
            continue
        t0 = time.time()
        print(f"[{t0 - t_compile:6.1f}s] compiling {fn.fn.__module__}.{fn.__name__}", file=sys.stderr, flush=True)
        try:
            triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options=opts)
            done[key] = time.time() - t0
            compiled(round(done[key], 2))
        except Exception as e:        # collect all failures, then report them together
            done[key] = None
            report["errors"].append(f"{fn.fn.__module__}.{fn.__name__} {sig} {consts} {opts}: "
                                    f"{type(e).__name__}: {str(e)[-1500:]}")

    report["seconds"] = {"run": round(t_compile - t_start, 1), "compile": round(time.time() - t_compile, 1)}

    # Every @triton.jit function of every generated module must be compiled: launched, called
    # from a launched kernel, or the identical source compiled from another module (a template
    # may emit a helper every variant carries but only some modes launch, e.g. scale_rows).
    reached_src = set()
    for name, mod in modules.items():
        fns = _jit_functions(mod)
        reached = set(compiled_src.get(name, ()))
        grew = True
        while grew:
            grew = False
            for fname in fns:
                if fname not in reached and any(f"{fname}(" in fns[r].src for r in reached if r in fns):
                    reached.add(fname)
                    grew = True
        reached_src |= {fns[f].src for f in reached if f in fns}
    for name, mod in modules.items():
        report["uncompiled"] += [f"{name}.{f}" for f, fn in sorted(_jit_functions(mod).items())
                                 if fn.src not in reached_src]
    report["modules"] = sorted(modules)
    # modules with Triton kernels of their own (fp8_linear's module calls torch._scaled_mm only)
    report["kernel_modules"] = sorted(n for n, m in modules.items() if _jit_functions(m))
    return report


# ----------------------------------------------------------------------------------- parent
def compile_variant(tmp_path, variant: str, dtypes: list[str], flag_variants_too: bool | list = True,
                    timeout: float = 900) -> dict:
    """Run :func:`run_variant` in a subprocess with the interpreter off; return its report.

    The child says on stderr what it compiles; when it fails or runs out of time, its output is in
    the failure message."""
    import pytest

    pytest.importorskip("triton.backends.nvidia")
    out = str(tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=os.path.join(out, "triton_cache"),
               PATCHDSL_CACHE=os.path.join(out, "kernels"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), json.dumps([variant, dtypes, out, flag_variants_too])]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        def text(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else b or "")
        pytest.fail(f"sm_90 compile of {variant} {dtypes} took over {timeout:.0f} s; the child said:\n"
                    f"{text(e.stdout)[-2000:]}\n{text(e.stderr)[-6000:]}")
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas in this triton installation")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    variant, dtypes, out, flag_variants_too = json.loads(sys.argv[1])
    rep = run_variant(variant, dtypes, out, flag_variants_too)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1, default=repr)
